"""The target model and its tokenizer as inputs (files of a local dir by sha256, a digest cache that re-hashes
only what changed, a target built in code named by spec and seed), and the nodes a lineage page groups files
into.

Run: `.venv/bin/python -m pytest -q tests/unit/test_lineage_refs.py`
"""

from __future__ import annotations

import json

from dflash_core.lineage import TARGET_MODEL, TOKENIZER, InputRef
from dflash_core.lineage_refs import DigestCache, target_refs, tokenizer_refs
from dflash_core.lineage_views import NodeEdge, edges_markdown, node_of
from dflash_core.storage import sha256_bytes, sha256_file


def _model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name, data in (("config.json", b'{"a": 1}'), ("model.safetensors", b"weights"),
                       ("tokenizer.json", b'{"v": 1}'), ("chat_template.jinja", b"{{ x }}"), ("README.md", b"hi")):
        (model / name).write_bytes(data)
    return model


def test_a_model_dir_is_its_config_weights_and_tokenizer_files_by_sha256(tmp_path):
    model = _model_dir(tmp_path)
    refs = target_refs(str(model), seed=0, models_dir=tmp_path / "unused")
    assert [(ref.uri.rsplit("/", 1)[-1], ref.role) for ref in refs] == [
        ("config.json", TARGET_MODEL), ("model.safetensors", TARGET_MODEL),
        ("chat_template.jinja", TOKENIZER), ("tokenizer.json", TOKENIZER)]  # README.md is not the model
    assert all(ref.uri == (model / ref.uri.rsplit("/", 1)[-1]).as_uri() for ref in refs)
    assert all(ref.sha256 == sha256_file(model / ref.uri.rsplit("/", 1)[-1]) for ref in refs)
    assert [ref.uri for ref in tokenizer_refs(model)] == [ref.uri for ref in refs if ref.role == TOKENIZER]
    assert target_refs("tiny:llama", seed=3, models_dir=tmp_path) == [  # built in code: its spec and seed
        InputRef(uri="tiny:llama?seed=3", sha256=sha256_bytes(b"tiny:llama?seed=3"), role=TARGET_MODEL)]


def test_the_digest_cache_rehashes_only_a_file_that_changed(tmp_path):
    model = _model_dir(tmp_path)
    cache = DigestCache(tmp_path / "cache" / "sha256.json")
    weights = model / "model.safetensors"
    assert cache.sha256(weights) == sha256_file(weights)
    stored = json.loads(cache.path.read_text())
    stored[str(weights)]["sha256"] = "remembered"  # what the cache answers while the file's size and mtime stand
    cache.path.write_text(json.dumps(stored))
    assert cache.sha256(weights) == "remembered"
    weights.write_bytes(b"new weights")
    assert cache.sha256(weights) == sha256_file(weights)


def test_nodes_group_a_runs_files_and_keep_a_report_alone():
    assert node_of("s3://b/tokenized/d/r/shard-00000.arrow", "tokenized") == "s3://b/tokenized/d/r/"
    assert node_of("s3://b/checkpoints/r/step-000004/model.safetensors", "checkpoint") == \
        "s3://b/checkpoints/r/step-000004/"
    assert node_of("s3://b/reports/evaluate/r/f/attempt-1/report.json", "report") == \
        "s3://b/reports/evaluate/r/f/attempt-1/report.json"
    assert node_of("file:///models/smol/config.json", TARGET_MODEL) == "file:///models/smol/"
    assert node_of("tiny:llama?seed=0", TARGET_MODEL) == "tiny:llama?seed=0"
    table = edges_markdown([NodeEdge(parent="s3://b/completions/d/r/", parent_kind="completions",
                                     child="s3://b/tokenized/d/r/", child_kind="tokenized")],
                           links={"s3://b/tokenized/d/r/": "http://ui/artifacts/artifact/1"})
    assert table.splitlines()[2] == ("| completions `completions/d/r/` | → | "
                                     "tokenized [tokenized/d/r/](http://ui/artifacts/artifact/1) |")
