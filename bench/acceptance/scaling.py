"""The acceptance bench's data-scaling curve: the same rows and steps trained on 1x, 2x,
4x, ... the training completions (`--data-multipliers 1 2 4 8`; 1x = Shape.train_prompts). A job at
multiplier m trains on the first m x train_prompts completions, so a bigger set holds the smaller
ones. The report adds, per (variant, steps), tau and tau - 1 per data size, the first size where tau
reaches 1.5 and 2, and scaling.png: tau - 1 against completions (log2 axis), one line per row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .variants import Job, steps_text

TAU_THRESHOLDS = (1.5, 2.0)


@dataclasses.dataclass(frozen=True)
class ScaledJob(Job):
    """A job trained on the first `data_multiplier` x train_prompts completions."""

    data_multiplier: int = 1

    @property
    def label(self) -> str:
        return f"{self.variant}@{self.steps}s{self.seed}x{self.data_multiplier}data"


def plan_scaled_jobs(names: list[str], seeds: list[int], steps: int, multipliers: list[int], *,
                     long_jobs: list[tuple[str, int, int]] = ()) -> list[ScaledJob]:
    """rows x multipliers x seeds; long jobs (name, seed, steps) first at every multiplier, then
    seed-major, the largest data first in a seed (a deadline keeps the curve's ends for the first seeds)."""
    sizes = sorted(set(multipliers), reverse=True)
    jobs = [ScaledJob(name, seed, long_steps, m) for name, seed, long_steps in long_jobs for m in sizes]
    return jobs + [ScaledJob(name, seed, steps, m) for seed in seeds for m in sizes for name in names]


def cap_multipliers(multipliers: list[int], *, available: int, base: int, log=print) -> list[int]:
    """The multipliers the pool allows: those above `available // base` become that largest one (logged)."""
    if any(m < 1 for m in multipliers):
        raise SystemExit(f"--data-multipliers must be >= 1, got {multipliers}")
    largest = available // base
    if max(multipliers) <= largest:
        return sorted(set(multipliers))
    log(f"DATA POOL TOO SMALL: {available:,} training prompts of at most the prompt length, {max(multipliers)}x "
        f"needs {max(multipliers) * base:,}; the largest data size is {largest}x ({largest * base:,} completions)")
    return sorted({min(m, largest) for m in multipliers})


# ---- the report ---------------------------------------------------------------------------------

def curves(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(variant, steps as the table writes them: `2000` or `500 x 8,192 tokens`) -> its aggregated rows with a
    data multiplier, by growing data size."""
    out: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row.get("data_multiplier"):
            out.setdefault((row["variant"], steps_text(row["steps"], row["token_budget"])), []).append(row)
    return {key: sorted(points, key=lambda r: r["data_multiplier"]) for key, points in out.items()}


def first_reaching(points: list[dict], tau: float) -> dict | None:
    """The smallest data size whose mean tau reaches `tau`, or None."""
    return next((p for p in points if p["tau_mean"] >= tau), None)


def scaling_table(rows: list[dict]) -> str:
    sizes = sorted({r["data_multiplier"] for points in curves(rows).values() for r in points})
    reach = " | ".join(f"tau {t} at" for t in TAU_THRESHOLDS)
    lines = [f"| variant | steps | {' | '.join(f'{m}x' for m in sizes)} | {reach} |",
             "|---|---:|" + "---|" * len(sizes) + "---|" * len(TAU_THRESHOLDS)]
    for (variant, steps), points in curves(rows).items():
        by_size = {p["data_multiplier"]: p for p in points}
        cells = [f"{by_size[m]['tau_mean']:.3f} / {by_size[m]['gain_mean']:.3f} (n {len(by_size[m]['seeds'])})"
                 if m in by_size else "-" for m in sizes]
        hits = [first_reaching(points, t) for t in TAU_THRESHOLDS]
        cells += [f"{h['data_multiplier']}x ({h['train_completions']:,})" if h else "not reached" for h in hits]
        lines.append(f"| {variant} | {steps} | {' | '.join(cells)} |")
    return "Data scaling (tau / tau-1 per data size, mean over seeds; columns: multiples of 1x):\n\n" + \
        "\n".join(lines)


def plot_scaling(path: Path, rows: list[dict]) -> bool:
    """tau - 1 against training completions (log2 x axis), one line per (variant, steps), sd bars;
    False when matplotlib is missing (a bare GPU image): `python -m bench.acceptance report` redraws it."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    sizes: set[int] = set()
    for (variant, steps), points in curves(rows).items():
        x = [p["train_completions"] for p in points]
        sizes.update(x)
        axis.errorbar(x, [p["gain_mean"] for p in points], yerr=[p["gain_sd"] for p in points], marker="o",
                      capsize=3, label=f"{variant} (steps {steps})")
    for tau in TAU_THRESHOLDS:
        axis.axhline(tau - 1, color="grey", linestyle=":", linewidth=1)
        axis.annotate(f"tau {tau}", (0.01, tau - 1), xycoords=("axes fraction", "data"), fontsize=7, color="grey",
                      va="bottom")
    axis.set_xscale("log", base=2)
    axis.set_xticks(sorted(sizes), [f"{s:,}" for s in sorted(sizes)])
    axis.set(xlabel="training completions", ylabel="tau - 1 (accepted drafts per round)",
             title="acceptance vs training data (same steps)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def write_scaling(out: Path, rows: list[dict]) -> str:
    """scaling.md and scaling.png in `out`; the markdown, to end table.md with."""
    text = scaling_table(rows)
    drawn = plot_scaling(out / "scaling.png", rows)
    text += "\n\n" + ("![tau - 1 vs training completions](scaling.png)" if drawn else
                      "(no matplotlib here: draw scaling.png with `python -m bench.acceptance report "
                      "results.jsonl --out DIR`)")
    (out / "scaling.md").write_text(text + "\n")
    return text
