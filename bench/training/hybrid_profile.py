"""The hybrid bench's --profile readers: the top ops, copies by the code that made them, the GPU's
idle gaps and where the host waited on the GPU (hybrid.py imports them)."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def step_profiler(args, *, cuda: bool):
    """torch.profiler over the timed steps only (the warmup steps, compilation included, are skipped)."""
    if not args.profile:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    schedule = torch.profiler.schedule(wait=args.warmup, warmup=0, active=args.steps, repeat=1)
    # with_stack: python frames become parents of the ops, which is how print_copy_sources attributes them
    return torch.profiler.profile(activities=activities, schedule=schedule, with_stack=True)


def print_profile(profiler, *, cuda: bool, steps: int, label: str, rows: int) -> None:
    """The top ops by self device time (self CPU time without CUDA), per step."""
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    events = profiler.key_averages()
    total = sum(getattr(e, key.replace("cuda", "device"), getattr(e, key, 0)) for e in events) / steps / 1e3
    print(f"profile ({label}): top {rows} ops by {key.replace('_total', '')} per step "
          f"(sum of all ops {total:,.1f} ms/step)")
    print(events.table(sort_by=key, row_limit=rows, max_name_column_width=70))
    print_copy_sources(profiler, cuda=cuda, steps=steps)
    if cuda:
        print_gpu_idle(profiler, steps=steps)
        print_host_waits(profiler, steps=steps)


def gpu_idle(kernels: list[tuple[float, float, str]], *, gap_us: float = 200.0):
    """From kernels as (start µs, end µs, name): the time the GPU ran none of them between the first
    start and the last end, and the idle gaps longer than `gap_us` as (µs, kernel before, kernel after)."""
    if not kernels:
        return 0.0, 0.0, []
    kernels = sorted(kernels)
    idle, gaps = 0.0, []
    busy_until, last_name = kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > busy_until:
            idle += start - busy_until
            if start - busy_until > gap_us:
                gaps.append((start - busy_until, last_name, name))
        if end > busy_until:
            busy_until, last_name = end, name
    return busy_until - kernels[0][0], idle, sorted(gaps, reverse=True)


def print_gpu_idle(profiler, *, steps: int, rows: int = 8) -> None:
    """How much of the profiled window the GPU sat idle (the host not keeping it fed), and the longest
    gaps with the kernels on either side."""
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
               and e.name != "Command Buffer Full"]
    span, idle, gaps = gpu_idle(kernels)
    if not span:
        return
    print(f"GPU idle: {idle / steps / 1e3:,.1f} ms of {span / steps / 1e3:,.1f} ms per step "
          f"({idle / span:.1%}); gaps over 0.2 ms: {len(gaps) / steps:,.1f} a step, "
          f"{sum(g[0] for g in gaps) / steps / 1e3:,.1f} ms; the longest:")
    for gap, before, after in gaps[:rows]:
        print(f"  {gap / 1e3:8.2f} ms  after {before[:70]}  before {after[:70]}")


_COPY_OPS = ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_")
_OWN_CODE = ("dflash_core/", "transformers/", "fla/", "torch/optim/", "torch/nn/functional")


def print_copy_sources(profiler, *, cuda: bool, steps: int, rows: int = 15) -> None:
    """Copies, concatenations and fills by the code that asked for them: the nearest frames of
    dflash_core, transformers, fla or torch's optimizer in the Python stack the profiler recorded for
    the op or its nearest parent op (an op with no recorded stack at all, e.g. one autograd's backward
    ran, shows as its chain of parent ops, e.g. aten::clone <- CloneBackward0)."""
    by_source: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.name not in _COPY_OPS:
            continue
        source = f"{event.name} <- " + _caller(event)
        time_us = (getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
                   if cuda else event.self_cpu_time_total)
        totals = by_source.setdefault(source, [0.0, 0])
        totals[0] += time_us / steps / 1e3
        totals[1] += 1 / steps
    print(f"copies by source, per step ({'device' if cuda else 'CPU'} ms, calls):")
    for source, (ms, calls) in sorted(by_source.items(), key=lambda item: -item[1][0])[:rows]:
        print(f"  {ms:8.2f} ms {calls:7.1f}  {source[:240]}")


def _caller(event) -> str:
    ops, node = [], event.cpu_parent
    while node is not None:
        stack = [frame for frame in (getattr(node, "stack", None) or [])
                 if "profiler" not in frame and not frame.startswith("<built-in") and "torch/nn/modules/" not in frame]
        if stack:
            own = [frame for frame in stack if any(part in frame for part in _OWN_CODE)][:2] or stack[:1]
            shown = [frame.split("site-packages/")[-1].split("/tmp/pylib/")[-1].split(str(Path.cwd()) + "/")[-1]
                     for frame in own]
            return " <- ".join(ops[:2] + shown)
        name = _module_class(node.name)
        if not name.startswith("<built-in") and "torch/nn/modules/" not in name and (not ops or ops[-1] != name):  # <built-in ...> names carry an object's address
            ops.append(name)
        node = node.cpu_parent
    return " <- ".join(ops[:4]) or "-"


def _module_class(name: str) -> str:
    """`nn.Module: Layer_5` -> `nn.Module: Layer` (one row per call site, not per layer instance)."""
    return re.sub(r"^(nn\.Module: .*?)_\d+$", r"\1", name)


_WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                  "cudaMemcpy")


def print_host_waits(profiler, *, steps: int, min_ms: float = 0.5, rows: int = 8) -> None:
    """Where the host waited on the GPU: CUDA runtime calls that block (synchronize, a copy to the
    host) and took over `min_ms`, by the code that made them. Each such wait drains the GPU's queue,
    and the GPU then idles while the host catches up."""
    by_source: dict[str, list[float]] = {}
    for event in profiler.events():
        if event.name not in _WAITING_CALLS or event.cpu_time_total < min_ms * 1e3:
            continue
        totals = by_source.setdefault(f"{event.name} <- {_caller(event)}", [0.0, 0])
        totals[0] += event.cpu_time_total / steps / 1e3
        totals[1] += 1 / steps
    print(f"host waits over {min_ms} ms, per step (host ms, calls):")
    for source, (ms, calls) in sorted(by_source.items(), key=lambda item: -item[1][0])[:rows]:
        print(f"  {ms:8.2f} ms {calls:7.1f}  {source[:300]}")
