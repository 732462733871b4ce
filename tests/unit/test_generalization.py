"""Held-out acceptance against the training acceptance: the rule, how a run's data passes are counted,
and where a user reads it (the pipeline's summary)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.console import Console

from dflash_core.evaluate.generalization import MIN_TRAIN_GAIN, OVERFIT_GAP, generalization
from dflash_core.run_summary import drafter_table, summary_markdown
from dflash_core.train.data import PackedBatchSampler, data_passes


@pytest.mark.parametrize(("train_tau", "heldout_tau", "passes", "overfit"), [
    (4.08, 1.556, 112.0, True),   # the bench: 2,000 steps over 1,024 completions
    (2.39, 1.668, 28.0, True),    # 2,000 steps over 4,096: still a gap of 2.1
    (1.30, 1.281, 11.0, False),   # 200 steps over 1,024
    (1.0, 1.0, 1.0, False),       # nothing accepted anywhere: no gap
    (1.06, 1.02, 3.0, False),     # a gap of 3 at the floor (a short demo run) is noise
])
def test_the_rule_on_the_measured_runs(train_tau, heldout_tau, passes, overfit):
    fit = generalization(train_tau=train_tau, heldout_tau=heldout_tau, data_passes=passes)
    assert fit["overfit"] is overfit
    if fit["gap"] is not None and train_tau - 1 >= MIN_TRAIN_GAIN:
        assert (fit["gap"] >= OVERFIT_GAP) is overfit
    assert bool(fit["advice"]) is overfit
    if overfit:
        assert f"{passes:.0f} passes" in fit["advice"] and "more completions" in fit["advice"]


def test_nothing_held_out_accepted_has_no_ratio_and_no_training_tau_is_no_verdict():
    fit = generalization(train_tau=1.5, heldout_tau=1.0, data_passes=None)
    assert fit["gap"] is None and fit["overfit"]  # half a draft a round on training data, none held out
    assert "none accepted held out" in summary_markdown(_result(fit), [])
    assert generalization(train_tau=None, heldout_tau=1.4, data_passes=3.0) is None


def test_data_passes_count_whole_epochs_and_the_share_of_the_next():
    lengths = np.full(64, 100)
    sampler = PackedBatchSampler(lengths, token_budget=400, seed=0)
    per_epoch = len(sampler)
    assert per_epoch == 16
    batches = iter(sampler)
    for _ in range(per_epoch * 2 + 4):
        next(batches)
    assert data_passes(sampler.state_dict(), batches_per_epoch=per_epoch) == pytest.approx(2.25)


def _result(fit):
    return {"evaluation": {"split": "heldout", "generalization": fit,
                           "summaries": [{"mode": "block", "num_responses": 4, "tau": fit["heldout_tau"]}]}}


def test_the_summary_says_overfit_and_what_to_do():
    fit = generalization(train_tau=4.08, heldout_tau=1.556, data_passes=112.0)
    markdown = summary_markdown(_result(fit), [])
    assert "training tau 4.080 vs held-out 1.556 after 112 passes over the data" in markdown
    assert "OVERFIT" in markdown and "Generate more completions" in markdown
    console = Console(file=io.StringIO(), width=400)
    console.print(drafter_table(_result(fit)))
    assert "OVERFIT" in console.file.getvalue()


def test_the_summary_of_a_drafter_that_generalizes_has_no_warning():
    fit = generalization(train_tau=1.30, heldout_tau=1.281, data_passes=11.0)
    markdown = summary_markdown(_result(fit), [])
    assert "training tau 1.300 vs held-out 1.281" in markdown and "OVERFIT" not in markdown
