"""D-PACE confidences from DFlash 2's candidate selector (`dpace_source: selector`): the slot weights
come from the selector's K-way cross-entropy, both losses take them, the gradient matches a direct
computation, and DFlash (no selector) or fixed slot weights refuse the option.

Run: .venv/bin/python -m pytest -q tests/unit/test_levers_dpace_source.py
"""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import CandidateSelector, DFlash2Config
from dflash_core.model.dflash2_loss import dflash2_objective
from dflash_core.model.loss import dpace_weights
from dflash_core.model.loss_spec import LossSpec
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config
from dflash_core.train.config import DrafterSettings

_VOCAB, _HIDDEN, _TOP_K, _SLOTS, _BLOCKS = 256, 16, 5, 4, 6


def _case(seed: int = 1):
    torch.manual_seed(seed)
    num = _SLOTS * _BLOCKS
    weight = torch.randn(_VOCAB, _HIDDEN)
    selector = CandidateSelector(vocab_size=_VOCAB, hidden_size=_HIDDEN, rank=6, top_k=_TOP_K)
    selector.reset_parameters(std=0.5)
    hidden = torch.randn(num, _HIDDEN, requires_grad=True)
    logits = hidden.detach() @ weight.T
    labels = torch.randint(0, _VOCAB, (num,))
    labels[::2] = logits[::2].topk(2, dim=-1).indices[:, 1]  # half the labels in the top-K, half injected
    predecessors = torch.randint(0, _VOCAB, (num,))
    valid = torch.ones(num)
    valid[[3, 7, 10, 11]] = 0.0
    return weight, selector, hidden, labels, predecessors, valid


def _direct(weight, selector, hidden, labels, predecessors, valid, *, alpha, source, selector_weight=0.6):
    """Both losses with D-PACE weights from the unary or the selector's per-slot NLL, written out."""
    logits = hidden @ weight.T
    ce = F.cross_entropy(logits, labels, reduction="none")
    candidates = logits.topk(_TOP_K, dim=-1).indices
    present = (candidates == labels[:, None]).any(-1)
    candidates[:, -1] = torch.where(present, candidates[:, -1], labels)
    context = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)
    scores = logits.gather(1, candidates) + torch.einsum("nr,nkr->nk", context, selector.successor_codebook[candidates])
    selector_ce = F.cross_entropy(scores, (candidates == labels[:, None]).long().argmax(-1), reduction="none")
    confidence_nll = selector_ce if source == "selector" else ce
    weights = dpace_weights(confidence_nll.detach().view(_BLOCKS, _SLOTS), valid.bool().view(_BLOCKS, _SLOTS),
                            alpha=alpha).flatten()
    return ((weights * ce).sum() + selector_weight * (weights * selector_ce).sum()) / valid.sum(), selector_ce, weights


def _objective(weight, selector, hidden, labels, predecessors, valid, *, alpha, source):
    return dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=labels,
                             predecessor_ids_N=predecessors, token_weights_N=valid, selector_loss_weight=0.6,
                             chunk_size=7, dpace_alpha=alpha, num_slots=_SLOTS, dpace_source=source)


def test_dpace_weights_by_hand_on_two_slots():
    """The weights the selector's NLLs give, by the D-PACE formula written out for one 2-slot block:
    c_k = (1 - a) p_k + a; w_1 = c_1 + c_1 c_2, w_2 = c_1 c_2."""
    nll = torch.tensor([[0.2, 1.5]])
    alpha = 0.5
    c1, c2 = ((1 - alpha) * math.exp(-0.2) + alpha), ((1 - alpha) * math.exp(-1.5) + alpha)
    got = dpace_weights(nll, torch.ones(1, 2, dtype=torch.bool), alpha=alpha)
    torch.testing.assert_close(got, torch.tensor([[c1 + c1 * c2, c1 * c2]]))


def test_selector_sourced_weights_match_a_direct_computation_and_differ_from_unary():
    case = _case()
    expected, selector_ce, weights = _direct(*case, alpha=0.4, source="selector")
    unary_expected, _, unary_weights = _direct(*case, alpha=0.4, source="unary")
    assert not torch.allclose(weights, unary_weights, atol=1e-3)  # the lever changes the weights

    objective = _objective(*case, alpha=0.4, source="selector")
    torch.testing.assert_close(objective.loss, expected)
    hidden, selector = case[2], case[1]
    grads = torch.autograd.grad(objective.loss, [hidden, *selector.parameters()])
    expected_grads = torch.autograd.grad(expected, [hidden, *selector.parameters()])
    for got, want in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    unary = _objective(*case, alpha=0.4, source="unary")
    torch.testing.assert_close(unary.loss, unary_expected)
    assert not torch.allclose(unary.loss, objective.loss)


def test_without_transitions_the_selector_is_the_unary_softmax_over_k_so_no_slot_weighs_less():
    """Zero transitions: the selector's NLL is the unary NLL renormalized over K candidates (never larger),
    so every confidence, and with it every D-PACE weight, is at least the unary one; the later slots of a
    block gain the most, which is what the lever is for."""
    weight, selector, hidden, labels, predecessors, valid = _case()
    with torch.no_grad():
        selector.successor_codebook.zero_()
    _, _, weights = _direct(weight, selector, hidden, labels, predecessors, valid, alpha=0.4, source="selector")
    _, _, unary_weights = _direct(weight, selector, hidden, labels, predecessors, valid, alpha=0.4, source="unary")
    on = valid.bool()
    assert (weights[on] >= unary_weights[on] - 1e-6).all()
    ratio = (weights / unary_weights.clamp_min(1e-12)).view(_BLOCKS, _SLOTS)
    assert ratio[:, -1][valid.view(_BLOCKS, _SLOTS)[:, -1].bool()].mean() > ratio[:, 0].mean()


def test_refused_without_a_selector_or_without_dpace():
    with pytest.raises(ValueError, match="loss_weighting 'dpace'"):
        LossSpec(loss_weighting="exp_decay", dpace_source="selector")
    with pytest.raises(ValueError, match="dpace_source must be one of"):
        LossSpec(loss_weighting="dpace", dpace_source="both")
    target_config = tiny_target_config("qwen3")
    base = DFlashConfig.from_target(target_config, num_layers=1, block_size=4, num_tapped_layers=1)
    with pytest.raises(ValueError, match="DFlash 2 only"):
        build_drafter(base, loss=LossSpec(loss_weighting="dpace", dpace_source="selector"))
    with pytest.raises(ValueError, match="variant=dflash2"):
        DrafterSettings(variant="dflash", dpace_source="selector")
    with pytest.raises(ValueError, match="loss_weighting=dpace"):
        DrafterSettings(loss_weighting="exp_decay", dpace_source="selector")
    assert DrafterSettings().dpace_source == "unary" and LossSpec().dpace_source == "unary"
    assert DrafterSettings(dpace_source="selector").loss_spec().dpace_source == "selector"
    case = _case()
    with pytest.raises(ValueError, match="needs dpace_alpha"):
        dflash2_objective(case[2], lm_head_weight=case[0], selector=case[1], labels_N=case[3],
                          predecessor_ids_N=case[4], token_weights_N=case[5], dpace_source="selector")


def test_a_dflash2_training_step_with_selector_confidences_has_a_finite_gradient():
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config)
    config = DFlash2Config.from_target(target_config, num_layers=1, block_size=4, num_tapped_layers=1,
                                       conv_group_size=16, selector_rank=8, selector_top_k=4)
    input_ids = torch.randint(1, _VOCAB, (1, 32))
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    plan = plan_blocks(loss_mask_BT=torch.ones(1, 32, dtype=torch.bool), num_anchors=6, block_size=4,
                       generator=torch.Generator().manual_seed(0))
    losses = {}
    for source in ("unary", "selector"):
        torch.manual_seed(0)
        drafter = build_drafter(config, loss=LossSpec(loss_weighting="dpace", dpace_source=source))
        drafter.attach_target(target_heads(target))
        _, loss, _ = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                             teacher_hidden=captured.final_hidden)
        loss.backward()
        grads = [p.grad for p in drafter.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        losses[source] = loss.detach()
    assert not torch.allclose(losses["unary"], losses["selector"])
