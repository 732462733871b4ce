"""S3 audit and cleanup on the real S3 server: a planted bucket with live lineage, old checkpoints, a
superseded tokenization, an abandoned prefix of dead hidden states, an unmanifested object, a manifest
whose object is gone and an object that no longer matches its manifest. Beside it, Prefect's own
persisted results (`prefect-results/`): their own kind, kept unless a retention setting says otherwise.

Every test plants under its own root (all kind prefixes moved below `audit-<id>/`), audits the whole
shared bucket (lineage needs all of it) and nominates only under that root.

Run: `.venv/bin/python -m pytest tests/integration/test_s3_audit.py -q`
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from dflash_core.layout import DEFAULT_PREFIXES, PREFECT_RESULTS_FOLDER, ArtifactKind
from dflash_core.lineage import TOKENIZER, InputRef, Manifest, input_ref, read_manifest, write_artifact
from dflash_core.s3audit import (
    CleanupNotConfirmed, Retention, audit, audit_markdown, execute_cleanup, take_inventory, write_deletion_record,
)
from dflash_core.s3audit.cleanup import delete_batch_s3
from dflash_core.storage import ObjectStore

LATER = datetime.now(UTC) + timedelta(days=45)  # "now" for the rules: the planted hidden states look abandoned


@dataclass
class Planted:
    root: str
    prefixes: dict[ArtifactKind, str]
    prompts: Manifest
    completions: Manifest
    tokenized_old: Manifest
    tokenized_new: Manifest
    describers_old: list[Manifest]
    steps: dict[int, list[Manifest]]
    export: Manifest
    hidden_states: list[str]
    referenced_hidden_state: str
    stray: str
    orphan_manifest: str
    mismatched: str

    def key(self, kind: ArtifactKind, *parts: str) -> str:
        return "/".join([self.prefixes[kind], *parts])


def plant(store: ObjectStore, *, root: str | None = None) -> Planted:
    root = root or f"audit-{uuid.uuid4().hex[:10]}"
    prefixes = {kind: f"{root}/{prefix}" for kind, prefix in DEFAULT_PREFIXES.items()}

    def key(kind: ArtifactKind, *parts: str) -> str:
        return "/".join([prefixes[kind], *parts])

    prompts = write_artifact(store, key(ArtifactKind.PROMPTS, "demo", "v1", "prompts-00000.jsonl"), b'{"p": 1}\n',
                             kind=ArtifactKind.PROMPTS)
    completions = write_artifact(store, key(ArtifactKind.COMPLETIONS, "demo", "run", "shard-00000.jsonl"), b"c" * 50,
                                 kind=ArtifactKind.COMPLETIONS, inputs=[input_ref(store, prompts.key)])
    tokenized_old = write_artifact(store, key(ArtifactKind.TOKENIZED, "demo", "run-v1", "shard-00000.arrow"), b"o" * 70,
                                   kind=ArtifactKind.TOKENIZED, inputs=[input_ref(store, completions.key)])
    time.sleep(0.01)  # created_at orders the two tokenizations
    tokenized_new = write_artifact(store, key(ArtifactKind.TOKENIZED, "demo", "run-v2", "shard-00000.arrow"), b"n" * 80,
                                   kind=ArtifactKind.TOKENIZED, inputs=[input_ref(store, completions.key)])
    # What the tokenize flow writes beside a run: its dataset.json (quality verdict; the tokenizer's files among its
    # inputs, which describe nothing) and a stats report.
    tokenizer = InputRef(uri="file:///models/smollm2/tokenizer.json", sha256="t" * 64, role=TOKENIZER)
    describers = {run: [write_artifact(store, key(ArtifactKind.TOKENIZED, "demo", run, "dataset.json"), b"{}",
                                       kind=ArtifactKind.TOKENIZED, inputs=[input_ref(store, shard.key), tokenizer]),
                        write_artifact(store, key(ArtifactKind.REPORT, "tokenize", "demo", run, f"flow-{run}",
                                                  "attempt-1", "stats.json"), b"{}",
                                       kind=ArtifactKind.REPORT, inputs=[input_ref(store, shard.key)])]
                  for run, shard in (("run-v1", tokenized_old), ("run-v2", tokenized_new))}
    steps = {step: [write_artifact(store, key(ArtifactKind.CHECKPOINT, "drafter", f"step-{step:06d}", name),
                                   f"{name}{step}".encode() * 10, kind=ArtifactKind.CHECKPOINT,
                                   inputs=[input_ref(store, tokenized_new.key)])
                    for name in ("model.safetensors", "meta.json")] for step in (100, 200, 300, 400)}
    # A step whose upload has not finished (no meta.json yet) is never nominated, nor counted as kept.
    write_artifact(store, key(ArtifactKind.CHECKPOINT, "drafter", "step-000500", "model.safetensors"), b"partial",
                   kind=ArtifactKind.CHECKPOINT, inputs=[input_ref(store, tokenized_new.key)])
    # The export was made from step 100's weights: that file must survive keep-N, its meta.json need not.
    export = write_artifact(store, key(ArtifactKind.EXPORT, "drafter", "native", "model.safetensors"), b"e" * 40,
                            kind=ArtifactKind.EXPORT, inputs=[input_ref(store, steps[100][0].key)])
    hidden = [f"{root}/hidden-states/qwen-27b/part-{i:04d}.bin" for i in range(3)]
    for i, hidden_key in enumerate(hidden):
        store.put_bytes(hidden_key, bytes([i]) * 1000)
    # A live report that (unusually) names one dead-looking hidden-state file as its input.
    referenced = f"{root}/hidden-states/qwen-27b/part-0001.bin"
    write_artifact(store, key(ArtifactKind.REPORT, "probe", "r1", "report.json"), b"{}", kind=ArtifactKind.REPORT,
                   inputs=[InputRef(uri=store.uri(referenced))])
    stray = key(ArtifactKind.COMPLETIONS, "demo", "run", "stray.tmp")
    store.put_bytes(stray, b"s" * 5)
    gone = write_artifact(store, key(ArtifactKind.REPORT, "probe", "r2", "gone.json"), b"{}", kind=ArtifactKind.REPORT)
    store.delete_many([gone.key])
    changed = write_artifact(store, key(ArtifactKind.REPORT, "probe", "r3", "changed.json"), b"{}",
                             kind=ArtifactKind.REPORT)
    store.put_bytes(changed.key, b'{"edited": 1}')
    return Planted(root=root, prefixes=prefixes, prompts=prompts, completions=completions,
                   tokenized_old=tokenized_old, tokenized_new=tokenized_new, describers_old=describers["run-v1"],
                   steps=steps, export=export,
                   hidden_states=hidden, referenced_hidden_state=referenced, stray=stray,
                   orphan_manifest=gone.key + ".manifest.json", mismatched=changed.key)


def _expected_dead(p: Planted) -> set[str]:
    artifacts = [p.tokenized_old.key, *(m.key for m in p.describers_old), p.steps[100][1].key,
                 *(m.key for m in p.steps[200])]
    hidden = [k for k in p.hidden_states if k != p.referenced_hidden_state]
    return {*artifacts, *(k + ".manifest.json" for k in artifacts), *hidden, p.orphan_manifest}


def test_audit_finds_dead_prefix_unmanifested_objects_and_broken_manifests(store: ObjectStore) -> None:
    p = plant(store)
    half_done = f"{p.root}/checkpoints/drafter/step-000600/model.safetensors"  # an upload that never completed
    upload = store.client.create_multipart_upload(Bucket=store.bucket, Key=half_done)
    inventory, report, plan = audit(store, p.prefixes, prefix=p.root + "/", now=LATER,
                                    retention=Retention(keep_checkpoints=2))
    assert [u["key"] for u in report.incomplete_uploads] == [half_done]
    assert "incomplete multipart uploads: 1" in audit_markdown(report, plan)
    store.client.abort_multipart_upload(Bucket=store.bucket, Key=half_done, UploadId=upload["UploadId"])
    assert report.unmanifested_keys == sorted([*p.hidden_states, p.stray])
    assert report.orphan_manifests == [p.orphan_manifest]
    assert set(report.hash_problems) == {p.mismatched}
    assert "its manifest says" in report.hash_problems[p.mismatched]
    by_kind = {row["kind"]: row for row in report.by_kind}
    assert by_kind["checkpoint"]["objects"] == 9 and by_kind["unknown"]["bytes"] == 3000
    assert by_kind["completions"]["unmanifested"] == 1
    groups = {row["group"] for row in report.by_group}
    assert {f"{p.root}/hidden-states", f"{p.root}/checkpoints/drafter", f"{p.root}/tokenized/demo/run-v1"} <= groups

    assert {c.key for c in plan.candidates} == _expected_dead(p)
    rules = {c.key: c.rule for c in plan.candidates}
    assert rules[p.tokenized_old.key] == "superseded-tokenization"
    assert all(rules[m.key] == "superseded-tokenization" for m in p.describers_old)  # dataset.json, stats.json
    assert not any("step-000500" in c.key or "run-v2" in c.key for c in plan.candidates)
    assert rules[p.steps[200][0].key] == "old-checkpoint"
    assert rules[p.hidden_states[0]] == "abandoned-prefix" and rules[p.orphan_manifest] == "orphan-manifest"
    kept = {k.key: k.kept_because for k in plan.protected}
    assert kept[p.steps[100][0].key] == f"referenced by kept {p.export.uri}"
    assert kept[p.referenced_hidden_state].startswith("referenced by kept ")
    assert report.dead_bytes == sum(c.bytes for c in plan.candidates)
    # Lineage between artifact groups, as a table of edges (the UI renders it; it prints Mermaid as code).
    edges = {(e.parent.removeprefix(store.uri(p.root + "/")), e.child.removeprefix(store.uri(p.root + "/")))
             for e in report.lineage}
    assert {("prompts/demo/v1/", "completions/demo/run/"), ("completions/demo/run/", "tokenized/demo/run-v2/"),
            ("tokenized/demo/run-v2/", "checkpoints/drafter/step-000100/"),
            ("checkpoints/drafter/step-000100/", "exports/drafter/native/")} <= edges
    lineage = audit_markdown(report, plan).split("## Lineage", 1)[1]
    row = f"| checkpoint `{p.root}/checkpoints/drafter/step-000100/` | → | export `{p.root}/exports/drafter/native/` |"
    assert row in lineage and "flowchart" not in lineage
    # Without the clock moved on, fresh unmanifested data is not yet abandoned.
    _, _, today = audit(store, p.prefixes, prefix=p.root + "/", retention=Retention(keep_checkpoints=2),
                        verify_hashes=False)
    assert not any(c.rule == "abandoned-prefix" for c in today.candidates)
    # A dry run deleted nothing.
    assert all(store.exists(k) for k in _expected_dead(p))


def test_cleanup_needs_confirmation_and_never_deletes_what_live_data_references(store: ObjectStore, settings) -> None:
    p = plant(store)
    _, _, plan = audit(store, p.prefixes, prefix=p.root + "/", now=LATER, retention=Retention(keep_checkpoints=2))
    with pytest.raises(CleanupNotConfirmed, match=r"dry run: 15 objects .* pass confirm=True"):
        execute_cleanup(store, p.prefixes, plan, confirm=False, who="test")
    # Between the dry run and the delete, new work starts from the superseded tokenization.
    late = write_artifact(store, p.key(ArtifactKind.CHECKPOINT, "late-run", "step-000001", "model.safetensors"),
                          b"late", kind=ArtifactKind.CHECKPOINT, inputs=[input_ref(store, p.tokenized_old.key)])
    result = execute_cleanup(store, p.prefixes, plan, confirm=True, who="tester@ci")
    skipped = {o.key: o.detail for o in result.skipped}
    assert skipped[p.tokenized_old.key] == f"now kept: referenced by kept {late.uri}"
    assert skipped[p.tokenized_old.key + ".manifest.json"].startswith("now kept")
    # The run's dataset.json and stats stay with the shard they describe (the trainer reads the verdict there).
    for describer in p.describers_old:
        assert skipped[describer.key] == f"now kept: describes {p.tokenized_old.uri}, which is kept"
    kept_now = {m.key for m in [p.tokenized_old, *p.describers_old]}
    expected = _expected_dead(p) - kept_now - {k + ".manifest.json" for k in kept_now}
    assert {o.key for o in result.deleted} == expected and result.failed == [] and result.complete
    assert result.bytes_reclaimed == sum(c.bytes for c in plan.candidates if c.key in expected)
    assert not any(store.exists(k) for k in expected)
    for survivor in (p.tokenized_old.key, *(m.key for m in p.describers_old), p.steps[100][0].key, p.referenced_hidden_state, p.export.key, p.stray,
                     *(m.key for m in p.steps[300] + p.steps[400])):
        assert store.exists(survivor), survivor
    # Every live manifest's inputs in the bucket are still there.
    inventory = take_inventory(store, p.prefixes, verify_hashes=False)
    for key, manifest in inventory.manifests.items():
        if key.startswith(p.root + "/"):
            for ref in (ref for ref in manifest.inputs if ref.uri.startswith(store.uri(""))):
                assert store.exists(ref.uri.removeprefix(store.uri(""))), f"{ref.uri} (input of {manifest.uri})"
    assert set(result.deleted_manifests) == {m.key for m in [p.steps[100][1], *p.steps[200]]}

    record = write_deletion_record(store, p.prefixes, result)
    body = json.loads(store.get_bytes(record.key))
    assert record.kind == ArtifactKind.REPORT and read_manifest(store, record.key) == record
    assert body["who"] == "tester@ci" and body["complete"] and body["bytes_reclaimed"] == result.bytes_reclaimed
    assert {d["key"] for d in body["deleted"]} == expected
    assert all(d["reason"] for d in body["deleted"])
    assert body["deleted_manifests"][p.steps[200][0].key]["sha256"] == p.steps[200][0].sha256

    # Nothing left to do: a second cleanup finds only what the late reference keeps alive, and skips it.
    _, _, again = audit(store, p.prefixes, prefix=p.root + "/", now=LATER, retention=Retention(keep_checkpoints=2))
    assert again.candidates == []


def test_partial_failure_reports_exactly_what_was_and_was_not_deleted(store: ObjectStore) -> None:
    p = plant(store)
    _, _, plan = audit(store, p.prefixes, prefix=p.root + "/", now=LATER, retention=Retention(keep_checkpoints=2),
                       verify_hashes=False)
    refused = p.steps[200][0].key
    flaky = p.hidden_states[0]
    real = delete_batch_s3(store)
    calls: list[list[str]] = []

    # The server refuses one key for good and fails another once: everything else goes to the real S3 server.
    def faulty(keys: list[str]):
        calls.append(list(keys))
        deleted, errors = real([k for k in keys if k != refused and not (k == flaky and len(calls) == 1)])
        if refused in keys:
            errors[refused] = ("AccessDenied", "Access Denied")
        if flaky in keys and len(calls) == 1:
            errors[flaky] = ("SlowDown", "Please reduce your request rate")
        return deleted, errors

    result = execute_cleanup(store, p.prefixes, plan, confirm=True, who="test", delete_batch=faulty, backoff_s=0.01)
    assert [(o.key, o.detail) for o in result.failed] == [(refused, "AccessDenied: Access Denied")]
    assert not result.complete
    assert flaky in {o.key for o in result.deleted} and calls[1] == [flaky]  # only the transient one was retried
    assert {o.key: o.detail for o in result.skipped} == {refused + ".manifest.json": "kept: its artifact was not deleted"}
    assert store.exists(refused) and store.exists(refused + ".manifest.json")
    assert not any(store.exists(o.key) for o in result.deleted)
    assert {o.key for o in result.deleted} | {refused, refused + ".manifest.json"} == _expected_dead(p)


def test_cli_cleanup_is_a_dry_run_until_confirmed(store: ObjectStore, env_settings) -> None:
    from typer.testing import CliRunner

    from dflash_core import cli

    root = f"cli-{uuid.uuid4().hex[:10]}"
    dead = [f"{root}/hidden/part-{i}.bin" for i in range(3)]
    for key in dead:
        store.put_bytes(key, b"h" * 100)
    report = write_artifact(store, f"reports/probe/{root}/uses-part-2.json", b"{}", kind=ArtifactKind.REPORT,
                            inputs=[InputRef(uri=store.uri(dead[2]))])
    time.sleep(1.1)  # last_modified has one-second resolution: be older than "now" for --abandoned-after-days 0
    args = ["s3", "cleanup", "--prefix", f"{root}/", "--abandoned-after-days", "0"]
    runner = CliRunner()
    dry = runner.invoke(cli.app, [*args, "--json"])
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.output)
    assert [c["key"] for c in plan["candidates"]] == dead[:2]
    assert [(p["key"], p["kept_because"]) for p in plan["protected"]] == [(dead[2], f"referenced by kept {report.uri}")]
    assert all(store.exists(k) for k in dead)
    done = runner.invoke(cli.app, [*args, "--confirm"], env={"COLUMNS": "250"})
    assert done.exit_code == 0, done.output
    assert "deleted 2 objects (200 B)" in done.output and "reports/s3-cleanup/" in done.output
    assert [store.exists(k) for k in dead] == [False, False, True]
    audit_out = runner.invoke(cli.app, ["s3", "audit", "--prefix", f"{root}/", "--json", "--no-verify-hashes"])
    assert audit_out.exit_code == 0, audit_out.output
    assert json.loads(audit_out.output)["unmanifested_keys"] == [dead[2]]


def plant_prefect_results(store: ObjectStore, tag: str) -> list[str]:
    """Objects shaped like Prefect's persisted results (flat keys under prefect-results/ at the bucket root,
    no manifests), named after `tag` so a test can nominate only its own."""
    keys = [f"{PREFECT_RESULTS_FOLDER}/{tag}-{i:02d}" for i in range(3)]
    for i, key in enumerate(keys):
        store.put_bytes(key, b'{"metadata": {}, "result": "x"}' * (i + 1))
    return keys


def test_prefect_results_are_their_own_kind_and_kept_unless_a_retention_says_so(store: ObjectStore) -> None:
    p = plant(store)
    results = plant_prefect_results(store, p.root)
    ours = f"{PREFECT_RESULTS_FOLDER}/{p.root}-"
    # The whole folder, whatever else wrote results into this shared bucket: 45 days on, with the default rules.
    inventory, report, plan = audit(store, p.prefixes, prefix=f"{PREFECT_RESULTS_FOLDER}/", now=LATER,
                                    retention=Retention(keep_checkpoints=2), verify_hashes=False)
    kinds = inventory.objects.filter(inventory.objects["key"].str.starts_with(f"{PREFECT_RESULTS_FOLDER}/"))["kind"]
    assert set(kinds.to_list()) == {"prefect-results"}
    assert [row["kind"] for row in report.by_kind] == ["prefect-results"]  # no "unknown" row
    by_kind = report.by_kind[0]
    assert by_kind["objects"] >= 3 and by_kind["unmanifested"] == 0
    assert report.unmanifested == 0 and report.unmanifested_keys == [] and report.unmanifested_bytes == 0
    # Untouched for 45 days and without manifests, yet not an abandoned prefix: no candidate at all by default.
    assert plan.candidates == [] and report.dead_objects == 0
    markdown = audit_markdown(report, plan)
    assert "Prefect's persisted results" in markdown and "kept forever" in markdown
    # The rest of the bucket's audit is unchanged by them (the planted root still has its own unknown objects).
    _, rooted, rooted_plan = audit(store, p.prefixes, prefix=p.root + "/", now=LATER,
                                   retention=Retention(keep_checkpoints=2), verify_hashes=False)
    assert {row["kind"]: row["bytes"] for row in rooted.by_kind}["unknown"] == 3000
    assert {c.key for c in rooted_plan.candidates} == _expected_dead(p)

    # With a retention setting, results older than it are candidates, each with its reason.
    _, _, old = audit(store, p.prefixes, prefix=ours, now=LATER, verify_hashes=False,
                      retention=Retention(prefect_results_days=30))
    assert [c.key for c in old.candidates] == results
    assert {(c.rule, c.kind) for c in old.candidates} == {("old-prefect-result", "prefect-results")}
    assert all("older than prefect_results_days=30" in c.reason for c in old.candidates)
    assert "older than 30 days are cleanup candidates" in audit_markdown(*audit(
        store, p.prefixes, prefix=ours, now=LATER, verify_hashes=False,
        retention=Retention(prefect_results_days=30))[1:])
    # ... and only those older than it; keep_prefixes still protects them.
    _, _, young = audit(store, p.prefixes, prefix=ours, now=LATER, verify_hashes=False,
                        retention=Retention(prefect_results_days=60))
    _, _, today = audit(store, p.prefixes, prefix=ours, verify_hashes=False,
                        retention=Retention(prefect_results_days=30))
    assert young.candidates == [] and today.candidates == []
    _, _, kept = audit(store, p.prefixes, prefix=ours, now=LATER, verify_hashes=False,
                       retention=Retention(prefect_results_days=30, keep_prefixes=[ours]))
    assert kept.candidates == [] and {k.key for k in kept.protected} == set(results)

    # A confirmed cleanup of that plan deletes exactly them (re-checked under the same retention).
    result = execute_cleanup(store, p.prefixes, old, confirm=True, who="test")
    assert {o.key for o in result.deleted} == set(results) and result.complete and result.skipped == []
    assert not any(store.exists(k) for k in results)


def test_cli_keeps_prefect_results_unless_prefect_results_days_is_given(store: ObjectStore, env_settings) -> None:
    from typer.testing import CliRunner

    from dflash_core import cli

    tag = f"cli-{uuid.uuid4().hex[:10]}"
    results = plant_prefect_results(store, tag)
    time.sleep(1.1)  # last_modified has one-second resolution: be older than "now" for 0 days
    runner = CliRunner()
    base = ["s3", "cleanup", "--prefix", f"{PREFECT_RESULTS_FOLDER}/{tag}-", "--abandoned-after-days", "0", "--json"]
    default = runner.invoke(cli.app, base)
    assert default.exit_code == 0, default.output
    assert json.loads(default.output)["candidates"] == []
    aged = runner.invoke(cli.app, [*base, "--prefect-results-days", "0"])
    assert aged.exit_code == 0, aged.output
    assert [c["key"] for c in json.loads(aged.output)["candidates"]] == results
    audit_out = runner.invoke(cli.app, ["s3", "audit", "--prefix", f"{PREFECT_RESULTS_FOLDER}/{tag}-", "--json",
                                        "--no-verify-hashes"])
    assert audit_out.exit_code == 0, audit_out.output
    audited = json.loads(audit_out.output)
    assert audited["unmanifested_keys"] == [] and [r["kind"] for r in audited["by_kind"]] == ["prefect-results"]
    store.delete_many(results)


def test_a_runs_usage_is_what_its_flow_runs_wrote_beside_the_bucket_and_its_dead_data(store: ObjectStore) -> None:
    from dflash_core.provenance import current_producer
    from dflash_core.s3audit import run_usage, usage_markdown, usage_png

    p = plant(store)
    run_id = str(uuid.uuid4())
    mine = [write_artifact(store, p.key(ArtifactKind.CHECKPOINT, "mine", "step-000001", name), b"w" * size,
                           kind=ArtifactKind.CHECKPOINT, producer=current_producer(flow_run_id=run_id))
            for name, size in (("model.safetensors", 300), ("meta.json", 20))]
    report_key = p.key(ArtifactKind.REPORT, "probe", "mine", "report.json")
    write_artifact(store, report_key, b"{}", kind=ArtifactKind.REPORT, producer=current_producer(flow_run_id=run_id))
    inventory, report, plan = audit(store, p.prefixes, now=LATER, retention=Retention(keep_checkpoints=2),
                                    verify_hashes=False)
    usage = run_usage(inventory, report, plan, run_ids=[run_id, "a-stage-that-wrote-nothing"])

    # What the run wrote counts as the bucket's totals do: artifacts, without their manifests.
    assert usage.written_objects == 3 and usage.written_bytes == 320 + 2
    assert {r["kind"]: (r["objects"], r["bytes"]) for r in usage.written_by_kind} == {"checkpoint": (2, 320),
                                                                                      "report": (1, 2)}
    bucket = {r["kind"]: r for r in usage.by_kind}
    assert all(r["objects"] <= bucket[r["kind"]]["objects"] and r["bytes"] <= bucket[r["kind"]]["bytes"]
               for r in usage.written_by_kind)
    assert usage.bucket_objects == report.objects - report.manifests == sum(r["objects"] for r in report.by_kind)
    assert usage.bucket_bytes == sum(r["bytes"] for r in report.by_kind) and usage.dead_bytes == plan.total_bytes
    assert usage.dead_objects == len(plan.candidates) > 0 and usage.unmanifested == report.unmanifested > 0
    assert f"{p.root}/checkpoints/mine" in {r["group"] for r in report.by_group}
    text = usage_markdown(usage)
    assert "**This run wrote 3 objects" in text and "| checkpoint | 2 |" in text.split("## The bucket", 1)[0]
    assert "A cleanup would reclaim" in text and "| abandoned-prefix |" in text and "by run prefix" in text
    assert usage_png(usage).startswith(b"\x89PNG")
