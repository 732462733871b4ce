"""bench_acceptance's report: runs aggregated over seeds into the ablation table (table.md,
summary.json), each row with the command that reproduces it."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import numpy as np

# ---- the table ----------------------------------------------------------------------------------

def aggregate(results: list[dict], *, variant_order: list[str] | None = None) -> list[dict]:
    """One row per (variant, steps): tau mean and sd over seeds, per-position acceptance, the rest
    averaged; rows by steps, then in `variant_order` (by name without one)."""
    rows = []
    rank = {name: i for i, name in enumerate(variant_order or [])}
    keys = sorted({(r["variant"], r["steps"]) for r in results},
                  key=lambda k: (k[1], rank.get(k[0], len(rank)), k[0]))
    for name, steps in keys:
        runs = [r for r in results if r["variant"] == name and r["steps"] == steps]
        taus = [r["tau"] for r in runs]
        positions = np.mean([r["acceptance_per_position"] for r in runs], axis=0).tolist()
        rows.append({"variant": name, "steps": steps, "seeds": sorted(r["seed"] for r in runs),
                     "tau_mean": statistics.fmean(taus), "tau_sd": statistics.stdev(taus) if len(taus) > 1 else 0.0,
                     "acceptance_per_position": positions,
                     "tau_sharegpt": _mean(r["tau_by_source"]["sharegpt"] for r in runs),
                     "tau_own": _mean(r["tau_by_source"]["own"] for r in runs),
                     "train_tau": statistics.fmean(r["train_tau"] for r in runs),
                     "steps_per_s": statistics.fmean(r["steps_per_s"] for r in runs),
                     "all_match_target": all(r["all_match_target"] for r in runs),
                     "mask_token_id": runs[0]["mask_token_id"], "target_layer_ids": runs[0]["target_layer_ids"]})
    return rows


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def table(rows: list[dict], *, command: str) -> str:
    reference = {r["steps"]: r["tau_mean"] for r in rows if r["variant"] == "speculators"}
    lines = ["| variant | steps | tau mean +- sd | vs speculators | acc@1 acc@2 acc@3 acc@4 | sharegpt / own tau | "
             "train tau | steps/s | exact | mask | taps | reproduce |",
             "|---|---:|---|---:|---|---|---:|---:|---|---:|---|---|"]
    for r in rows:
        ratio = f"{r['tau_mean'] / reference[r['steps']]:.2f}x" if reference.get(r["steps"]) else "-"
        accept = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:4])
        split = " / ".join("-" if v is None else f"{v:.2f}" for v in (r["tau_sharegpt"], r["tau_own"]))
        seeds = " ".join(str(s) for s in r["seeds"])
        reproduce = f"`{command} --variants {r['variant']} --seeds {seeds} --steps {r['steps']} --long-multiplier 0`"
        lines.append(f"| {r['variant']} | {r['steps']} | {r['tau_mean']:.3f} +- {r['tau_sd']:.3f} (n={len(r['seeds'])}) | "
                     f"{ratio} | {accept} | {split} | {r['train_tau']:.2f} | {r['steps_per_s']:.1f} | "
                     f"{'yes' if r['all_match_target'] else 'NO'} | {r['mask_token_id']} | {r['target_layer_ids']} | "
                     f"{reproduce} |")
    return "\n".join(lines)


# Flags a table row's own command sets (or that only say where output goes).
_ROW_FLAGS = {"--variants", "--seeds", "--steps", "--long-multiplier", "--long-variants", "--long-seeds", "--out",
              "--work", "--deadline-s", "--workers"}


def row_command(argv: list[str]) -> str:
    """The command a row reproduces with: this run's flags minus those the row sets itself."""
    kept, skip = [], False
    for item in argv:
        if item.startswith("--"):
            skip = item.split("=")[0] in _ROW_FLAGS
        if not skip and item != "run":
            kept.append(item)
    return " ".join(["python bench/bench_acceptance.py", *kept])


def write_report(out: Path, results: list[dict], *, shape, args, num_records: int, num_eval: int,
                 elapsed_s: float, variant_order: list[str]) -> str:
    """table.md and summary.json from the runs so far (rewritten after each run: a run cut short by
    its time limit still leaves a table). `shape`: the bench's Shape dataclass."""
    rows = aggregate(results, variant_order=variant_order)
    text = table(rows, command=row_command(sys.argv[1:]))
    header = (f"target SmolLM2-135M-Instruct (embedded); drafter {shape.num_layers} layers, B={shape.block_size}, "
              f"{shape.num_anchors} anchors per {shape.token_budget}-token row; {num_records} training completions; "
              f"{num_eval} held-out prompts x {shape.eval_new_tokens} new tokens; eval {args.eval_dtype} on "
              f"{args.device}; {elapsed_s:.0f} s")
    (out / "table.md").write_text(header + "\n\n" + text + "\n")
    (out / "summary.json").write_text(json.dumps({"shape": dataclasses.asdict(shape), "rows": rows,
                                                  "argv": sys.argv[1:]}, indent=1))
    return header + "\n\n" + text
