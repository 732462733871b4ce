"""Manifests written beside artifacts and lineage rebuilt from them, on a real S3 server.

Run: `.venv/bin/python -m pytest tests/integration/test_lineage.py -q`
"""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr

from dflash_core.layout import ArtifactKind, manifest_key
from dflash_core.lineage import (
    REDACTED, build_lineage, find_unmanifested, input_ref, read_manifest, register_artifact, verify_artifact,
    write_artifact,
)
from dflash_core.provenance import current_producer
from dflash_core.storage import ObjectNotFound, ObjectStore, sha256_bytes


def _chain(store: ObjectStore, prefix: str):
    """prompts -> 2 completion shards -> tokenized shard -> checkpoint."""
    producer = current_producer(flow_run_id="flow-123", task_run_id="task-456")
    prompts = write_artifact(store, f"{prefix}/prompts.jsonl", b'{"p": 1}\n', kind=ArtifactKind.PROMPTS,
                             producer=producer)
    shards = [
        write_artifact(store, f"{prefix}/completions/shard-{i:05d}.jsonl", f"c{i}".encode(),
                       kind=ArtifactKind.COMPLETIONS, inputs=[input_ref(store, prompts.key)], producer=producer)
        for i in range(2)
    ]
    tokenized = write_artifact(store, f"{prefix}/tokenized.arrow", b"arrow", kind=ArtifactKind.TOKENIZED,
                               inputs=[input_ref(store, s.key) for s in shards])
    checkpoint = write_artifact(store, f"{prefix}/ckpt.safetensors", b"weights", kind=ArtifactKind.CHECKPOINT,
                                inputs=[input_ref(store, tokenized.key)])
    return prompts, shards, tokenized, checkpoint


def test_manifest_records_hash_size_producer_inputs(store: ObjectStore, prefix: str) -> None:
    prompts, shards, _, _ = _chain(store, prefix)
    manifest = read_manifest(store, shards[0].key)
    assert manifest.sha256 == sha256_bytes(b"c0")
    assert manifest.bytes == 2
    assert manifest.uri == store.uri(shards[0].key)
    assert manifest.kind == ArtifactKind.COMPLETIONS
    assert manifest.producer.flow_run_id == "flow-123"
    assert manifest.producer.task_run_id == "task-456"
    assert manifest.producer.package_version == "0.1.0"
    assert [ref.uri for ref in manifest.inputs] == [prompts.uri]
    assert manifest.inputs[0].sha256 == prompts.sha256
    assert verify_artifact(store, manifest) == []


def test_lineage_graph_answers_what_made_x_and_what_x_fed(store: ObjectStore, prefix: str) -> None:
    prompts, shards, tokenized, checkpoint = _chain(store, prefix)
    graph = build_lineage(store, prefix)
    assert graph.ancestors(checkpoint.uri) == {tokenized.uri, shards[0].uri, shards[1].uri, prompts.uri}
    assert graph.descendants(prompts.uri) == {shards[0].uri, shards[1].uri, tokenized.uri, checkpoint.uri}
    assert graph.descendants(checkpoint.uri) == set()
    assert graph.stale_inputs() == []
    edges = graph.to_dict()["edges"]
    assert {"from": shards[1].uri, "to": tokenized.uri} in edges


def test_overwritten_input_shows_as_stale(store: ObjectStore, prefix: str) -> None:
    prompts, shards, _, _ = _chain(store, prefix)
    write_artifact(store, prompts.key, b"changed\n", kind=ArtifactKind.PROMPTS)
    stale = build_lineage(store, prefix).stale_inputs()
    assert sorted(stale) == sorted((s.uri, prompts.uri) for s in shards)


def test_objects_without_manifest_are_found(store: ObjectStore, prefix: str) -> None:
    _chain(store, prefix)
    store.put_bytes(f"{prefix}/dead/hidden_states.bin", b"\0" * 100)
    orphans = find_unmanifested(store, prefix)
    assert [o.key for o in orphans] == [f"{prefix}/dead/hidden_states.bin"]


def test_changed_object_fails_verification(store: ObjectStore, prefix: str) -> None:
    manifest = write_artifact(store, f"{prefix}/r.json", b"{}", kind=ArtifactKind.REPORT)
    store.put_bytes(manifest.key, b'{"edited": true}')
    problems = verify_artifact(store, manifest)
    assert any("bytes" in p for p in problems) and any("sha256" in p for p in problems)
    store.delete_many([manifest.key])
    assert verify_artifact(store, manifest) == [f"{manifest.uri} is gone but its manifest remains"]


def test_file_artifact_and_missing_manifest_error(store: ObjectStore, prefix: str, tmp_path) -> None:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"ok": True}))
    manifest = write_artifact(store, f"{prefix}/report.json", path, kind=ArtifactKind.REPORT)
    assert manifest.bytes == path.stat().st_size
    assert store.exists(manifest_key(manifest.key))
    store.put_bytes(f"{prefix}/bare", b"x")
    with pytest.raises(ObjectNotFound, match="no manifest for"):
        read_manifest(store, f"{prefix}/bare")


def test_secrets_never_reach_a_manifest(store: ObjectStore, prefix: str, settings) -> None:
    config = {"settings": settings, "api_key": "sk-live-123", "nested": {"password": "hunter2"},
              "token_budget": 8192, "explicit": SecretStr("s3cr3t")}
    manifest = write_artifact(store, f"{prefix}/cfg", b"x", kind=ArtifactKind.REPORT, config=config)
    raw = store.get_bytes(manifest_key(manifest.key)).decode()
    secret = settings.s3_secret_access_key.get_secret_value()
    for leaked in (secret, "sk-live-123", "hunter2", "s3cr3t"):
        assert leaked not in raw
    assert manifest.config["token_budget"] == 8192
    assert manifest.config["api_key"] == REDACTED
    assert manifest.config["settings"]["s3_secret_access_key"] == REDACTED


def test_register_an_object_written_outside_write_artifact(store: ObjectStore, prefix: str) -> None:
    key = f"{prefix}/backup/node.tar"
    store.client.put_object(Bucket=store.bucket, Key=key, Body=b"tarball")  # no sha256 metadata
    manifest = register_artifact(store, key, kind=ArtifactKind.NODE_BACKUP, config={"node": "gpu-1"})
    assert manifest.sha256 == sha256_bytes(b"tarball") and manifest.bytes == 7
    assert read_manifest(store, key) == manifest
    assert find_unmanifested(store, f"{prefix}/backup/") == []


def test_lineage_show_walks_up_and_down_with_hashes_and_the_flow_run_link(store: ObjectStore, prefix: str,
                                                                          env_settings) -> None:
    from typer.testing import CliRunner

    from dflash_core import cli

    prompts, shards, tokenized, checkpoint = _chain(store, prefix)
    write_artifact(store, prompts.key, b"changed\n", kind=ArtifactKind.PROMPTS)  # the shards' recorded hash is stale now
    runner = CliRunner()
    result = runner.invoke(cli.app, ["lineage", "show", shards[0].uri, "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["flow_run_url"] == env_settings.prefect_api_url.removesuffix("/api") + "/runs/flow-run/flow-123"
    assert info["manifest"]["producer"]["git_sha"] and info["manifest"]["sha256"] == shards[0].sha256
    [made_from] = info["inputs"]
    assert (made_from["uri"], made_from["recorded_sha256"], made_from["status"]) == \
        (prompts.uri, prompts.sha256, "changed since recorded")
    [fed] = info["fed"]
    assert fed["uri"] == tokenized.uri and [c["uri"] for c in fed["children"]] == [checkpoint.uri]

    deep = json.loads(runner.invoke(cli.app, ["lineage", "show", checkpoint.key, "--json"]).output)
    assert [n["uri"] for n in deep["inputs"]] == [tokenized.uri]
    assert sorted(c["uri"] for c in deep["inputs"][0]["children"]) == sorted(s.uri for s in shards)
    assert deep["fed"] == []

    text = runner.invoke(cli.app, ["lineage", "show", shards[0].uri], env={"COLUMNS": "250"})
    assert text.exit_code == 0 and "made by" in text.output and "runs/flow-run/flow-123" in text.output
    assert "changed since recorded" in text.output and tokenized.uri in text.output
    missing = runner.invoke(cli.app, ["lineage", "show", f"{prefix}/nothing"], env={"COLUMNS": "250"})
    assert missing.exit_code == 2 and "has no manifest and no manifest names it" in missing.output
    listed = json.loads(runner.invoke(cli.app, ["lineage", "list", prefix, "--json"]).output)
    assert {"from": tokenized.uri, "to": checkpoint.uri} in listed["edges"]


def test_prefect_results_are_not_listed_as_unmanifested(store: ObjectStore, prefix: str, env_settings) -> None:
    """Prefect's persisted results (its task cache) never have manifests: not unknown provenance."""
    import uuid

    from typer.testing import CliRunner

    from dflash_core import cli
    from dflash_core.layout import PREFECT_RESULTS_FOLDER

    result_key = f"{PREFECT_RESULTS_FOLDER}/{uuid.uuid4().hex}"
    store.put_bytes(result_key, b"a pickled task result")
    store.put_bytes(f"{prefix}/dead/hidden_states.bin", b"\0" * 10)
    assert find_unmanifested(store, f"{PREFECT_RESULTS_FOLDER}/") == []
    listed = json.loads(CliRunner().invoke(cli.app, ["lineage", "list", "--json"]).output)  # the whole bucket
    assert f"{prefix}/dead/hidden_states.bin" in listed["unmanifested"]
    assert not [key for key in listed["unmanifested"] if key.startswith(f"{PREFECT_RESULTS_FOLDER}/")]


def test_a_walk_up_by_node_reaches_the_sources_and_the_target(store: ObjectStore, prefix: str, tmp_path) -> None:
    """prompts -> completions -> tokenized (+ tokenizer) -> checkpoint (+ target): one node per run's folder, the
    edges between them, each input once, and a note when only a sample of a parent's files was read."""
    from dflash_core.layout import DEFAULT_PREFIXES
    from dflash_core.lineage import TARGET_MODEL, TOKENIZER, InputRef, build_lineage
    from dflash_core.lineage_refs import tokenizer_refs
    from dflash_core.lineage_views import bucket_kind_of, edges_markdown, node_edges, view_lineage

    prefixes = {kind: f"{prefix}/{p}" for kind, p in DEFAULT_PREFIXES.items()}
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    tokenizer = tokenizer_refs(model)
    target = [InputRef(uri=(model / "config.json").as_uri(), sha256="c" * 64, role=TARGET_MODEL), *tokenizer]

    def put(kind: ArtifactKind, name: str, inputs) -> object:
        return write_artifact(store, f"{prefixes[kind]}/{name}", name.encode(), kind=kind, inputs=inputs)

    prompts = put(ArtifactKind.PROMPTS, "demo/v1/prompts-00000.jsonl", [])
    completions = [put(ArtifactKind.COMPLETIONS, f"demo/r1/shard-0000{i}.jsonl", [input_ref(store, prompts.key)])
                   for i in range(2)]
    shards = [put(ArtifactKind.TOKENIZED, f"demo/r1/shard-0000{i}.arrow", [input_ref(store, c.key)])
              for i, c in enumerate(completions)]
    put(ArtifactKind.TOKENIZED, "demo/r1/dataset.json", [*(input_ref(store, s.key) for s in shards), *tokenizer])
    files = [put(ArtifactKind.CHECKPOINT, f"drafter/step-000004/{name}", [input_ref(store, s.key) for s in shards])
             for name in ("model.safetensors", "meta.json")]
    node = {kind: store.uri(f"{prefixes[kind]}/{name}") for kind, name in (
        (ArtifactKind.PROMPTS, "demo/v1/"), (ArtifactKind.COMPLETIONS, "demo/r1/"),
        (ArtifactKind.TOKENIZED, "demo/r1/"), (ArtifactKind.CHECKPOINT, "drafter/step-000004/"))}
    kind_of = bucket_kind_of(store.uri(""), prefixes)

    view = view_lineage(store, node[ArtifactKind.CHECKPOINT], files, kind="checkpoint", extra_inputs=target,
                        kind_of=kind_of)
    assert view.parents() == [node[ArtifactKind.TOKENIZED], model.as_uri() + "/"]
    assert [ref.uri for ref in view.inputs] == [s.uri for s in shards] + [ref.uri for ref in target]
    assert {(e.parent_kind, e.child_kind) for e in view.edges} == {  # up through the files the checkpoint used
        ("tokenized", "checkpoint"), (TARGET_MODEL, "checkpoint"), ("completions", "tokenized"),
        ("prompts", "completions")}
    assert view.complete and view.manifests[completions[1].uri].inputs[0].uri == prompts.uri
    sampled = view_lineage(store, node[ArtifactKind.CHECKPOINT], files, kind="checkpoint", kind_of=kind_of,
                           reads_per_node=1)
    assert not sampled.complete and node[ArtifactKind.PROMPTS] in {e.parent for e in sampled.edges}

    # The same edges from the whole graph (what the audit's lineage table shows), newest artifact first.
    edges = node_edges(build_lineage(store, prefix), kind_of=kind_of, prefix_uri=store.uri(prefix))
    assert (edges[0].parent, edges[0].child) == (node[ArtifactKind.TOKENIZED], node[ArtifactKind.CHECKPOINT])
    assert {(e.parent, e.child) for e in edges} >= {(node[ArtifactKind.PROMPTS], node[ArtifactKind.COMPLETIONS]),
                                                   (node[ArtifactKind.COMPLETIONS], node[ArtifactKind.TOKENIZED])}
    assert {e.parent_kind for e in edges if e.child == node[ArtifactKind.TOKENIZED]} == {"completions", TOKENIZER}
    table = edges_markdown(edges)
    row = f"| tokenized `{prefix}/tokenized/demo/r1/` | → | checkpoint `{prefix}/checkpoints/drafter/step-000004/` |"
    assert row in table and "mermaid" not in table
