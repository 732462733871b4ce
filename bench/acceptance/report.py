"""The acceptance bench's report: runs aggregated over seeds into the ablation table (table.md,
summary.json), each row with the command that reproduces it; results of several runs merge into one
table (`python -m bench.acceptance report RESULTS...`).

Per row: tau (acceptance length: accepted drafts + 1 per round), tau - 1 (accepted drafts per round,
what a drafter adds over target-only decoding) and acc@1..4 (the fraction of rounds accepting at least
k drafts), each as mean +- sd over seeds; the ratio of tau - 1 to speculators' DFlash row and to its
DFlash 2 row at the same steps and data, run on the same AdamW schedule: a row with a schedule lever
(`default+lr=3e-4`) is compared with the speculators rows of that schedule (`speculators+lr=3e-4`)
when they ran, else with the plain ones (the table says which, under "references")."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np

from .variants import FULL, SPECULATORS_OPTIM, row_tokens, steps_text, variants

NUM_ACC = 4  # acc@1..acc@4 in the table
MIN_STEPS_TO_ESTIMATE = 100
REFERENCES = {"speculators": "vs spec. DFlash", "speculators-dflash2": "vs spec. DFlash 2"}  # tau-1 ratios


# ---- the table ----------------------------------------------------------------------------------

def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(results: list[dict], *, variant_order: list[str] | None = None) -> list[dict]:
    """One row per (variant, steps, data multiplier, tokens per step, tapped layers: a variant's default taps
    changed on 2026-12-05, and merged files keep both): tau, tau - 1 and acc@k as mean and sd
    over seeds, the rest averaged; rows by training tokens (steps x tokens per step), then in `variant_order`
    (by name without one), then by data size (runs without a multiplier: None). A seed run twice (merged runs)
    counts once, its first result. Ratios to the speculators rows are taken at the same steps, data and step size."""
    rows = []
    rank = {name: i for i, name in enumerate(variant_order or [])}
    def key(r: dict) -> tuple:
        return r["variant"], r["steps"], r.get("data_multiplier"), row_tokens(r), tuple(r.get("target_layer_ids") or ())

    keys = sorted({key(r) for r in results},
                  key=lambda k: (k[3] * k[1], k[3], rank.get(k[0], len(rank)), k[0], k[2] or 0, k[4]))
    for name, steps, multiplier, tokens, taps in keys:
        by_seed: dict[int, dict] = {}
        for r in results:
            if key(r) == (name, steps, multiplier, tokens, taps):
                by_seed.setdefault(r["seed"], r)
        runs = [by_seed[s] for s in sorted(by_seed)]
        tau_mean, tau_sd = _mean_sd([r["tau"] for r in runs])
        positions = np.array([r["acceptance_per_position"] for r in runs])
        rows.append({
            "variant": name, "steps": steps, "token_budget": tokens, "seeds": sorted(by_seed),
            **({"data_multiplier": multiplier, "train_completions": runs[0].get("train_completions")}
               if multiplier else {}),
            "tau_mean": tau_mean, "tau_sd": tau_sd, "gain_mean": tau_mean - 1, "gain_sd": tau_sd,
            "acceptance_per_position": positions.mean(axis=0).tolist(),
            "acceptance_per_position_sd": (positions.std(axis=0, ddof=1) if len(runs) > 1
                                           else np.zeros(positions.shape[1])).tolist(),
            "tau_sharegpt": _mean(r["tau_by_source"]["sharegpt"] for r in runs),
            "tau_own": _mean(r["tau_by_source"]["own"] for r in runs),
            "train_tau": statistics.fmean(r["train_tau"] for r in runs),
            "steps_per_s": statistics.fmean(r["steps_per_s"] for r in runs),
            **{f"{k}_mean": _mean(r.get(k) for r in runs) for k in ("wall_s", "train_s", "eval_s")},
            "all_match_target": all(r["all_match_target"] for r in runs),
            "mask_token_id": runs[0]["mask_token_id"], "mask_rule": runs[0].get("mask_rule"),
            # rows from before it was recorded trained with the bench's old default, the dense path
            "train_attention": " + ".join(sorted({r.get("train_attention", "sdpa") for r in runs})),
            "target_layer_ids": runs[0].get("target_layer_ids"), "command": runs[0].get("command")})
    for row in rows:
        for reference in REFERENCES:
            ref = None
            for name in (_same_schedule_reference(row["variant"], reference), reference):
                ref = ref or next((r for r in rows if r["variant"] == name and r["steps"] == row["steps"]
                                   and r["token_budget"] == row["token_budget"]
                                   and r.get("data_multiplier") == row.get("data_multiplier")), None)
            row[f"gain_vs_{reference}"] = row["gain_mean"] / ref["gain_mean"] if ref and ref["gain_mean"] > 0 else None
            row[f"reference_{reference}"] = ref["variant"] if ref else None
    return rows


def _same_schedule_reference(variant: str, reference: str) -> str | None:
    """The plain `reference` row's variant on `variant`'s AdamW schedule (e.g. speculators+lr=3e-4 for
    default+lr=3e-4); None when `variant` keeps the default schedule, changes more than the shared
    schedule, or no such reference variant exists."""
    known = variants()
    row_variant, base = known.get(variant), known.get(reference)
    if row_variant is None or base is None or not row_variant.optim:
        return None
    if set(row_variant.optim) - SPECULATORS_OPTIM:
        return None
    return next((v.name for v in known.values() if v.kind == base.kind and v.mask == base.mask
                 and v.drafter == base.drafter and v.optim == row_variant.optim), None)


def host_text(result: dict) -> str:
    """"; host ms/step: prepare 0.4, dispatch 30.1, wait 2.0 (41 graphs)" for a row of ours (its main thread's
    time per step after compilation), "" for a row without it (speculators' own loop, older rows)."""
    if "host_dispatch_ms" not in result:
        return ""
    return (f"; host ms/step: prepare {result['host_prepare_ms']:.1f}, dispatch {result['host_dispatch_ms']:.1f}, "
            f"wait {result['host_wait_ms']:.1f} ({result['compiled_graphs']} graphs)")


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def table(rows: list[dict], *, command: str) -> str:
    """The markdown table; a row reproduces with the command its runs recorded, else `command`."""
    acc_head = " | ".join(f"acc@{k}" for k in range(1, NUM_ACC + 1))
    scaled = any(r.get("data_multiplier") for r in rows)  # a data column only in a data-scaling table
    lines = [f"| variant | steps |{' data |' if scaled else ''} n | tau | tau-1 | {acc_head} | "
             f"{' | '.join(REFERENCES.values())} | "
             "sharegpt / own tau | train tau | steps/s | attention | train / eval s | exact | mask | taps | reproduce |",
             "|---|---:|" + ("---:|" if scaled else "") + "---:|---|---|" + "---|" * NUM_ACC + "---:|" * len(REFERENCES)
             + "---|---:|---:|---|---|---|---|---|---|"]
    for r in rows:
        accept = " | ".join(f"{m:.3f} +- {s:.3f}" for m, s in zip(r["acceptance_per_position"][:NUM_ACC],
                                                                  r["acceptance_per_position_sd"][:NUM_ACC]))
        accept += " | -" * (NUM_ACC - min(NUM_ACC, len(r["acceptance_per_position"])))
        ratios = " | ".join("-" if r[f"gain_vs_{ref}"] is None else f"{r[f'gain_vs_{ref}']:.3f}x" for ref in REFERENCES)
        split = " / ".join("-" if v is None else f"{v:.3f}" for v in (r["tau_sharegpt"], r["tau_own"]))
        seconds = " / ".join("-" if r[k] is None else f"{r[k]:.0f}" for k in ("train_s_mean", "eval_s_mean"))
        seeds = " ".join(str(s) for s in r["seeds"])
        mask = f"{r['mask_token_id']}" + (f" ({r['mask_rule']})" if r.get("mask_rule") else "")
        multiplier = r.get("data_multiplier")
        row_flags = "" if r["token_budget"] == FULL.token_budget else f" --token-budget {r['token_budget']}"
        reproduce = (f"`{r.get('command') or command} --variants {r['variant']} --seeds {seeds} "
                     f"--steps {r['steps']}{row_flags} --long-multiplier 0"
                     + (f" --data-multipliers {multiplier}`" if multiplier else "`"))
        data = f" {multiplier}x ({r.get('train_completions') or 0:,}) |" if multiplier else (" - |" if scaled else "")
        steps = steps_text(r["steps"], r["token_budget"])
        lines.append(f"| {r['variant']} | {steps} |{data} {len(r['seeds'])} | {r['tau_mean']:.3f} +- {r['tau_sd']:.3f} "
                     f"| {r['gain_mean']:.3f} +- {r['gain_sd']:.3f} | {accept} | {ratios} | {split} | "
                     f"{r['train_tau']:.2f} | {r['steps_per_s']:.1f} | {r['train_attention']} | {seconds} | "
                     f"{'yes' if r['all_match_target'] else 'NO'} | {mask} | {r['target_layer_ids']} | {reproduce} |")
    matched = sorted({r["variant"] for r in rows
                      if any(r.get(f"reference_{ref}") not in (None, ref) for ref in REFERENCES)})
    if matched:
        lines += ["", "references: these rows' ratios are to the speculators rows of their own AdamW "
                  "schedule, the others' to the plain speculators rows: " + ", ".join(matched)]
    return "\n".join(lines)


def wall_estimate(rows: list[dict], *, steps: int) -> str:
    """Per row, the wall time one job of `steps` steps would take under the same sharing of the device
    (its measured overhead + steps / its steps/s): what the next run takes. Rows of fewer than
    `MIN_STEPS_TO_ESTIMATE` steps have no steady rate to go by."""
    lines = []
    for r in rows:
        if r["wall_s_mean"] is None or r["train_s_mean"] is None or r["steps_per_s"] <= 0 \
                or r["steps"] < MIN_STEPS_TO_ESTIMATE:
            continue
        overhead = r["wall_s_mean"] - r["train_s_mean"]  # setup + evaluation
        size = f" {r['data_multiplier']}x data" if r.get("data_multiplier") else ""
        lines.append(f"- {r['variant']}{size} (measured at {r['steps']} steps): ~{overhead + steps / r['steps_per_s']:.0f} s "
                     f"a job at {steps} steps ({overhead:.0f} s setup + evaluation, {r['steps_per_s']:.1f} steps/s)")
    return "\n".join(lines)


# Flags a table row's own command sets (or that only say where output goes).
_ROW_FLAGS = {"--variants", "--suite", "--seeds", "--steps", "--token-budget", "--long-multiplier", "--long-variants",
              "--long-seeds", "--out", "--work", "--deadline-s", "--workers", "--devices", "--results",
              "--data-multipliers"}


def row_command(argv: list[str]) -> str:
    """The command a row reproduces with: this run's flags minus those the row sets itself."""
    kept, skip = [], False
    for item in argv:
        if item.startswith("--"):
            skip = item.split("=")[0] in _ROW_FLAGS
        if not skip and item not in ("run", "report"):
            kept.append(item)
    return " ".join(["python -m bench.acceptance", *kept])


def write_report(out: Path, results: list[dict], *, header: str, variant_order: list[str],
                 extra: dict | None = None) -> str:
    """table.md and summary.json from the runs so far (rewritten after each run: a run cut short by
    its time limit still leaves a table)."""
    rows = aggregate(results, variant_order=variant_order)
    text = table(rows, command=row_command(sys.argv[1:]))
    estimates = {s: wall_estimate([r for r in rows if r["steps"] < s], steps=s) for s in (2000,)}
    plan = "".join(f"\n\nEstimated wall per job at {s} steps, same sharing:\n{e}" for s, e in estimates.items() if e)
    if any(r.get("data_multiplier") for r in rows):
        from .scaling import write_scaling

        plan += "\n\n" + write_scaling(out, rows)
    (out / "table.md").write_text(header + "\n\n" + text + plan + "\n")
    (out / "summary.json").write_text(json.dumps({**(extra or {}), "rows": rows, "argv": sys.argv[1:]}, indent=1))
    return header + "\n\n" + text + plan


def run_header(*, shape, args, num_records: int, num_eval: int, elapsed_s: float) -> str:
    """What the rows were measured on. `shape`: the bench's Shape dataclass."""
    return (f"target SmolLM2-135M-Instruct (embedded); drafter {shape.num_layers} layers, B={shape.block_size}, "
            f"{shape.num_anchors} anchors per {shape.token_budget}-token row unless the row says otherwise; "
            f"{num_records} training completions; {num_eval} held-out prompts x {shape.eval_new_tokens} new tokens; "
            f"eval {args.eval_dtype} on {args.device}; {elapsed_s:.0f} s")
