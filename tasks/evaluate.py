"""Prefect tasks of the evaluate flow: fetch the drafter checkpoint and prompts, run the evaluator,
publish the report (S3 JSON + PNG with manifests, Prefect table/markdown/image artifacts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from dflash_core.layout import CHECKPOINT_META_FILE, CHECKPOINT_MODEL_FILE, ArtifactKind
from dflash_core.lineage import InputRef, Manifest, input_ref, write_artifact
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore, sha256_file
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage, retry_unless
from tasks.store import png_artifact


# A ValueError is the user's (a wrong path stays wrong); any other failure may be transient.
retry_unless_user_error = retry_unless(ValueError)
_RETRY = {"retries": 3, "retry_delay_seconds": [2, 5, 15], "retry_condition_fn": retry_unless_user_error}


@task(**_RETRY)
def fetch_checkpoint(settings: Settings, *, checkpoint: str, cache_dir: Path) -> tuple[Path, list[InputRef]]:
    """A local checkpoint dir (downloaded from S3 unless `checkpoint` is a local dir) and its input refs."""
    from dflash_core.storage.local_paths import path_inside

    local = Path(checkpoint)
    names = (CHECKPOINT_MODEL_FILE, CHECKPOINT_META_FILE)
    if local.is_dir():
        return local, [InputRef(uri=(local / n).resolve().as_uri(), sha256=sha256_file(local / n))
                       for n in names if (local / n).is_file()]
    store = ObjectStore.from_settings(settings)
    prefix = store.key_of(checkpoint).rstrip("/")
    target = path_inside(cache_dir, prefix)
    if not store.exists(f"{prefix}/{CHECKPOINT_META_FILE}"):
        raise ValueError(f"checkpoint {checkpoint!r} is neither a local dir nor an S3 checkpoint with {CHECKPOINT_META_FILE}")
    refs = []
    for name in names:
        store.get_file(f"{prefix}/{name}", target / name)
        refs.append(input_ref(store, f"{prefix}/{name}"))
    return target, refs


@task(**_RETRY)
def fetch_prompt_bytes(settings: Settings, *, prompts: str) -> tuple[bytes, InputRef]:
    """The prompt file's bytes (local path or S3 key) and its input ref."""
    local = Path(prompts)
    if local.is_file():
        return local.read_bytes(), InputRef(uri=local.resolve().as_uri(), sha256=sha256_file(local))
    store = ObjectStore.from_settings(settings)
    key = store.key_of(prompts)
    if not store.exists(key):
        raise ValueError(f"prompts {prompts!r} is neither a local file nor an S3 object")
    return store.get_bytes(key), input_ref(store, key)


@task
def run_evaluation(*, target: Any, drafter: Any, prompts: list[list[int]], modes: tuple[str, ...],
                   max_new_tokens: int, eos_token_id: int | None, tree_budget: int | None,
                   harness: str = "auto") -> dict[str, Any]:
    """Decode every prompt target-only and in each mode; the evaluator's report."""
    from dflash_core.evaluate import evaluate_prompts

    return evaluate_prompts(target=target, drafter=drafter, prompts=prompts, modes=modes,
                            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, tree_budget=tree_budget,
                            harness=harness)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def publish_evaluation(settings: Settings, *, report: dict[str, Any], key_prefix: str, inputs: list[InputRef],
                       config: dict[str, Any], work_dir: Path, measured_on: str) -> Manifest:
    """report.json and acceptance.png to S3 with manifests (inputs: the checkpoint and prompts), then
    the table, a markdown summary and the PNG as Prefect artifacts."""
    from dflash_core.evaluate import plot_acceptance

    store = ObjectStore.from_settings(settings)
    producer = run_producer()
    work_dir.mkdir(parents=True, exist_ok=True)
    png = plot_acceptance(report["summaries"], work_dir / "acceptance.png")
    png_manifest = write_artifact(store, f"{key_prefix}/acceptance.png", png, kind=ArtifactKind.REPORT,
                                  inputs=inputs, config=config, producer=producer)
    body = {**report, "plot_uri": png_manifest.uri, "config": config, "measured_on": measured_on}
    manifest = write_artifact(store, f"{key_prefix}/report.json", json.dumps(body, indent=2).encode(),
                              kind=ArtifactKind.REPORT, inputs=inputs, config=config, producer=producer)
    columns = ("mode", "harness", "num_responses", "num_rounds", "tau", "speedup", "tokens_per_s",
               "baseline_tokens_per_s", "all_match_target", "exact_matches", "near_ties", "divergences")
    rows = [{k: s.get(k) for k in columns} for s in report["summaries"]]
    create_table_artifact(rows, key="drafter-evaluation",
                          description=f"tau and speedup per decoding mode, measured on {measured_on}")
    create_markdown_artifact(
        f"### Drafter evaluation\n\nMeasured on: **{measured_on}**\n\n{report['table']}\n\nReport: `{manifest.uri}`\n\n"
        "Inputs:\n" + "\n".join(f"- `{i.uri}`" for i in inputs), key="drafter-evaluation-summary")
    png_artifact(Path(png).read_bytes(), key="drafter-acceptance-plot",
                 description="tau histogram and per-position acceptance")
    return manifest
