"""The stage server: one process (`python -m flows.serve`) that registers every deployment of
infra/prefect.yaml and runs their flow runs, so the pipeline's stages, the UI's Run and Retry
buttons and the schedules work without a separate worker. A local service like S3 and Prefect:
started by `dflash services up`, records under `<work_dir>/services/stages/`, stopped by `down`.

It runs with the settings it was started with (exported as DFLASH_* variables): restart it
(`dflash services down && dflash services up`) after changing them or the code.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

from dflash_core.services.local import LocalService, prefect_client_env
from dflash_core.settings import Settings

REPO_DIR = Path(__file__).resolve().parents[2]
STAGES_READY_TIMEOUT_S = 180.0  # imports every flow (torch, transformers) on a busy 2-core machine
RUNNER_POLL_S = 2  # how soon a new or retried run starts (Prefect's default is 10 s)
RESULTS_BLOCK = "s3-bucket/dflash-results"  # saved by flows/results.py when the stage server starts
RESULTS_FOLDER = "prefect-results"


def settings_env(settings: Settings) -> dict[str, str]:
    """`settings` as the DFLASH_* variables that make a child process resolve the same settings."""
    env = {}
    for name, value in settings.model_dump(mode="json").items():
        if name.endswith(("access_key_id", "secret_access_key")):
            value = getattr(settings, name).get_secret_value()
        env[f"DFLASH_{name.upper()}"] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    env["DFLASH_WORK_DIR"] = str(settings.work_path())
    return env


def result_store_env(settings: Settings) -> dict[str, str]:
    """What a process needs to write and read Prefect results in our bucket: the block, and the S3
    keys in the environment (the block itself holds none)."""
    return {
        "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": RESULTS_BLOCK,
        "AWS_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
        "AWS_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value(),
    }


def stage_server_env(settings: Settings) -> dict[str, str]:
    return {
        **settings_env(settings), **prefect_client_env(settings), **result_store_env(settings),
        "PREFECT_RUNNER_POLL_FREQUENCY": str(RUNNER_POLL_S),
        # Persisted results: a Retry resumes at the failed task (finished ones come back Cached), and
        # a stage's result reaches the pipeline that started it.
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
    }


def deployment_names(path: Path = REPO_DIR / "infra" / "prefect.yaml") -> set[str]:
    import yaml

    return {spec["name"] for spec in yaml.safe_load(path.read_text())["deployments"]}


def deployments_ready(api_url: str) -> bool:
    """True when every deployment of infra/prefect.yaml is registered and polled by a runner (READY)."""
    names = deployment_names()
    body = json.dumps({"deployments": {"name": {"any_": sorted(names)}}, "limit": 200}).encode()
    request = urllib.request.Request(f"{api_url}/deployments/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        ready = {d["name"] for d in json.load(response) if d.get("status") == "READY"}
    return ready >= names


def stage_service(settings: Settings) -> LocalService:
    return LocalService(
        name="stages", argv=[sys.executable, "-m", "flows.serve"], env=stage_server_env(settings), ports=[],
        probe=lambda: deployments_ready(settings.prefect_api_url), ready_timeout_s=STAGES_READY_TIMEOUT_S,
        home=settings.work_path("services", "stages"), url=settings.prefect_api_url.removesuffix("/api") + "/deployments",
    )
