"""The train flow's fit check (tasks.train.plan_training) plans the run it is given: its drafter
variant, tapped layers, anchors and target precision, and refuses with the planner's advice.

Run: `.venv/bin/python -m pytest tests/unit/test_plan_training.py -q`
"""

from __future__ import annotations

import json

import pytest

from dflash_core.planner import PRESETS
from dflash_core.train.config import TrainConfig
from tasks.train import NoLayoutFits, plan_training


def _config(tmp_path, **drafter) -> TrainConfig:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    shape = PRESETS["qwen3.5-27b"]
    (target / "config.json").write_text(json.dumps({
        "num_hidden_layers": shape.num_layers, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size, "tie_word_embeddings": shape.tie_word_embeddings}))
    return TrainConfig.model_validate({"run_name": "fit", "target": str(target), "data": ["unused.arrow"],
                                       "output_dir": str(tmp_path / "runs"), "drafter": drafter})


def _plan(config, gpu_memory_gib=139.0):
    return plan_training.fn(config, gpu_memory_gib=gpu_memory_gib, num_gpus=1, samples=1000, mean_tokens=2000)


def test_the_plan_follows_the_runs_drafter(tmp_path):
    dflash2 = _plan(_config(tmp_path))
    dflash = _plan(_config(tmp_path, variant="dflash"))
    shape = PRESETS["qwen3.5-27b"]
    # DFlash 2's selector codebooks alone are 2 x vocab x rank
    assert dflash2.drafter_params - dflash.drafter_params > 2 * shape.vocab_size * 256
    three_taps = _plan(_config(tmp_path, num_tapped_layers=3))
    assert three_taps.bytes_per_token == 3 * shape.hidden_size * 2
    assert dflash2.bytes_per_token == 5 * shape.hidden_size * 2  # 5 taps: the default's least
    two_layers = _plan(_config(tmp_path, num_layers=2))
    assert two_layers.bytes_per_token == 5 * shape.hidden_size * 2  # at least 5, not one per drafter layer
    fewer_anchors = _plan(_config(tmp_path, num_anchors=512))
    assert fewer_anchors.drafter_activation_bytes < dflash2.drafter_activation_bytes


def test_a_shallow_target_plans_the_taps_it_can_give(tmp_path):
    """The default's 5 taps spread over native ids 1 .. N-3: a 6-layer target gives 3, which the plan counts."""
    config = _config(tmp_path, num_layers=2)
    path = tmp_path / "target" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_hidden_layers": 6}))
    assert _plan(config).bytes_per_token == 3 * PRESETS["qwen3.5-27b"].hidden_size * 2


def test_a_run_that_does_not_fit_is_refused_with_the_fp8_advice(tmp_path):
    with pytest.raises(NoLayoutFits, match=r"placement colocated: short by .* or set target_fp8: true"):
        _plan(_config(tmp_path), gpu_memory_gib=110.0)
    assert _plan(_config(tmp_path).model_copy(update={"target_fp8": True}), gpu_memory_gib=110.0) is not None


def test_the_check_is_of_the_runs_own_placement(tmp_path):
    colocated = _config(tmp_path)
    # two GPUs: the pair layout fits, the colocated run asked for does not
    with pytest.raises(NoLayoutFits, match=r"placement colocated: short by .*; pair would fit"):
        plan_training.fn(colocated, gpu_memory_gib=110.0, num_gpus=2, samples=1000, mean_tokens=2000)
    pair = colocated.model_copy(update={"placement": "pair"})
    assert plan_training.fn(pair, gpu_memory_gib=110.0, num_gpus=2, samples=1000, mean_tokens=2000) is not None


def test_the_fit_check_plans_the_anchors_the_trainer_samples(tmp_path, monkeypatch) -> None:
    import tasks.train as train_tasks

    planned = []
    real_plan = train_tasks.plan
    monkeypatch.setattr(train_tasks, "plan", lambda inputs: planned.append(inputs) or real_plan(inputs))

    def fit(token_budget, **drafter):
        config = _config(tmp_path, **drafter).model_copy(update={"token_budget": token_budget})
        result = _plan(config)
        anchors_per_row = planned[-1].anchors_per_1k_tokens * token_budget / 1000
        return result, round(anchors_per_row, 6), config.resolved_num_anchors

    small, small_anchors, resolved = fit(512)
    assert small_anchors == resolved == 128  # not 2,048 anchors in a 512-token row
    old_default, _, _ = fit(512, num_anchors=2048)
    assert small.drafter_activation_bytes < old_default.drafter_activation_bytes / 4
    default, default_anchors, _ = fit(8192)
    assert default_anchors == 2048
    assert default.drafter_activation_bytes == fit(8192, num_anchors=2048)[0].drafter_activation_bytes
    assert fit(8192, num_anchors=16)[1] == 16  # explicit wins


def test_each_anchor_costs_the_same_at_an_odd_budget(tmp_path) -> None:
    # 15 anchors in a 12,345-token row reach the planner as 15 * 1000 / 12345 per 1,000 tokens, whose float
    # product with the budget is a hair above 15: planned as 15 anchors, not 16.
    configs = [_config(tmp_path, num_anchors=n).model_copy(update={"token_budget": 12345}) for n in (14, 15, 16)]
    acts = [_plan(config).drafter_activation_bytes for config in configs]
    assert acts[2] - acts[1] == acts[1] - acts[0] > 0
