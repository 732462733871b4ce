"""The optimizer levers: warmup as a share of max_steps, and Muon over the drafter's matrices with
AdamW over the rest (speculators' split), which trains, checkpoints and resumes bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_core.train.assemble import build_trainer
from dflash_core.train.config import OptimSettings
from dflash_core.train.optimizer import Optimizers, muon_split
from tests.unit.test_trainer import tiny_config


def test_warmup_fraction_scales_with_max_steps() -> None:
    assert OptimSettings(warmup_steps=100).resolved_warmup_steps(200) == 100
    assert OptimSettings(warmup_fraction=0.05).resolved_warmup_steps(200) == 10
    assert OptimSettings(warmup_fraction=0.05).resolved_warmup_steps(2000) == 100
    assert OptimSettings(warmup_fraction=0.01).resolved_warmup_steps(20) == 1  # never zero


def test_muon_takes_the_matrices_and_adamw_the_rest(tmp_path) -> None:
    trainer = build_trainer(tiny_config(tmp_path, max_steps=1, drafter={
        "variant": "dflash2", "num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0,
        "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}))
    drafter = trainer.drafter
    matrices, rest = muon_split(drafter)
    names = {id(p): name for name, p in drafter.named_parameters()}
    assert matrices and all(p.ndim == 2 and min(p.shape) > 1 for p in matrices)
    assert {names[id(p)] for p in rest} >= {"candidate_selector.predecessor_codebook", "norm.weight"}
    assert "fc.weight" in {names[id(p)] for p in matrices}
    assert len(matrices) + len(rest) == sum(1 for p in drafter.parameters() if p.requires_grad)
    trainer.close()


def _records(trainer) -> list[dict]:
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_muon_trains_and_resumes_exactly(tmp_path) -> None:
    changes = dict(max_steps=6, checkpoint_every=3, log_every=1, keep_last=3,
                   optim={"optimizer": "muon", "lr": 1e-2, "warmup_fraction": 0.2})
    straight = build_trainer(tiny_config(tmp_path / "a", **changes))
    assert isinstance(straight.optimizer, Optimizers) and len(straight.optimizer.optimizers) == 2
    straight.run()
    expected = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in _records(straight)]
    assert expected[-1]["loss"] < expected[0]["loss"]
    straight.close()
    shutil.rmtree(straight.run_dir / "checkpoints" / "step-000006")
    resumed = build_trainer(tiny_config(tmp_path / "a", **changes))
    assert resumed.resume() and resumed.step == 3
    resumed.run()
    again = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in _records(resumed)[-3:]]
    assert again == expected[-3:]
    for name, tensor in straight.drafter.state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[name], tensor), name
    resumed.close()


def test_a_run_resumes_only_with_its_own_optimizer(tmp_path) -> None:
    first = build_trainer(tiny_config(tmp_path, max_steps=2, checkpoint_every=2))
    first.run()
    first.close()
    muon = build_trainer(tiny_config(tmp_path, max_steps=4, checkpoint_every=2, optim={"optimizer": "muon"}))
    with pytest.raises(ValueError, match="optim.optimizer='adamw'.*resume with the optimizer it started with"):
        muon.resume()
    muon.close()
