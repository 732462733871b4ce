"""Profiling for loop.py (and any Trainer bench): torch.profiler over a window of steps, and what its
chrome trace says: the GPU's busy time, each Trainer phase's host and device time, the top kernels and the
host's top ops.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

PHASES = ("dflash.prepare_batch", "dflash.target_forward", "dflash.drafter_step", "dflash.optimizer")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def trace_summary(path: Path, *, steps: int, wall_ms: float) -> dict:
    """From a chrome trace: the GPU's busy time (kernels, copies, memsets; overlaps counted once); per
    Trainer phase its host time and the device time of the work it launched (a kernel belongs to the
    phase whose range holds its launch call), plus its span on the GPU where kineto records one;
    the top kernels."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy_us = _union_us([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device])
    launched_at = {e["args"]["correlation"]: float(e["ts"]) for e in events
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name") in PHASES)
    starts = [start for start, _, _ in ranges]
    phases = {name: {"host_ms": 0.0, "device_ms": 0.0, "gpu_span_ms": 0.0} for name in PHASES}
    for start, end, name in ranges:
        phases[name]["host_ms"] += (end - start) / 1e3 / steps
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and e.get("name") in PHASES:
            phases[e["name"]]["gpu_span_ms"] += float(e.get("dur", 0)) / 1e3 / steps
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in device:
        duration = float(e.get("dur", 0))
        by_kernel[e["name"]][0] += duration
        by_kernel[e["name"]][1] += 1
        launch = launched_at.get(e.get("args", {}).get("correlation"))
        index = bisect.bisect_right(starts, launch) - 1 if launch is not None else -1
        if index >= 0 and launch <= ranges[index][1]:
            phases[ranges[index][2]]["device_ms"] += duration / 1e3 / steps
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:25]
    return {
        "steps": steps, "wall_ms_per_step": wall_ms / steps, "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
        "gpu_busy_share": busy_us / 1e3 / wall_ms if wall_ms else float("nan"),
        "phases": phases,
        "top_kernels": [{"name": name, "ms_per_step": total / 1e3 / steps, "calls_per_step": count / steps,
                         "share_of_busy": total / busy_us if busy_us else float("nan")}
                        for name, (total, count) in top],
    }


def top_host_ops(averages, *, steps: int, limit: int = 20) -> list[dict]:
    """Where the host's time goes, op by op (self time: without the ops each one calls), per step. On a GPU
    the step is host-bound (the acceptance bench's), so these, not the kernels, set its time; a sync shows up
    as a long cudaStreamSynchronize or aten::_local_scalar_dense."""
    rows = sorted(averages, key=lambda event: -event.self_cpu_time_total)[:limit]
    return [{"name": event.key, "self_host_ms_per_step": event.self_cpu_time_total / 1e3 / steps,
             "calls_per_step": event.count / steps} for event in rows]


def format_trace_summary(summary: dict) -> str:
    lines = [f"profiled {summary['steps']} steps: wall {summary['wall_ms_per_step']:.1f} ms/step"]
    if summary["gpu_busy_ms_per_step"]:
        lines[0] += (f", GPU busy {summary['gpu_busy_ms_per_step']:.1f} ms/step "
                     f"({summary['gpu_busy_share']:.1%} of wall; the rest the GPU waited on the host)")
    lines.append(f"{'phase (per step)':<24}{'host ms':>9}{'device ms':>11}{'GPU span ms':>13}")
    for name, row in summary["phases"].items():
        lines.append(f"{name:<24}{row['host_ms']:>9.1f}{row['device_ms']:>11.1f}{row['gpu_span_ms']:>13.1f}")
    if summary["top_kernels"]:
        lines.append(f"{'ms/step':>8}{'% busy':>8}{'calls':>7}  kernel")
        for row in summary["top_kernels"]:
            lines.append(f"{row['ms_per_step']:>8.2f}{row['share_of_busy']:>8.1%}{row['calls_per_step']:>7.0f}  "
                         f"{row['name'][:110]}")
    if summary.get("top_host_ops"):
        lines.append(f"{'host ms':>8}{'calls':>7}  op (self host time per step)")
        for row in summary["top_host_ops"]:
            lines.append(f"{row['self_host_ms_per_step']:>8.2f}{row['calls_per_step']:>7.0f}  {row['name'][:110]}")
    return "\n".join(lines)


class StepProfiler:
    """torch.profiler over the steps after `start_after`: one warm-up step, then `steps` active ones,
    with a device sync on each side of the active window (its wall time is the window's)."""

    def __init__(self, *, start_after: int, steps: int, cuda: bool, out: Path) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.start_after, self.steps, self.cuda, self.out = start_after, steps, cuda, out
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                                on_trace_ready=self._ready)
        self.table = ""
        self.summary: dict | None = None
        self._window_start = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_step(self, step: int) -> None:
        if step == self.start_after:
            self._sync()
            self.profiler.start()  # the next step is the profiler's warm-up
        elif step == self.start_after + 1:
            self._sync()
            self.profiler.step()  # warm-up -> active
            self._window_start = time.perf_counter()
        elif step == self.start_after + 1 + self.steps:
            self._sync()
            self.wall_ms = 1e3 * (time.perf_counter() - self._window_start)
            self.profiler.step()  # active window done: _ready runs
        elif self.start_after + 1 < step < self.start_after + 1 + self.steps:
            self.profiler.step()

    def _ready(self, profiler) -> None:
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        averages = profiler.key_averages()
        self.table = averages.table(sort_by=sort_by, row_limit=25, max_name_column_width=80)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.out))
        self.summary = trace_summary(self.out, steps=self.steps, wall_ms=self.wall_ms)
        self.summary["top_host_ops"] = top_host_ops(averages, steps=self.steps)
        self.out.with_name(self.out.name.split(".")[0] + ".txt").write_text(
            self.table + "\n" + format_trace_summary(self.summary) + "\n")

    def stop(self) -> None:
        if self.profiler.profiler is not None:
            self.profiler.stop()


def default_profile_out(output_dir: Path) -> Path:
    out = os.environ.get("OUT")
    return (Path(out) if out else output_dir) / "train_e2e_trace.json.gz"
