"""Start N data-parallel instances of one engine profile as detached process groups, wait until
each answers, and stop them by their recorded PIDs (also from another process, via the run dir).

A launch first stops the servers recorded in its run dir (left running by a flow process that was
killed): only a port held by a process we did not start is an error."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_core.serving.profiles import _EngineProfile
from dflash_core.services.process import (
    ProcessRecord, ServiceError, is_alive, port_is_free, start_detached, stop, wait_ready,
)

INSTANCES_FILE = "instances.json"
# What vLLM, SGLang and torch print when a server's weights, activations or KV cache do not fit its GPU share.
OUT_OF_MEMORY_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "No available memory for the cache blocks",
                         "larger than the available KV cache memory", "Not enough memory")


class EngineOutOfMemory(ServiceError):
    """An inference server ran out of GPU memory while starting: retrying the same settings fails the same way."""


def named_failure(error: ServiceError, profile: _EngineProfile) -> ServiceError:
    """`error` as an EngineOutOfMemory, with what to change, when the server's log says it ran out of memory."""
    if not any(marker in str(error) for marker in OUT_OF_MEMORY_MARKERS):
        return error
    knobs = {"vllm": "gpu_memory_utilization or max_model_len", "sglang": "mem_fraction_static or context_length",
             "transformers": "cb_memory_fraction"}.get(profile.engine, "its memory settings")
    return EngineOutOfMemory(f"{profile.engine} ran out of GPU memory while starting: lower {knobs}, or run fewer "
                             f"instances per GPU (devices). {error}")
# A server we just stopped can hold its port a moment after its PID reads dead: a multi-threaded process's
# leader turns zombie before the last thread has closed the files they share (the listening socket too).
PORT_RELEASE_GRACE_S = 10.0


@dataclass
class ServerInstance:
    index: int
    url: str
    port: int
    device: str | None
    record: ProcessRecord

    @property
    def log_path(self) -> str:
        return self.record.log_path


def launch(profile: _EngineProfile, *, num_instances: int, base_port: int, run_dir: Path,
           devices: list[str] | None = None) -> list[ServerInstance]:
    """Start `num_instances` servers on ports base_port, base_port+1, ...; one device each if given."""
    if num_instances < 1:
        raise ValueError(f"num_instances must be >= 1, got {num_instances}")
    if devices is not None and len(devices) < num_instances:
        raise ValueError(f"{num_instances} instances need {num_instances} devices, got {devices}")
    ports = [base_port + i for i in range(num_instances)]
    stopped = stop_recorded(run_dir)  # our own servers from a run that was killed before it could stop them
    busy = held_ports(ports, profile.host, grace_s=PORT_RELEASE_GRACE_S if stopped else 0.0)
    if busy:
        raise ServiceError(
            f"port(s) {busy} on {profile.host} are held by a process this launcher did not start (none is "
            f"recorded in {run_dir}): stop that process, or choose another base_port")
    run_dir.mkdir(parents=True, exist_ok=True)
    instances = []
    for index, port in enumerate(ports):
        device = devices[index] if devices else None
        record = start_detached(
            f"{profile.engine}-{index}", profile.argv(port=port),
            log_path=run_dir / f"server-{index}.log", record_path=run_dir / f"server-{index}.json",
            env=profile.instance_env(device), cwd=run_dir,
        )
        instances.append(ServerInstance(index=index, url=f"http://{_url_host(profile.host)}:{port}", port=port,
                                        device=device, record=record))
    _save(run_dir, instances)
    return instances


def wait_until_ready(instances: list[ServerInstance], profile: _EngineProfile) -> list[float]:
    """Poll every instance's /health and /v1/models in parallel; seconds each took. On failure all are
    stopped and the error quotes the failing instance's log tail."""
    def one(instance: ServerInstance) -> float:
        return wait_ready(instance.record, lambda: is_ready(instance.url, profile), timeout_s=profile.ready_timeout_s)

    with ThreadPoolExecutor(max(1, len(instances))) as pool:
        futures = [pool.submit(one, instance) for instance in instances]
        try:
            return [future.result() for future in futures]
        except ServiceError as error:
            stop_instances(instances)
            raise named_failure(error, profile) from None


def is_ready(url: str, profile: _EngineProfile) -> bool:
    headers = {"Authorization": f"Bearer {profile.api_key.get_secret_value()}"} if profile.api_key else {}
    for path in ("/health", "/v1/models"):
        request = urllib.request.Request(url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
    return True


def stop_instances(instances: list[ServerInstance]) -> None:
    with ThreadPoolExecutor(max(1, len(instances))) as pool:
        list(pool.map(lambda instance: stop(instance.record), instances))


def load_instances(run_dir: Path) -> list[ServerInstance]:
    """The instances a `launch` recorded in `run_dir` (e.g. to stop them from a cleanup hook)."""
    path = run_dir / INSTANCES_FILE
    if not path.exists():
        return []
    raw = json.loads(path.read_text())
    return [ServerInstance(**{**item, "record": ProcessRecord(**item["record"])}) for item in raw]


def stop_recorded(run_dir: Path) -> int:
    """Stop every recorded server still running (also those of a launch killed before it wrote
    instances.json: each server has its own record); how many were running."""
    records = {instance.record.pid: instance.record for instance in load_instances(run_dir)}
    for path in sorted(Path(run_dir).glob("server-*.json")) if Path(run_dir).is_dir() else []:
        record = ProcessRecord.load(path)
        if record is not None:
            records.setdefault(record.pid, record)
    running = [record for record in records.values() if is_alive(record)]
    with ThreadPoolExecutor(max(1, len(running))) as pool:
        list(pool.map(stop, running))
    return len(running)


def held_ports(ports: list[int], host: str, *, grace_s: float = 0.0, interval_s: float = 0.1) -> list[int]:
    """The ports of `ports` that cannot be bound on `host`, polled for up to `grace_s` until none is held."""
    deadline = time.monotonic() + grace_s
    while True:
        busy = [port for port in ports if not port_is_free(port, host)]
        if not busy or time.monotonic() >= deadline:
            return busy
        time.sleep(interval_s)


def _save(run_dir: Path, instances: list[ServerInstance]) -> None:
    (run_dir / INSTANCES_FILE).write_text(json.dumps([asdict(instance) for instance in instances], indent=2))


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host
