"""A key or a name from data never chooses a local path: each place where one becomes a file here refuses one
that would leave its folder (dflash_core.storage.local_paths), names the key and the folder, writes nothing outside,
and is not retried. On the real S3 server, whose `s3://bucket//tmp/x` is the object `tmp/x`, and the real
SSH server.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_key_paths.py`
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
from prefect.states import Failed

from dflash_core.train.inputs import fetch_shards
from dflash_core.train.rank_failure import FailureWatch, error_line
from tests.sshd_fixture import Sshd, start_sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    yield from start_sshd(tmp_path_factory.mktemp("sshd"))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def outside(tmp_path: Path, store):
    """A folder beside the cache that no key may write into; the objects named by its absolute path go after."""
    folder = tmp_path / "outside"
    folder.mkdir()
    yield folder
    store.delete_many(info.key for info in store.list(str(folder).lstrip("/") + "/"))


def _put_at_absolute_key(store, path: Path, data: bytes = b"A" * 64) -> str:
    """`s3://<bucket>//<path>`: a URI whose key is `path`, absolute."""
    store.put_bytes(str(path), data)
    return f"s3://{store.bucket}/{path}"


def _refusal(key: str, folder: Path) -> str:
    return rf"key {re.escape(repr(key))} (cannot be a path inside|leads out of) {re.escape(str(folder))}"


def _files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if not p.is_dir())


def test_training_data_at_an_absolute_key_is_refused(store, cache, outside) -> None:
    uri = _put_at_absolute_key(store, outside / "y.arrow")
    with pytest.raises(ValueError, match=_refusal(str(outside / "y.arrow"), cache)) as refused:
        fetch_shards([uri], store=store, cache_dir=cache, allow_failed_quality_gate=True)
    assert _files_in(outside) == []
    watch = FailureWatch()  # the training entry's line for a ValueError: a config error, never retried
    watch.read(error_line("config", refused.value))
    assert watch.failure(1).final


def test_training_data_with_dot_dot_segments_is_refused(store, prefix, cache, outside) -> None:
    key = f"{prefix}/" + "../" * 3 + "outside/y.arrow"  # cache/scratch/test-x/../../../outside is `outside`
    with pytest.raises(ValueError, match=_refusal(key, cache)):
        fetch_shards([f"s3://{store.bucket}/{key}"], store=store, cache_dir=cache, allow_failed_quality_gate=True)
    assert _files_in(outside) == []


def test_training_data_under_a_cache_symlink_leading_out_is_refused(store, prefix, cache, outside) -> None:
    key = f"{prefix}/tok/shard-00000.arrow"
    store.put_bytes(key, b"A" * 64)
    cache.mkdir()
    (cache / prefix.split("/")[0]).symlink_to(outside)
    with pytest.raises(ValueError, match=_refusal(key, cache)):
        fetch_shards([key], store=store, cache_dir=cache, allow_failed_quality_gate=True)
    assert _files_in(outside) == []


def test_the_evaluated_checkpoint_at_an_absolute_key_is_refused_and_not_retried(settings, store, cache,
                                                                                 outside) -> None:
    from tasks.evaluate import fetch_checkpoint

    step_dir = outside / "step-000001"
    uri = _put_at_absolute_key(store, step_dir / "meta.json", b"{}")
    _put_at_absolute_key(store, step_dir / "model.safetensors")
    with pytest.raises(ValueError, match=_refusal(str(step_dir), cache)) as refused:
        fetch_checkpoint.fn(settings, checkpoint=uri.removesuffix("/meta.json"), cache_dir=cache)
    assert _files_in(outside) == []
    assert fetch_checkpoint.retry_condition_fn(None, None, Failed(data=refused.value)) is False


def test_an_export_of_a_checkpoint_at_an_absolute_key_fails_at_once(prefect_server, env_settings, store,
                                                                    outside) -> None:
    from flows.export import ExportParams, export

    step_dir = outside / "step-000001"
    meta = {"step": 1, "config": {"run_name": f"escape-{uuid.uuid4().hex[:8]}", "target": "tiny:qwen3"}}
    uri = _put_at_absolute_key(store, step_dir / "meta.json", json.dumps(meta).encode())
    _put_at_absolute_key(store, step_dir / "model.safetensors")
    state = export(ExportParams(checkpoint=uri.removesuffix("/meta.json")), return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=_refusal(str(step_dir), env_settings.work_path("cache", "checkpoints"))):
        state.result()
    assert _files_in(outside) == []


def test_tokenize_reads_a_shard_at_an_absolute_key_into_memory_only(settings, store, outside) -> None:
    from tasks.tokenize import read_completion_ids

    shard = outside / "shard-00000.jsonl"
    _put_at_absolute_key(store, shard, b'{"id": "a"}\n{"id": "b"}\n')
    assert read_completion_ids.fn(settings, input_key=str(shard), max_record_bytes=1 << 20) == ["a", "b"]
    assert _files_in(outside) == []


def test_a_node_folder_fetched_over_ssh_stays_inside_the_local_folder(sshd: Sshd, tmp_path: Path) -> None:
    local, outside = tmp_path / "down", tmp_path / "outside"
    local.mkdir()
    outside.mkdir()
    (local / "sub").symlink_to(outside)
    remote = f"{sshd.home}/remote-{uuid.uuid4().hex[:6]}"
    with sshd.node().connect() as node:
        node.run(["mkdir", "-p", f"{remote}/sub"])
        node.run(f"echo alpha > {remote}/a.txt; echo beta > {remote}/sub/b.txt")
        with pytest.raises(ValueError, match=_refusal("sub", local)):
            node.get(remote, local)
    assert _files_in(outside) == []
