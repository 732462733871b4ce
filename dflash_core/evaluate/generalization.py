"""Does the drafter draft held-out prompts about as well as its training data? A drafter that has gone
over its completions many times can draft them far better than new prompts: it memorized them, and
more completions, not more steps, is what helps then.

Training tau is the expected acceptance length on the last training batches (teacher-forced, from
`metrics.jsonl`); held-out tau is measured in real draft/verify rounds. The gap is their ratio in
accepted drafts per round (tau - 1), what a drafter adds. On the embedded target (docs/benchmarks.md,
"Acceptance against training data"), 2,000 steps over 1,024 completions (112 passes) reached training
tau 4.08 against 1.556 held out (a gap of 5.5); over 4,096 completions (28 passes) 2.39 against 1.668
(2.1), held-out tau - 1 up by a fifth; 200 steps over 1,024 (11 passes) 1.30 against 1.281 (1.07).
"""

from __future__ import annotations

from typing import Any

OVERFIT_GAP = 2.0  # training tau - 1 at least this many times held-out tau - 1: memorizing, not drafting
MIN_TRAIN_GAIN = 0.1  # below this many accepted drafts per round on training data, a gap is noise at the floor


def generalization(*, train_tau: float | None, heldout_tau: float, data_passes: float | None) -> dict[str, Any] | None:
    """The comparison for the evaluation's result and summary; None without a training tau to compare.

    {"train_tau", "heldout_tau", "data_passes", "gap", "overfit", "advice"}: `gap` is (train_tau - 1) /
    (heldout_tau - 1) (None when nothing held out is accepted), `advice` what to do (empty when not overfit).
    """
    if train_tau is None:
        return None
    train_gain, heldout_gain = max(train_tau - 1.0, 0.0), max(heldout_tau - 1.0, 0.0)
    gap = train_gain / heldout_gain if heldout_gain > 0 else None
    overfit = train_gain >= max(OVERFIT_GAP * heldout_gain, MIN_TRAIN_GAIN)
    passes = f" after {data_passes:.0f} passes over its data" if data_passes is not None else ""
    advice = (
        f"the drafter drafts its training data far better than held-out prompts (training tau {train_tau:.2f}, "
        f"held out {heldout_tau:.2f}){passes}: it is memorizing its completions. Generate more completions "
        "(more prompts in the generate stage) before training longer; on the embedded target 4x the completions "
        "at 2,000 steps raised held-out tau - 1 by a fifth (docs/benchmarks.md)"
    ) if overfit else ""
    return {"train_tau": train_tau, "heldout_tau": heldout_tau, "data_passes": data_passes,
            "gap": gap, "overfit": overfit, "advice": advice}
