"""The drafter's loss options end to end on a tiny target: KL against the target's distribution at
the slots' positions and D-PACE weights, each equal to a direct computation on full logits.

Run: .venv/bin/python -m pytest tests/unit/test_drafter_loss_options.py -q
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.model.loss_spec import LossSpec
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config

_SEQ, _BLOCK = 32, 4


def _setup():
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target_config, num_layers=1, block_size=_BLOCK, num_tapped_layers=2)
    input_ids = torch.randint(1, target_config.vocab_size, (2, _SEQ))
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    loss_mask = torch.ones(2, _SEQ, dtype=torch.bool)
    loss_mask[1, 20:] = False  # some slots without loss
    plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=6, block_size=_BLOCK,
                       generator=torch.Generator().manual_seed(0))
    return target, config, input_ids, captured, plan


def _drafter(config, target, state=None, **loss):
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0, **loss))
    if state is not None:
        drafter.load_state_dict(state)
    drafter.attach_target(target_heads(target))
    return drafter


def _run(drafter, input_ids, captured, plan):
    return drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                   teacher_hidden=captured.final_hidden, loss_chunk_size=7)


@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
def test_kl_loss_is_kl_to_the_targets_distribution_at_the_previous_position(weighting):
    target, config, input_ids, captured, plan = _setup()
    base = _drafter(config, target)
    drafter = _drafter(config, target, base.state_dict(), loss_type="kl", loss_weighting=weighting)
    output, loss, metrics = _run(drafter, input_ids, captured, plan)

    valid = plan.label_valid
    log_q = torch.log_softmax(target.lm_head(output.hidden_BAKH.detach()), dim=-1)
    target_logits = target(input_ids).logits  # full logits: fine at this size, never in the drafter
    rows = torch.arange(2)[:, None, None]
    teacher = target_logits[rows, plan.label_positions() - 1]  # position p+k-1 predicts token p+k
    kl = F.kl_div(log_q, torch.log_softmax(teacher, -1), log_target=True, reduction="none").sum(-1)
    if weighting == "exp_decay":
        weights = drafter.slot_weights[1:] * valid
        expected = (weights * kl).sum() / weights.sum()
    else:
        from dflash_core.model.loss import dpace_weights

        nll = -log_q.gather(-1, teacher.argmax(-1, keepdim=True)).squeeze(-1)
        weights = dpace_weights(nll.view(-1, _BLOCK - 1), valid.view(-1, _BLOCK - 1), alpha=0.5).view_as(valid)
        expected = (weights * kl).sum() / valid.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(output.labels_BAK[valid], teacher.argmax(-1)[valid])
    # The CE drafter learns the same labels: the teacher's argmax.
    ce_output, _, _ = _run(base, input_ids, captured, plan)
    assert torch.equal(ce_output.labels_BAK, output.labels_BAK)
    assert metrics["accuracy_per_position"].shape == (_BLOCK - 1,)


def test_dpace_cross_entropy_matches_a_direct_computation():
    target, config, input_ids, captured, plan = _setup()
    drafter = _drafter(config, target, loss_weighting="dpace", dpace_alpha=0.3)
    output, loss, _ = _run(drafter, input_ids, captured, plan)
    loss.backward()
    valid = plan.label_valid
    logits = target.lm_head(output.hidden_BAKH.detach())
    ce = F.cross_entropy(logits.flatten(0, -2), output.labels_BAK.flatten(), reduction="none").view_as(valid)
    from dflash_core.model.loss import dpace_weights

    weights = dpace_weights(ce.view(-1, _BLOCK - 1), valid.view(-1, _BLOCK - 1), alpha=0.3).view_as(valid)
    torch.testing.assert_close(loss, (weights * ce).sum() / valid.sum(), rtol=1e-4, atol=1e-5)
    assert all(p.grad is not None for p in drafter.parameters())


def test_kl_needs_the_teacher():
    target, config, input_ids, captured, plan = _setup()
    drafter = _drafter(config, target, loss_type="kl")
    with pytest.raises(ValueError, match="teacher_hidden"):
        drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan)
