"""Training inputs from S3: shard prefixes, the local cache, and its invalidation by content hash.

Run: `.venv/bin/python -m pytest tests/integration/test_train_inputs.py -q`
"""

from __future__ import annotations

import pytest

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import write_artifact
from dflash_core.train.inputs import fetch_shards


@pytest.mark.filterwarnings("ignore:allow_failed_quality_gate is set")  # these bytes are not real shards
def test_prefix_fetch_and_cache_invalidated_by_hash(store, prefix, tmp_path) -> None:
    first = write_artifact(store, f"{prefix}/tok/shard-00000.arrow", b"A" * 64, kind=ArtifactKind.TOKENIZED)
    write_artifact(store, f"{prefix}/tok/shard-00001.arrow", b"B" * 64, kind=ArtifactKind.TOKENIZED)
    store.put_bytes(f"{prefix}/tok/notes.txt", b"not a shard")
    shards = fetch_shards([f"{prefix}/tok/"], store=store, cache_dir=tmp_path, allow_failed_quality_gate=True)
    assert [path.read_bytes()[:1] for path, _ in shards] == [b"A", b"B"]
    assert shards[0][1].uri == first.uri and shards[0][1].sha256 == first.sha256
    # Re-tokenized with the same size: the cached copy must not be reused.
    write_artifact(store, f"{prefix}/tok/shard-00000.arrow", b"C" * 64, kind=ArtifactKind.TOKENIZED)
    again = fetch_shards([f"s3://{store.bucket}/{prefix}/tok/shard-00000.arrow"], store=store, cache_dir=tmp_path,
                         allow_failed_quality_gate=True)
    assert again[0][0].read_bytes() == b"C" * 64


def test_missing_data_names_the_item(store, prefix, tmp_path) -> None:
    with pytest.raises(ValueError, match="no .arrow shards"):
        fetch_shards([f"{prefix}/empty/"], store=store, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="not a local file"):
        fetch_shards(["nowhere.arrow"], store=None, cache_dir=tmp_path)
