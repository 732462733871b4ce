"""The plan says how many times a run goes over its data, and warns when that is enough to memorize it."""

from __future__ import annotations

import pytest

from dflash_core.planner import MANY_DATA_PASSES, PRESETS, PlanInputs, plan


def _plan(**overrides):
    return plan(PlanInputs(target=PRESETS["smollm2-135m"], samples=1024, mean_tokens=284.0, **overrides))


def test_the_acceptance_bench_run_that_memorized_is_warned_about():
    # 2,000 steps of 8 rows x 2,048 tokens over 1,024 completions of ~284 tokens: the bench's 112 passes
    result = _plan(max_steps=2000, tokens_per_step=8 * 2048)
    assert result.data_passes == pytest.approx(2000 * 8 * 2048 / (1024 * 284), rel=1e-3)
    assert 110 < result.data_passes < 115
    assert "about 113 times" in result.data_note and "generate about 6x the samples" in result.data_note


def test_a_run_that_sees_its_data_a_few_times_has_no_warning():
    result = _plan(max_steps=200, tokens_per_step=8 * 2048)  # 11 passes: held-out tau matched training's
    assert result.data_passes < MANY_DATA_PASSES and result.data_note == ""


def test_without_the_steps_there_is_no_figure():
    result = _plan()
    assert result.data_passes is None and result.data_note == ""


def test_the_pipeline_plans_with_its_training_stage_steps():
    from flows.pipeline import demo_pipeline

    params = demo_pipeline()
    inputs = params.plan_inputs()
    config = params.training.config
    assert inputs.max_steps == config.max_steps
    assert inputs.tokens_per_step == config.token_budget * config.optim.grad_accum * params.num_gpus
    assert plan(inputs).data_passes is not None
    # the demo's 2-layer drafter reads the default's 5 target layers, and the plan counts them
    assert (inputs.drafter_layers, inputs.tapped_layers) == (config.drafter.num_layers, 5) == (2, 5)


def test_the_train_stage_plans_with_its_datasets_own_counts():
    from dflash_core.stage_results import TokenizedDataset
    from dflash_core.train.config import TrainConfig
    from flows.train import TrainFlowParams, data_size

    params = TrainFlowParams(config=TrainConfig(run_name="r", target="embedded"), expected_samples=7,
                             expected_mean_tokens=3.0)
    dataset = TokenizedDataset(dataset="d", run="r", train_shards=[], dataset_manifest="s3://b/m",
                               quality_gate="passed", overall={"samples": 1024, "total_tokens": 290_816})
    assert data_size(params, dataset) == (1024, 284.0)
    assert data_size(params, None) == (7, 3.0)  # no dataset: the form's estimates
    assert data_size(params, dataset.model_copy(update={"overall": {}})) == (7, 3.0)
