"""`drafter.num_anchors` left unset follows the token budget (ANCHORS_PER_1024_TOKENS); an explicit value
wins, in the config, in run.yaml and in the anchors the trainer samples per row.

Run: `.venv/bin/python -m pytest tests/unit/test_anchor_budget.py -q`
"""

from __future__ import annotations

import pytest
import yaml

import dflash_core.train.step as step_module
from dflash_core.defaults import ANCHORS_PER_1024_TOKENS
from dflash_core.train.config import TrainConfig
from dflash_core.train.assemble import build_trainer
from tests.train_fixtures import synthetic_shard


def _config(**changes) -> TrainConfig:
    return TrainConfig.model_validate({"target": "tiny:llama", **changes})


@pytest.mark.parametrize(("token_budget", "anchors"), [(512, 128), (2048, 512), (8192, 2048)])
def test_the_default_follows_the_token_budget(token_budget, anchors) -> None:
    config = _config(token_budget=token_budget)
    assert config.drafter.num_anchors is None and config.resolved_num_anchors == anchors
    assert anchors == token_budget * ANCHORS_PER_1024_TOKENS // 1024
    # run.yaml keeps "derive it", so a rerun with another budget derives again
    again = TrainConfig.model_validate(yaml.safe_load(config.to_yaml()))
    assert again.drafter.num_anchors is None and again.resolved_num_anchors == anchors


def test_an_explicit_value_wins_and_survives_run_yaml() -> None:
    # A run.yaml written before the default followed the budget holds num_anchors: 2048 at any budget:
    # its run resumes with 2,048 anchors a row, as it was trained.
    written = _config(token_budget=512, drafter={"num_anchors": 2048}).to_yaml()
    old = TrainConfig.model_validate(yaml.safe_load(written))
    assert old.drafter.num_anchors == 2048 and old.resolved_num_anchors == 2048
    assert _config(token_budget=8192, drafter={"num_anchors": 16}).resolved_num_anchors == 16
    with pytest.raises(ValueError, match="num_anchors"):
        _config(drafter={"num_anchors": 0})


@pytest.mark.parametrize(("drafter", "sampled"), [({}, 96 * ANCHORS_PER_1024_TOKENS // 1024),
                                                  ({"num_anchors": 7}, 7)])
def test_the_trainer_samples_the_resolved_count(tmp_path, monkeypatch, drafter, sampled) -> None:
    shard = synthetic_shard(tmp_path / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    config = TrainConfig.model_validate({
        "run_name": "anchors", "target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path),
        "token_budget": 96, "max_steps": 2, "checkpoint_every": 100, "upload_checkpoints": False,
        "validate_capture_batches": 0,
        "drafter": {"num_layers": 1, "block_size": 4, "loss_gamma": 4.0, **drafter}})
    seen = []
    real_plan_blocks = step_module.plan_blocks

    def recording_plan_blocks(**kwargs):
        plan = real_plan_blocks(**kwargs)
        seen.append(plan.anchors.shape[1])
        return plan

    monkeypatch.setattr(step_module, "plan_blocks", recording_plan_blocks)
    trainer = build_trainer(config)
    trainer.run()
    trainer.close()
    assert seen == [sampled, sampled]  # anchors per row, one plan per step
