"""multi_gpu.py's figures of a run (tokens/s after warmup, losses by step, peak memory per GPU) and its
table: tokens/s per layout against one GPU, transfer against the planner, the exactness checks (DDP
checksums, pair losses against one GPU, kill -9 and resume)."""

from __future__ import annotations

import statistics
from typing import Any

from .multi_gpu_processes import Run


def tokens_per_s(run: Run, warmup: int) -> float | None:
    values = [r["tokens_per_s"] for r in run.records if r["step"] > warmup]
    return statistics.median(values) if values else None


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


def peak_per_gpu(run: Run) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for summary in run.summaries:
        for device, gib in summary.get("peak_gib", {}).items():
            peaks[device] = max(peaks.get(device, 0.0), gib)
    return dict(sorted(peaks.items()))


def _loss_diff(a: list[dict], b: list[dict]) -> float | None:
    la, lb = losses(a), losses(b)
    common = sorted(set(la) & set(lb))
    return max(abs(la[s] - lb[s]) for s in common) if common else None


def report(results: dict, shape: Any, *, cpu: bool, command: str) -> list[str]:
    """The table's lines; `shape` is multi_gpu.py's Shape."""
    lines = []
    runs = results["runs"]
    base = runs.get("colocated", {}).get("tokens_per_s")
    transfer = results.get("transfer", {})
    plan = results["planner"]
    header = (f"{'layout':<22}{'GPUs':>5}{'tokens/s':>11}{'per GPU':>10}{'efficiency':>11}"
              f"{'transfer ms/batch':>19}{'peak GiB per GPU':>24}{'loss@last':>10}{'setup s':>8}{'save s':>7}")
    lines += [header, "-" * len(header)]
    labels = {"colocated": ("colocated (1 process)", 1), "ddp": ("DDP colocated", 2),
              "pair": ("pair, serial", 2), "pair-overlap": ("pair, overlapped", 2)}
    for key, (label, gpus) in labels.items():
        row = runs.get(key)
        if row is None:
            continue
        if not row["completed"]:
            lines.append(f"{label:<22}{gpus:>5}  FAILED (exit {row['returncode']}); log tail in the JSON")
            continue
        total = row["tokens_per_s"] or 0.0
        per_gpu = total / gpus
        efficiency = f"{100 * per_gpu / base:.1f}%" if base and gpus > 1 else "-"
        if key == "pair" and transfer:
            copy = f"{transfer['median_ms']:.2f} (alone)"
        elif key == "pair-overlap" and row.get("transfer_ms") is not None:
            copy = f"{row['transfer_ms']:.2f} (in run)"
        else:
            copy = "-"
        peaks = " / ".join(f"{v:.1f}" for v in row["peak_gib"].values()) or "-"
        last_loss = row["records"][-1]["loss"] if row["records"] else float("nan")
        lines.append(f"{label:<22}{gpus:>5}{total:>11,.0f}{per_gpu:>10,.0f}{efficiency:>11}{copy:>19}{peaks:>24}"
                     f"{last_loss:>10.4f}{row['first_step_s'] or 0:>8.0f}{row['after_last_step_s'] or 0:>7.0f}"
                     + (f"  (exit {row['returncode']} after finishing)" if row["returncode"] != 0 else ""))
    lines.append(f"planner (`{plan['command']}`): {plan['transfer_bytes'] / 1e6:,.0f} MB a batch, "
                 f"{plan['transfer_ms']:.2f} ms at 450 GB/s")
    if transfer:
        lines.append(f"measured copy cuda:0 -> cuda:1 of those bytes: {transfer['median_ms']:.2f} ms "
                     f"({transfer['gb_per_s']:.0f} GB/s), peer access {transfer['peer_access']}")
    ddp = runs.get("ddp")
    if ddp and ddp["checksums"]:
        same = len(set(ddp["checksums"])) == 1
        lines.append(f"DDP drafter weights after {ddp['records'][-1]['step'] if ddp['records'] else '?'} steps, "
                     f"checksum per rank: {ddp['checksums']} -> {'identical' if same else 'DIFFERENT'}")
    for a, b, what in (("pair", "pair-overlap", "pair overlapped vs serial"),
                       ("colocated", "pair", "pair serial vs one GPU")):
        if runs.get(a) and runs.get(b) and runs[a].get("loss_diff_vs", {}).get(b) is not None:
            diff = runs[a]["loss_diff_vs"][b]
            lines.append(f"{what}: max |loss difference| over the steps {diff:.3g}"
                         f"{' (identical)' if diff == 0 else ''}")
    pair, ddp_tps = runs.get("pair-overlap") or runs.get("pair"), (ddp or {}).get("tokens_per_s")
    if pair and pair.get("tokens_per_s") and ddp_tps:
        fits = [v for v in plan["layouts"] if v["layout"] == "colocated"]
        lines.append(f"pair vs colocated on 2 GPUs: {pair['tokens_per_s']:,.0f} vs {ddp_tps:,.0f} tokens/s: "
                     f"{'pair' if pair['tokens_per_s'] > ddp_tps else 'DDP colocated'} is faster here; the planner "
                     f"says colocated {'fits' if fits and fits[0]['fits'] else 'does NOT fit'} one GPU at this shape "
                     f"({fits[0]['note'] if fits else '?'})")
    kill = results.get("kill")
    if kill:
        if "error" in kill:
            lines.append(f"kill -9: {kill['error']}")
        else:
            lines.append(f"kill -9 rank {kill['kill_rank']} after step {kill['killed_after_step']} (checkpoint "
                         f"step {kill['checkpoint_at_kill']}): the other rank exited after {kill['survivor_exit_s']} s, "
                         f"torchrun after {kill['torchrun_exit_s']} s with exit code {kill['torchrun_returncode']}")
            for line in kill["message"][-12:]:
                lines.append(f"    | {line.strip()[:160]}")
            resumed = kill["resumed_run"]
            lines.append(f"--resume: exit {resumed['returncode']}, first step {kill['resumed_first_step']}; steps "
                         f"{kill['compared_steps']} vs the run before the kill: "
                         f"{'identical losses' if kill['losses_equal'] else 'max |diff| ' + str(kill['max_loss_diff'])}"
                         f"; drafter checksums per rank at the end {kill['checksums']}")
    lines.append(f"shards: {results['shard_writer']}; target {shape.target}, {shape.token_budget} tokens a row, "
                 f"{shape.anchors} anchors, {shape.layers} drafter layers (kill test: {shape.kill_layers}), "
                 f"B={shape.block_size}, compile off, log_every=1, tokens/s = median after {shape.warmup} steps")
    lines.append(f"reproduce: {command}")
    return lines
