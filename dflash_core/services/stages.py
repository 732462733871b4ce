"""The stage server: one process (`python -m flows.serve`) that registers every deployment in the
`dflash` work pool and runs their flow runs as a worker of that pool, so the pipeline's stages, the
UI's Run and Retry buttons and the schedules work without starting a worker by hand. A local service
like S3 and Prefect: started by `dflash services up`, records under `<work_dir>/services/stages/`,
stopped by `down`.

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
WORKER_POLL_S = 1  # how soon a new or retried run starts (Prefect's default: 10 s); one query a poll
WORK_POOL = "dflash"
READY_FILE_ENV = "DFLASH_STAGES_READY_FILE"
RESULTS_BLOCK = "s3-bucket/dflash-results"  # saved by flows/results.py when the stage server starts


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
        "PREFECT_WORKER_QUERY_SECONDS": str(WORKER_POLL_S),
        "DFLASH_REPO_DIR": str(REPO_DIR),
        # Persisted results: a Retry resumes at the failed task (finished ones come back Cached), and
        # a stage's result reaches the pipeline that started it.
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
    }


def _ready_file(settings: Settings) -> Path:
    return settings.work_path("services", "stages") / "ready.json"


def stage_server_ready(settings: Settings, service: LocalService) -> bool:
    """True when the recorded stage server process has registered the deployments (its ready file names
    its PID) and its worker polls the pool (the pool is READY)."""
    record, ready = service.record(), _ready_file(settings)
    if record is None or not ready.exists():
        return False
    try:
        if json.loads(ready.read_text())["pid"] != record.pid:
            return False
    except (ValueError, KeyError):
        return False  # being written
    request = urllib.request.Request(f"{settings.prefect_api_url}/work_pools/{WORK_POOL}")
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response).get("status") == "READY"


def stage_service(settings: Settings) -> LocalService:
    service = LocalService(
        name="stages", argv=[sys.executable, "-m", "flows.serve"],
        env={**stage_server_env(settings), READY_FILE_ENV: str(_ready_file(settings))}, ports=[],
        probe=lambda: stage_server_ready(settings, service), ready_timeout_s=STAGES_READY_TIMEOUT_S,
        home=settings.work_path("services", "stages"), url=settings.prefect_api_url.removesuffix("/api") + "/deployments",
    )
    return service
