"""The acceptance curve: does our recipe's lead hold as data and steps grow? tau - 1 of the three recipes (our
default, speculators' DFlash, speculators' DFlash 2) against training tokens, each recipe at its best learning
rate at every point (completions, steps x tokens per step), merged from any acceptance result files (several
runs and machines: a seed run twice counts once, its first result).

    python -m bench.acceptance curve RESULTS.jsonl [...] --out DIR

writes DIR/curve.md (the table: point, recipe, lr, seeds, tau, tau - 1 +- sd, acc@1..4, ratio of our
recipes' tau - 1 to each speculators recipe, both at their best lr, and whether every decoded output equalled
greedy decoding) and DIR/curve.png (tau - 1 against training tokens, log x, one line per recipe and step size
through the curve's points). Rows of other variants are left out; rows from before the data-scaling runs (no
data multiplier) trained on the 1x set of 1,024 completions, rows from before `token_budget` was recorded on
2,048-token steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .report import NUM_ACC, aggregate
from .variants import FULL, steps_text

RECIPES = {"default": "ours (default)", "default-2-taps": "ours, 2 taps (the default until 2026-12-05)",
           "speculators": "speculators DFlash", "speculators-dflash2": "speculators DFlash 2"}
OURS = ("default", "default-2-taps")  # the rows that carry ratios to the speculators recipes
LIBRARY_LR = 6e-4  # rows without "+lr=": TrainConfig's default, which speculators' rows share in the bench
# The curve's lines run through these (completions, training tokens): the first measured point and the three
# planned larger ones (the largest as far as the prompt pool goes), in any step size (steps x 2,048 tokens, or a quarter of the
# steps x 8,192); other points are in the table only.
CURVE_POINTS = tuple((completions, steps * FULL.token_budget) for completions, steps in
                     ((1024, 200), (4096, 2000), (16384, 8000), (32768, 20000), (46592, 20000)))


def recipe_and_lr(variant: str) -> tuple[str, float] | None:
    """("speculators", 3e-4) for "speculators+lr=3e-4"; None for a variant that changes more than the lr."""
    recipe, _, rest = variant.partition("+")
    if recipe not in RECIPES:
        return None
    if not rest:
        return recipe, LIBRARY_LR
    key, _, value = rest.partition("=")
    if key != "lr" or "+" in value:
        return None
    try:
        return recipe, float(value)
    except ValueError:
        return None


def recipe_variant(row: dict) -> str:
    """The row's variant as the curve names its recipe: our default read 2 taps on the bench's 2-layer drafter
    until 2026-12-05 and reads 5 since (DrafterSettings.num_tapped_layers), so a `default` row of 2 taps is
    `default-2-taps` and a `default+taps=5` row (the ablation's) is `default`."""
    base, *levers = row.get("variant", "").split("+")
    if base != "default":
        return row.get("variant", "")
    if len(row.get("target_layer_ids") or [1, 27]) == 2:
        base = "default-2-taps"
    return "+".join([base, *(lever for lever in levers if lever not in ("taps=2", "taps=5"))])


def lr_text(lr: float) -> str:
    """6e-4, 1.2e-3: as the variants spell them."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def load(paths: list[Path]) -> list[dict]:
    """The result rows of the three recipes in `paths`, each with its data size filled in."""
    rows = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise SystemExit(f"{path}:{number}: not a JSON result row ({error.msg})") from None
            row = {**row, "variant": recipe_variant(row)}
            if recipe_and_lr(row["variant"]) is None:
                continue
            if not row.get("data_multiplier"):
                row = {**row, "data_multiplier": 1, "train_completions": FULL.train_prompts}
            rows.append(row)
    return rows


def curve_rows(results: list[dict]) -> list[dict]:
    """aggregate()'s rows (mean and sd over seeds) with recipe, lr, training tokens (steps x the row's tokens per
    step) and point (completions, training tokens); within a point, step size and recipe the best lr (highest
    mean tau) is marked `best`, and each of our recipes' best row carries its ratio of tau - 1 to each speculators
    recipe's best row of the same step size (4x the batch is a quarter of the optimizer steps: a recipe's best lr
    may move, so step sizes are not mixed)."""
    rows = []
    for row in aggregate(results):
        recipe, lr = recipe_and_lr(row["variant"])
        tokens = row["steps"] * row["token_budget"]
        rows.append({**row, "recipe": recipe, "lr": lr, "point": (row["train_completions"], tokens),
                     "training_tokens": tokens, "best": False, "ratios": {}})
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["point"], row["token_budget"], row["recipe"])
        if key not in best or row["gain_mean"] > best[key]["gain_mean"]:
            best[key] = row
    for row in best.values():
        row["best"] = True
    for (point, size, recipe), row in best.items():
        if recipe in OURS:
            row["ratios"] = {other: row["gain_mean"] / best[(point, size, other)]["gain_mean"]
                             for other in RECIPES if other not in OURS and (point, size, other) in best
                             and best[(point, size, other)]["gain_mean"] > 0}
    order = list(RECIPES)
    return sorted(rows, key=lambda r: (r["training_tokens"], r["train_completions"], r["token_budget"],
                                       order.index(r["recipe"]), r["lr"]))


def curve_table(rows: list[dict]) -> str:
    accs = " | ".join(f"acc@{k}" for k in range(1, NUM_ACC + 1))
    lines = ["| completions | steps | training tokens | recipe | lr | seeds | tau | tau - 1 +- sd | "
             f"{accs} | ours / spec. DFlash | ours / spec. DFlash 2 | outputs = greedy |",
             "|---:|---:|---:|---|---:|---|---:|---:|" + "---:|" * NUM_ACC + "---:|---:|---|"]
    for r in rows:
        mark = "**" if r["best"] else ""
        ratios = [f"**{r['ratios'][o]:.2f}x**" if o in r["ratios"] else "" for o in ("speculators",
                                                                                     "speculators-dflash2")]
        accept = " | ".join(f"{a:.3f}" for a in r["acceptance_per_position"][:NUM_ACC])
        on_curve = "" if r["point"] in CURVE_POINTS else " (off the curve)"
        steps = steps_text(r["steps"], r["token_budget"]).replace(f"{r['steps']}", f"{r['steps']:,}", 1)
        lines.append(f"| {r['train_completions']:,} | {steps}{on_curve} | {r['training_tokens'] / 1e6:.2f}M | "
                     f"{mark}{RECIPES[r['recipe']]}{mark} | {lr_text(r['lr'])} | {', '.join(map(str, r['seeds']))} | "
                     f"{r['tau_mean']:.3f} | {mark}{r['gain_mean']:.3f} +- {r['gain_sd']:.3f}{mark} | {accept} | "
                     f"{' | '.join(ratios)} | {'yes' if r['all_match_target'] else 'NO'} |")
    return ("Each recipe's best learning rate at a point (and step size) in bold; ratios: our recipe's tau - 1 "
            "over the speculators recipe's, each at its best lr, on the same step size. Steps are of 2,048-token "
            "rows unless they say otherwise. Our default reads 5 target layers since 2026-12-05 (2 before, on the bench's "
            "2-layer drafter: its own rows).\n\n" + "\n".join(lines))


def plot_curve(path: Path, rows: list[dict]) -> bool:
    """tau - 1 against training tokens (log x), one line per recipe and step size at its best lr through
    CURVE_POINTS, sd bars; False when matplotlib is missing (the GPU image): run this module again where it is."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    ticks: dict[int, str] = {}
    sizes = sorted({r["token_budget"] for r in rows})
    colors = {recipe: f"C{i}" for i, recipe in enumerate(RECIPES)}  # a recipe keeps its color at every step size
    for (recipe, label), size in ((item, size) for size in sizes for item in RECIPES.items()):
        points = sorted((r for r in rows if r["best"] and r["recipe"] == recipe and r["token_budget"] == size
                         and r["point"] in CURVE_POINTS), key=lambda r: r["training_tokens"])
        if not points:
            continue
        full = size == FULL.token_budget
        shift = 1.0 if full else 1.04  # beside the 2,048-token point of the same tokens, not on top of it
        axis.errorbar([p["training_tokens"] * shift for p in points], [p["gain_mean"] for p in points],
                      yerr=[p["gain_sd"] for p in points], marker="o" if full else "s", capsize=3,
                      color=colors[recipe], linestyle="-" if full else "--", markerfacecolor=None if full else "white",
                      label=label if full else f"{label}, {size:,}-token steps")
        ticks.update({p["training_tokens"]: f"{p['training_tokens'] / 1e6:.1f}M\n"
                                            f"{p['train_completions']:,} compl." for p in points})
    axis.set_xscale("log")
    axis.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)], fontsize=7)
    axis.minorticks_off()
    axis.set(xlabel="training tokens (steps x tokens per step)", ylabel="tau - 1 (accepted drafts per round)",
             title="held-out acceptance as data and steps grow (embedded SmolLM2)")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m bench.acceptance curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="acceptance result files (.jsonl)")
    parser.add_argument("--out", type=Path, required=True, help="where curve.md and curve.png go")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        raise SystemExit(f"no such result file: {', '.join(missing)}")
    rows = curve_rows(load(args.results))
    if not rows:
        raise SystemExit(f"none of {len(args.results)} files holds a row of {', '.join(RECIPES)} (alone or +lr=X)")
    args.out.mkdir(parents=True, exist_ok=True)
    text = curve_table(rows)
    drawn = plot_curve(args.out / "curve.png", rows)
    command = "python -m bench.acceptance curve " + " ".join(map(str, args.results)) + f" --out {args.out}"
    text += "\n\n" + ("![tau - 1 against training tokens](curve.png)" if drawn else
                      "(no matplotlib here: run the command again where it is installed to draw curve.png)")
    text += f"\n\nCommand: `{command}`\n"
    (args.out / "curve.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
