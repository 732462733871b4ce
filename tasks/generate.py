"""Prefect tasks of the generate flow: import prompts, launch servers, canary, one task per shard, stop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from dflash_core.data.holdout import HOLDOUT_RULE, HoldoutSpec, split_heldout
from dflash_core.data.prompts import (
    PromptRecord, PromptSource, import_prompts, read_prompt_lines, shard_prompts,
)
from dflash_core.layout import (
    HELDOUT_STEM, QUARANTINE_SUFFIX, ArtifactKind, artifact_key, is_heldout_key, shard_name,
)
from dflash_core.lineage import InputRef, read_manifest, write_artifact
from dflash_core.provenance import Producer
from dflash_core.serving import launcher
from dflash_core.serving.canary import CanaryReport, CanaryThresholds, check_canary
from dflash_core.serving.client import FailedPrompt, complete_all
from dflash_core.serving.generation import GenerationTarget, ShardAssignment, ShardOutcome, generate_shard
from dflash_core.serving.profiles import _EngineProfile
from dflash_core.settings import Settings
from dflash_core.storage import ObjectNotFound, ObjectStore, sha256_bytes
from tasks.artifacts import artifact_record
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage


class CanaryFailed(RuntimeError):
    """The first completions look wrong; the full run would waste GPU hours."""


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def import_prompt_set(settings: Settings, *, sources: list[PromptSource], dataset: str, version: str,
                      total: int | None, shard_size: int, seed: int, holdout: HoldoutSpec) -> list[str]:
    """Stream, normalize, dedupe and mix prompt sources into JSONL shards with manifests, the held-out split
    in shards of its own (heldout-*.jsonl); keys of every shard, training ones first. A file already stored
    with the same content (a rerun of the same import) is kept with its manifest, so the run that first
    imported it stays its producer. A stored prompt set split by another rule that held out other prompts is
    refused (`_refuse_another_split`)."""
    store = ObjectStore.from_settings(settings)
    records, report = import_prompts(sources, total=total, seed=seed)
    if not records:
        raise ValueError(f"no usable prompt in {[str(s.path) for s in sources]}: rejected {dict(report.rejected)}")
    train, heldout = split_heldout(records, holdout)
    prefix = artifact_key(settings.s3_prefixes, ArtifactKind.PROMPTS, dataset, version) + "/"
    _refuse_another_split(store, prefix, heldout=heldout)
    producer = run_producer()
    config = {"sources": [{"path": str(s.path), "name": s.name, "weight": s.weight} for s in sources],
              "total": total, "seed": seed, "shard_size": shard_size,
              "holdout": {**holdout.model_dump(), "rule": HOLDOUT_RULE}}
    keys = []
    for stem, split in (("prompts", train), (HELDOUT_STEM, heldout)):
        for index, shard in enumerate(shard_prompts(split, shard_size=shard_size)):
            key = artifact_key(settings.s3_prefixes, ArtifactKind.PROMPTS, dataset, version,
                               shard_name(index, stem=stem, suffix="jsonl"))
            _keep_or_write(store, key, b"".join(r.to_json_line() for r in shard), kind=ArtifactKind.PROMPTS,
                           config=config, producer=producer)
            keys.append(key)
    base = artifact_key(settings.s3_prefixes, ArtifactKind.PROMPTS, dataset, version, "import-report.json")
    summary = {**report.to_dict(), "heldout": len(heldout), "train": len(train)}
    _keep_or_write(store, base, json.dumps(summary, indent=2).encode(), kind=ArtifactKind.REPORT,
                   config=config, producer=producer)
    if report.quarantine:
        lines = b"".join(json.dumps(q, ensure_ascii=False, default=str).encode() + b"\n" for q in report.quarantine)
        _keep_or_write(store, base + QUARANTINE_SUFFIX, lines, kind=ArtifactKind.REPORT, config=config,
                       producer=producer)
    get_run_logger().info("imported %d prompts into %d shards (%d held out for evaluation); rejected %s",
                          report.accepted, len(keys), len(heldout), dict(report.rejected))
    return keys


def _refuse_another_split(store: ObjectStore, prefix: str, *, heldout: list[PromptRecord]) -> None:
    """Raise ValueError when the held-out shards stored under `prefix` were split by another rule than
    `HOLDOUT_RULE` (none recorded: prompt by prompt) and hold out other prompts than `heldout`: rewriting the
    prompt set in place would measure drafters trained on its old training shards on prompts they learned, and
    leave old shards the new split does not rewrite."""
    stored = [i.key for i in store.list(prefix) if is_heldout_key(i.key) and i.key.endswith(".jsonl")]
    rules = set()
    for key in stored:
        try:
            rules.add((read_manifest(store, key).config.get("holdout") or {}).get("rule") or "prompt")
        except (ObjectNotFound, ValueError):
            rules.add("unrecorded")
    if rules <= {HOLDOUT_RULE}:
        return
    stored_ids = {prompt.id for key in stored for prompt in read_prompt_lines(store.get_bytes(key))}
    moved = stored_ids ^ {prompt.id for prompt in heldout}
    if moved:
        raise ValueError(f"{store.uri(prefix)} holds a held-out split made by rule {', '.join(sorted(rules))}; "
                         f"this import holds out whole conversations (rule {HOLDOUT_RULE!r}), so {len(moved)} "
                         f"prompts change sides: import into a new prompts_version and generate into a new run, "
                         f"so that nothing trained on the old split is evaluated on the new one")


def _keep_or_write(store: ObjectStore, key: str, data: bytes, *, kind: ArtifactKind, config: dict,
                   producer: Producer) -> None:
    """Write `data` at `key` with its manifest unless the object and its manifest already hold exactly this
    content."""
    digest = sha256_bytes(data)
    try:
        if read_manifest(store, key).sha256 == digest and store.head(key).sha256 == digest:
            return
    except (ObjectNotFound, ValueError):  # no object, no manifest, or one that does not parse: write both
        pass
    write_artifact(store, key, data, kind=kind, config=config, producer=producer)


def prompt_ids(settings: Settings, keys: list[str]) -> list[str]:
    """The ids of the prompts in these prompt shards, in order."""
    store = ObjectStore.from_settings(settings)
    return [prompt.id for key in keys for prompt in read_prompt_lines(store.get_bytes(key))]


@task
def launch_servers(profile: _EngineProfile, *, num_instances: int, base_port: int, run_dir: Path,
                   devices: list[str] | None, ui_artifact: str = "inference-endpoints") -> list[str]:
    """Start the inference servers detached, wait until every one answers; their URLs."""
    instances = launcher.launch(profile, num_instances=num_instances, base_port=base_port, run_dir=run_dir,
                                devices=devices)
    seconds = launcher.wait_until_ready(instances, profile)
    rows = "\n".join(f"| {i.index} | {i.url} | {i.device or '-'} | {i.record.pid} | {s:.0f} s | `{i.log_path}` |"
                     for i, s in zip(instances, seconds))
    create_markdown_artifact(
        f"### Inference servers ({profile.engine})\nmodel `{profile.request_model}`\n\n"
        f"| # | url | device | pid | ready after | log |\n|---|---|---|---|---|---|\n{rows}\n",
        key=ui_artifact, description="Endpoints the generate flow uses")
    return [i.url for i in instances]


def report_failures(warning: str, *, run: str, ui_artifact: str = "generation-failures") -> None:
    """A visible warning (artifact and log) for failed prompts below the flow's threshold."""
    get_run_logger().warning("generation %s: %s", run, warning)
    create_markdown_artifact(f"### Generation {run}: some prompts failed\n\n{warning}\n", key=ui_artifact,
                             description=f"{run}: failed prompts (below max_failed_fraction)")


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def publish_generation_report(settings: Settings, *, key: str, report: dict, shard_keys: list[str]) -> list[dict]:
    """The run's report (counts, failures, verdict) with the stored shards as its inputs; records of the
    shards and the report."""
    store = ObjectStore.from_settings(settings)
    shards = [read_manifest(store, shard_key) for shard_key in shard_keys]
    manifest = write_artifact(store, key, json.dumps(report, indent=2, default=str).encode(), kind=ArtifactKind.REPORT,
                              inputs=[InputRef(uri=m.uri, sha256=m.sha256) for m in shards], producer=run_producer())
    return [artifact_record(m) for m in shards] + [artifact_record(manifest)]


@task
def stop_servers(run_dir: Path) -> int:
    """Stop every server the launch recorded in `run_dir`."""
    return launcher.stop_recorded(run_dir)


@task
def run_canary(settings: Settings, *, prompt_key: str, target: GenerationTarget, count: int,
               thresholds: CanaryThresholds, ui_artifact: str = "generation-canary") -> CanaryReport:
    """Generate the first `count` prompts and refuse the run when the answers look wrong."""
    store = ObjectStore.from_settings(settings)
    prompts = read_prompt_lines(store.get_bytes(prompt_key))[:count]

    async def collect():
        return [r async for r in complete_all(prompts, urls=target.urls, model=target.model, server=target.server,
                                              sampling=target.sampling, config=target.client,
                                              api_key=target.api_key)]

    results = asyncio.run(collect())
    report = check_canary(results, expect_thinking=target.sampling.enable_thinking, thresholds=thresholds)
    sample = next((r for r in results if not isinstance(r, FailedPrompt)), None)
    create_markdown_artifact(
        f"### Canary: {'passed' if report.passed else 'FAILED'}\n{report.model_dump_json(indent=2)}\n\n"
        f"First answer:\n```\n{(sample.reasoning or '') + chr(10) + sample.content if sample else '-'}\n```",
        key=ui_artifact)
    if not report.passed:
        raise CanaryFailed("canary failed: " + "; ".join(report.problems))
    return report


@task(retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=retry_store_outage)
def generate_completion_shard(settings: Settings, *, prompt_key: str, output_key: str,
                              target: GenerationTarget, progress_id=None,
                              assignment: ShardAssignment | None = None) -> ShardOutcome:
    """Answer every prompt of one shard (resuming any partial work) and write the shard with its manifest; a node
    share's writes only while the shard is still dealt to it (`assignment`)."""
    store = ObjectStore.from_settings(settings)
    counts = {"done": 0}
    total = len(read_prompt_lines(store.get_bytes(prompt_key)))

    def on_result(_result) -> None:
        counts["done"] += 1
        if progress_id is not None and counts["done"] % 8 == 0:
            update_progress_artifact(progress_id, progress=100.0 * counts["done"] / max(1, total))

    outcome = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target,
                             scratch_dir=settings.work_path("generate"), producer=run_producer(),
                             on_result=on_result, assignment=assignment)
    if progress_id is not None:
        update_progress_artifact(progress_id, progress=100.0)
    return outcome


def new_progress(description: str):
    return create_progress_artifact(progress=0.0, description=description)
