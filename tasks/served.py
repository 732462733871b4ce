"""Prefect tasks of the served stage: fetch the export, serve the target with and without it and measure both,
publish the report (S3 JSON with a manifest, Prefect table and markdown)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from dflash_core.evaluate.served import ConcurrencyPass, markdown_table
from dflash_core.evaluate.served import serve_and_measure as measure
from dflash_core.layout import ArtifactKind
from dflash_core.lineage import InputRef, Manifest, input_ref, write_artifact
from dflash_core.serving.profiles import VllmProfile
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage, retry_unless

EXPORT_FILES = ("config.json", "model.safetensors")
_RETRY = {"retries": 2, "retry_delay_seconds": [5, 15], "retry_condition_fn": retry_unless(ValueError)}


@task(**_RETRY)
def fetch_export(settings: Settings, *, prefix_uri: str, dest: Path) -> tuple[Path, list[InputRef]]:
    """The export's config.json and weights in `dest` (a local dir is used as it is), and their input refs."""
    local = Path(prefix_uri)
    if local.is_dir():
        return local, []
    store = ObjectStore.from_settings(settings)
    prefix = store.key_of(prefix_uri).rstrip("/")
    refs = []
    for name in EXPORT_FILES:
        key = f"{prefix}/{name}"
        if not store.exists(key):
            raise ValueError(f"export {prefix_uri!r} has no {name}: pass an export stage's result or prefix")
        store.get_file(key, dest / name)
        refs.append(input_ref(store, key))
    return dest, refs


def engine_version(python: str) -> str:
    """The vLLM version installed for `python` (the engine's interpreter), read without importing vLLM."""
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    found = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if found.returncode != 0:
        raise ValueError(f"no vLLM for {python}: install the node's vLLM set (infra/node-install.sh, --vllm) and set "
                         f"the served stage's python to that venv's interpreter")
    return found.stdout.strip()


@task
def serve_and_measure(profile: VllmProfile, *, name: str, run_dir: Path, port: int, device: str | None,
                      prompts: list[list[int]], max_new_tokens: int, concurrencies: list[int]) -> list[ConcurrencyPass]:
    """Start one server of `profile`, wait until it answers, measure it at every concurrency, stop it."""
    return measure(profile, run_dir=run_dir / name, port=port, device=device, prompts=prompts,
                   max_new_tokens=max_new_tokens, concurrencies=concurrencies, log=get_run_logger().info)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def publish_served(settings: Settings, *, served: dict[str, Any], key_prefix: str, inputs: list[InputRef],
                   config: dict[str, Any], evaluator_tau: float | None) -> Manifest:
    """report.json to S3 with a manifest, then the served table and a markdown summary as Prefect artifacts."""
    store = ObjectStore.from_settings(settings)
    body = {**served, "config": config, "evaluator_tau": evaluator_tau}
    manifest = write_artifact(store, f"{key_prefix}/report.json", json.dumps(body, indent=2).encode(),
                              kind=ArtifactKind.REPORT, inputs=inputs, config=config, producer=run_producer())
    create_table_artifact([{k: v for k, v in row.items() if k != "acceptance_per_position"} for row in served["rows"]],
                          key="served-drafter", description=f"the drafter served by {config['engine']}")
    create_markdown_artifact(
        f"### The drafter served by {config['engine']}\n\n{markdown_table(served, evaluator_tau=evaluator_tau)}\n\n"
        f"Acceptance per draft position (engine): {served['acceptance_per_position']}\n\nReport: `{manifest.uri}`",
        key="served-drafter-summary")
    return manifest
