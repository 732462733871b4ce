"""The pair layout's overlapped steps (the next batch captured before the drafter trains on this one)
are exact: the same losses and weights as the plain loop, and a checkpoint taken with a batch in
flight resumes to the same losses. On CPU both devices are the CPU; the order of work is the GPU's.

Run: `.venv/bin/python -m pytest tests/unit/test_pair_overlap.py -q`
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_core.train.assemble import build_trainer
from tests.unit.test_trainer import tiny_config


def pair_config(tmp_path, **changes):
    return tiny_config(tmp_path, placement="pair", target_device="cpu", drafter_device="cpu", log_every=1,
                       max_steps=6, checkpoint_every=3, keep_last=5, **changes)


def _records(trainer) -> list[dict]:
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "transfer_ms")} for r in records]


@pytest.mark.parametrize(("grad_accum", "loss_target"), [(1, "data"), (2, "teacher")])
def test_overlapped_steps_equal_the_plain_loop(tmp_path, grad_accum, loss_target) -> None:
    changes = {"optim": {"lr": 1e-2, "warmup_steps": 5, "grad_accum": grad_accum},
               "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0,
                           "loss_target": loss_target}}
    plain = build_trainer(pair_config(tmp_path / "plain", **changes))
    plain.run()
    overlapped = build_trainer(pair_config(tmp_path / "overlapped", pair_overlap=True, **changes))
    overlapped.run()
    assert _without_timing(_records(overlapped)) == _without_timing(_records(plain))
    for name, tensor in plain.drafter.state_dict().items():
        assert torch.equal(overlapped.drafter.state_dict()[name], tensor), name


def test_checkpoint_with_a_batch_in_flight_resumes_exactly(tmp_path) -> None:
    straight = build_trainer(pair_config(tmp_path, pair_overlap=True))
    straight.run()
    expected = _without_timing(_records(straight))
    checkpoints = straight.run_dir / "checkpoints"
    plain_state = torch.load(checkpoints / "step-000003" / "train_state.pt", weights_only=False)["sampler"]
    assert plain_state["batch_in_epoch"] == 3  # the batch drawn ahead is not counted as trained
    shutil.rmtree(checkpoints / "step-000006")
    resumed = build_trainer(pair_config(tmp_path, pair_overlap=True))
    assert resumed.resume() and resumed.step == 3
    resumed.run()
    # the log is cut after the resumed step, so the steps after it appear once, exactly as before
    assert _without_timing(_records(resumed)) == expected


def test_pair_overlap_is_a_run_setting_that_needs_the_pair_layout() -> None:
    from dflash_core.train.config import TrainConfig

    assert TrainConfig(target="tiny:qwen3", data=["x.arrow"], placement="pair", pair_overlap=True).pair_overlap
    with pytest.raises(ValueError, match="needs placement=pair"):
        TrainConfig(target="tiny:qwen3", data=["x.arrow"], pair_overlap=True)
