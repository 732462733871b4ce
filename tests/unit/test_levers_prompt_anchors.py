"""Anchors in prompts (`prompt_anchors: true`): blocks may start at prompt positions, their slots learn the
target's own argmax there (never the prompt's data tokens), padding and document starts still never
anchor, data labels are refused, and a training step on such plans has a finite gradient.

Run: .venv/bin/python -m pytest -q tests/unit/test_levers_prompt_anchors.py
"""

import pytest
import torch

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.model.loss_spec import LossSpec
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config
from dflash_core.train.config import DrafterSettings
from dflash_core.train.step import drafter_step

_BLOCK, _PROMPT, _SEQ, _PAD = 4, 12, 40, 6


@pytest.fixture(scope="module")
def world():
    """One row: a document of a 12-token prompt and a response, then 6 padding tokens (position 0 each)."""
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config).eval()
    real = _SEQ - _PAD
    input_ids = torch.randint(1, 200, (1, _SEQ))
    positions = torch.cat((torch.arange(real), torch.zeros(_PAD, dtype=torch.long)))[None]
    loss_mask = torch.zeros(1, _SEQ, dtype=torch.bool)
    loss_mask[0, _PROMPT:real] = True
    config = DFlashConfig.from_target(target_config, num_layers=1, block_size=_BLOCK, num_tapped_layers=1)
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(
        input_ids, position_ids=positions)
    with torch.no_grad():
        target_argmax = target(input_ids[:, :real]).logits.argmax(-1)  # the one document alone
    return target, config, input_ids, positions, loss_mask, captured, target_argmax


def _plan(world, *, prompt_anchors: bool, sampling: str = "uniform"):
    _, _, _, positions, loss_mask, _, _ = world
    return plan_blocks(loss_mask_BT=loss_mask, num_anchors=_SEQ, block_size=_BLOCK, position_ids_BT=positions,
                       generator=torch.Generator().manual_seed(0), anchor_sampling=sampling,
                       prompt_anchors=prompt_anchors)


@pytest.mark.parametrize("sampling", ["uniform", "stratified"])
def test_prompt_positions_anchor_and_their_slots_carry_loss(world, sampling):
    off, on = _plan(world, prompt_anchors=False), _plan(world, prompt_anchors=True, sampling=sampling)
    off_anchors = set(off.anchors[0][off.anchor_valid[0]].tolist())
    on_anchors = set(on.anchors[0][on.anchor_valid[0]].tolist())
    assert min(off_anchors) >= _PROMPT  # off: responses only
    real = _SEQ - _PAD
    # On: every position with a token of its document before it and one after (here: 1 .. real-2).
    assert on_anchors == set(range(1, real - 1))
    slots = on.label_positions()[0]
    in_prompt = on.label_valid[0] & (slots < _PROMPT)
    assert in_prompt.any()
    assert not (on.label_valid[0] & (slots >= real)).any()  # padding is never a label
    assert on.label_valid[0][on.anchor_valid[0]].any(dim=-1).all()


def test_prompt_slots_learn_the_targets_argmax_not_the_prompt(world):
    target, config, input_ids, _, _, captured, target_argmax = world
    torch.manual_seed(0)
    drafter = build_drafter(config, loss=LossSpec(loss_weighting="dpace"))
    drafter.attach_target(target_heads(target))
    plan = _plan(world, prompt_anchors=True)
    with torch.no_grad():
        out, _, _ = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                            teacher_hidden=captured.final_hidden)
    slots = plan.label_positions()[0]
    valid = plan.label_valid[0]
    expected = target_argmax[0][(slots - 1).clamp(max=target_argmax.shape[1] - 1)]
    assert torch.equal(out.labels_BAK[0][valid], expected[valid])
    prompt_slots = valid & (slots < _PROMPT)
    data = input_ids[0][slots]
    assert (out.labels_BAK[0][prompt_slots] != data[prompt_slots]).any()  # a random prompt is not the argmax


def test_refused_without_teacher_labels_and_a_step_trains(world):
    with pytest.raises(ValueError, match="loss_target=teacher"):
        DrafterSettings(prompt_anchors=True, loss_target="data")
    assert DrafterSettings().prompt_anchors is False
    target, config, input_ids, positions, loss_mask, captured, _ = world
    tensors = {"input_ids": input_ids, "position_ids": positions, "loss_mask": loss_mask}
    drafter = build_drafter(config, loss=LossSpec(loss_weighting="dpace"))
    drafter.attach_target(target_heads(target))
    common = dict(tensors=tensors, captured=captured, num_anchors=12, block_size=_BLOCK,
                  generator=torch.Generator().manual_seed(0), device=torch.device("cpu"), attention_backend="sdpa",
                  loss_scale=1.0, prompt_anchors=True)
    with pytest.raises(ValueError, match="teacher"):
        drafter_step(drafter, teacher=False, **common)
    metrics = drafter_step(drafter, teacher=True, **common)
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert torch.isfinite(metrics["loss"]) and grads and all(torch.isfinite(g).all() for g in grads)
