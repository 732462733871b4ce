"""multi_gpu.py's process handling: launch one tagged training process tree, follow its metrics,
find and end its workers (by an environment tag, so nothing else on the machine is touched)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
REPO = Path(__file__).resolve().parents[2]  # the checkout: the training processes' cwd and PYTHONPATH
TAG_VARIABLE = "DFLASH_BENCH_TAG"


@dataclass
class Run:
    name: str
    argv: list[str]
    returncode: int | None = None
    wall_s: float = 0.0
    first_step_s: float | None = None  # start -> first metrics record (imports, target, compile, validation)
    after_last_step_s: float | None = None  # last metrics record -> exit (the final checkpoint write)
    records: list[dict] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)
    log_tail: str = ""
    ended_at: float = 0.0  # time.monotonic() when the exit was seen
    completed: bool = False  # rank 0 printed its final line: training and the last checkpoint are done


# ---- processes ------------------------------------------------------------------------------------

def child_env(work: Path, tag: str, *, cpu: bool) -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, TAG_VARIABLE: tag, "PYTHONUNBUFFERED": "1",
           "DFLASH_WORK_DIR": str(work / "dflash"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if cpu:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def tagged_processes(tag: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every process this bench started (they carry its tag) that runs the entry."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "environ").read_bytes()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"{TAG_VARIABLE}={tag}".encode() not in raw or b"dflash_core.train.entry" not in cmdline:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        found[int(proc.name)] = env
    return found


def worker_pid(tag: str, rank: int) -> int | None:
    """The training worker of global rank `rank` (torchrun's agent has no RANK in its environment)."""
    pids = [pid for pid, env in tagged_processes(tag).items() if env.get("RANK") == str(rank)]
    return min(pids) if pids else None


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def end_tagged(tag: str) -> None:
    """Kill what is left of this bench's own process trees, by id."""
    for pid in tagged_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return records


def launch(name: str, argv: list[str], *, env: dict, log: Path, metrics: Path, timeout_s: float, poll_s: float,
           on_poll=None, expect_failure: bool = False) -> Run:
    """Run one training process tree to its end; `on_poll(records, process)` is called while it runs."""
    run = Run(name=name, argv=argv)
    print(f"  $ {' '.join(argv[1:]) if argv[0] == sys.executable else ' '.join(argv)}", flush=True)
    started = time.monotonic()
    last_count, last_change = 0, None
    with open(log, "w") as sink:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        while process.poll() is None:
            if time.monotonic() - started > timeout_s:
                os.killpg(process.pid, signal.SIGKILL)
                end_tagged(env[TAG_VARIABLE])
                process.wait()
                sink.write(f"\n[bench] killed after the {timeout_s:.0f} s time limit\n")
                break
            records = read_records(metrics)
            if len(records) != last_count:
                last_count, last_change = len(records), time.monotonic()
                if run.first_step_s is None:
                    run.first_step_s = last_change - started
            if on_poll is not None:
                on_poll(records, process)
            time.sleep(poll_s)
    run.ended_at = time.monotonic()
    run.returncode = process.returncode
    run.wall_s = run.ended_at - started
    if last_change is not None:
        run.after_last_step_s = run.ended_at - last_change
    text = log.read_text(errors="replace")
    run.records = read_records(metrics)
    run.summaries = [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("rank-summary ")]
    run.log_tail = text[-6000:]
    run.completed = any(line.startswith('{"final_step"') for line in text.splitlines())
    status = "ok" if run.returncode == 0 else f"exit {run.returncode}"
    print(f"  {name}: {status} in {run.wall_s:.0f} s, {len(run.records)} steps logged", flush=True)
    if run.returncode != 0 and not expect_failure:
        print("\n".join(f"    | {line}" for line in text.splitlines()[-15:]), flush=True)
    return run
