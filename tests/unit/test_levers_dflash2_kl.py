"""KL for DFlash 2's unary loss (`loss_type: kl`): the chunked KL(teacher || drafter) over transformed
logits and its gradient match a direct autograd computation for any chunk size, under exp-decay and
D-PACE weights (D-PACE's confidence stays the label's unary probability); a drafter with the teacher's
states has KL 0; a training step has a finite gradient and the model wires the teacher's rows to the
right slots; settings, the compiled kernel and exports carry it.

Run: .venv/bin/python -m pytest -q tests/unit/test_levers_dflash2_kl.py
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_core.export import export_drafter, load_drafter
from dflash_core.model import plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import CandidateSelector, DFlash2Config
from dflash_core.model import dflash2_loss
from dflash_core.model.dflash2_loss import compiled_unary_kl_kernel, dflash2_objective, transform_logits
from dflash_core.model.loss import dpace_weights
from dflash_core.model.loss_spec import LossSpec
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config
from dflash_core.train.config import DrafterSettings

_VOCAB, _HIDDEN, _TOP_K, _SLOTS, _BLOCKS, _SELECTOR_WEIGHT = 256, 16, 5, 4, 6, 0.6
_TRANSFORMS = [dict(output_multiplier=1.0, softcap=None), dict(output_multiplier=0.7, softcap=4.0)]
_EXP_DECAY = torch.exp(-torch.arange(_SLOTS) / 2.0).repeat(_BLOCKS)  # exp(-(k-1)/gamma), gamma 2, per slot


def _kl_rows(logits, teacher_logits):
    """KL(teacher || drafter) per row, over full rows of logits."""
    return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1), log_target=True,
                    reduction="none").sum(-1)


def _case(seed: int = 1):
    torch.manual_seed(seed)
    num = _SLOTS * _BLOCKS
    weight = torch.randn(_VOCAB, _HIDDEN) / 2
    selector = CandidateSelector(vocab_size=_VOCAB, hidden_size=_HIDDEN, rank=6, top_k=_TOP_K)
    selector.reset_parameters(std=0.5)
    teacher = torch.randn(num, _HIDDEN)
    hidden = (teacher + 0.8 * torch.randn(num, _HIDDEN)).requires_grad_(True)  # near the teacher, not on it
    labels = (teacher @ weight.T).argmax(-1)  # the teacher's argmax, as the model passes them
    predecessors = torch.randint(0, _VOCAB, (num,))
    valid = torch.ones(num)
    valid[[3, 7, 10, 11]] = 0.0
    return weight, selector, hidden, teacher, labels, predecessors, valid


def _direct(weight, selector, hidden, teacher, labels, predecessors, valid, *, output_multiplier, softcap,
            dpace_alpha):
    """Both losses written out over full [N, V] logits, autograd for the gradient."""
    logits = transform_logits(hidden @ weight.T, multiplier=output_multiplier, softcap=softcap)
    teacher_logits = transform_logits(teacher @ weight.T, multiplier=output_multiplier, softcap=softcap)
    kl = _kl_rows(logits, teacher_logits)
    candidates = logits.topk(_TOP_K, dim=-1).indices
    present = (candidates == labels[:, None]).any(-1)
    candidates[:, -1] = torch.where(present, candidates[:, -1], labels)
    context = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)
    transitions = torch.einsum("nr,nkr->nk", context, selector.successor_codebook[candidates])
    scores = logits.gather(1, candidates) + transitions
    selector_ce = F.cross_entropy(scores, (candidates == labels[:, None]).long().argmax(-1), reduction="none")
    if dpace_alpha is None:
        scale = _EXP_DECAY * valid / (_EXP_DECAY * valid).sum()
    else:  # D-PACE's confidence: the label's unary probability, not the KL
        nll = F.cross_entropy(logits, labels, reduction="none").detach()
        scale = dpace_weights(nll.view(_BLOCKS, _SLOTS), valid.bool().view(_BLOCKS, _SLOTS),
                              alpha=dpace_alpha).flatten() / valid.sum()
    return (scale * kl).sum() + _SELECTOR_WEIGHT * (scale * selector_ce).sum(), (scale * kl).sum()


def _objective(weight, selector, hidden, teacher, labels, predecessors, valid, *, dpace_alpha, chunk_size=7,
               **transform):
    token_weights = valid if dpace_alpha is not None else _EXP_DECAY * valid
    return dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=labels,
                             predecessor_ids_N=predecessors, token_weights_N=token_weights,
                             selector_loss_weight=_SELECTOR_WEIGHT, chunk_size=chunk_size,
                             dpace_alpha=dpace_alpha, num_slots=_SLOTS, teacher_hidden_NH=teacher,
                             **transform)


@pytest.mark.parametrize("transform", _TRANSFORMS)
@pytest.mark.parametrize("dpace_alpha", [None, 0.4])
def test_chunked_kl_and_its_gradient_match_a_direct_computation(transform, dpace_alpha):
    case = _case()
    weight, selector, hidden = case[0], case[1], case[2]
    expected, expected_unary = _direct(*case, dpace_alpha=dpace_alpha, **transform)
    expected_grads = torch.autograd.grad(expected, [hidden, *selector.parameters()])
    for chunk_size in (1, 5, 7, 24, 100):  # one row, ragged chunks, exactly N, more than N
        objective = _objective(*case, dpace_alpha=dpace_alpha, chunk_size=chunk_size, **transform)
        torch.testing.assert_close(objective.loss, expected)
        torch.testing.assert_close(objective.dflash_loss, expected_unary)
        grads = torch.autograd.grad(objective.loss, [hidden, *selector.parameters()])
        for got, want in zip(grads, expected_grads, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    ce = dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=case[4],
                           predecessor_ids_N=case[5], token_weights_N=case[6], chunk_size=7,
                           dpace_alpha=0.4, num_slots=_SLOTS, **transform)
    assert not torch.allclose(ce.dflash_loss, _objective(*case, dpace_alpha=0.4, **transform).dflash_loss)


@pytest.mark.parametrize("transform", _TRANSFORMS)
def test_a_drafter_with_the_teachers_states_has_kl_zero_and_no_unary_gradient(transform):
    weight, selector, _, teacher, labels, predecessors, valid = _case()
    hidden = teacher.clone().requires_grad_(True)
    objective = _objective(weight, selector, hidden, teacher, labels, predecessors, valid, dpace_alpha=0.5,
                           **transform)
    assert abs(objective.dflash_loss.item()) < 1e-6
    (grad,) = torch.autograd.grad(objective.dflash_loss, [hidden])
    assert grad.abs().max() < 1e-6
    assert objective.unary_correct[valid.bool()].all()  # the teacher's argmax is the label


def test_kl_refusals_name_the_problem():
    weight, selector, hidden, teacher, labels, predecessors, valid = _case()
    with pytest.raises(ValueError, match="not to the KL loss"):
        dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=labels,
                          predecessor_ids_N=predecessors, token_weights_N=valid, teacher_hidden_NH=teacher,
                          label_smoothing=0.1)
    with pytest.raises(ValueError, match="one teacher row per drafted slot"):
        dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=labels,
                          predecessor_ids_N=predecessors, token_weights_N=valid,
                          teacher_hidden_NH=teacher[:-1])
    with pytest.raises(ValueError, match="needs loss_type 'ce'"):
        LossSpec(loss_type="kl", label_smoothing=0.1)
    with pytest.raises(ValueError, match="needs loss_target=teacher"):
        DrafterSettings(variant="dflash2", loss_type="kl", loss_target="data")
    settings = DrafterSettings(variant="dflash2", loss_type="kl", dpace_source="selector")
    assert settings.loss_spec().loss_type == "kl"


def _model_case(loss: LossSpec, **dflash2_fields):
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config)
    config = DFlash2Config.from_target(target_config, num_layers=1, block_size=4, num_tapped_layers=1,
                                       conv_group_size=16, selector_rank=8, selector_top_k=4,
                                       **dflash2_fields)
    drafter = build_drafter(config, loss=loss)
    drafter.attach_target(target_heads(target))
    input_ids = torch.randint(1, _VOCAB, (2, 32))
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    plan = plan_blocks(loss_mask_BT=torch.ones(2, 32, dtype=torch.bool), num_anchors=6, block_size=4,
                       generator=torch.Generator().manual_seed(0))
    return target, drafter, dict(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                                 teacher_hidden=captured.final_hidden)


@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
def test_a_dflash2_training_step_with_kl_has_a_finite_gradient(weighting):
    losses = {}
    for loss_type in ("ce", "kl"):
        loss_spec = LossSpec(loss_type=loss_type, loss_weighting=weighting, loss_gamma=2.0)
        _, drafter, inputs = _model_case(loss_spec)
        _, loss, metrics = drafter(**inputs)
        loss.backward()
        grads = [p.grad for p in drafter.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert torch.isfinite(metrics["selector_loss"]) and metrics["dflash_loss"] >= 0
        losses[loss_type] = metrics["dflash_loss"]
    assert not torch.allclose(losses["ce"], losses["kl"])
    _, drafter, inputs = _model_case(LossSpec(loss_type="kl"))
    with pytest.raises(ValueError, match="needs teacher_hidden"):  # labels from data tokens: no distribution
        drafter(**{**inputs, "teacher_hidden": None})


def test_the_model_takes_the_teachers_logits_at_the_position_before_each_label():
    """The model's unary KL, recomputed from its drafted states and the target's own head at p+k-1."""
    loss_spec = LossSpec(loss_type="kl", loss_weighting="exp_decay", loss_gamma=2.0)
    target, drafter, inputs = _model_case(loss_spec, output_multiplier=0.8, final_logit_softcapping=5.0)
    output, _, metrics = drafter(**inputs)
    plan, heads = inputs["plan"], target_heads(target)
    rows = torch.arange(2)[:, None, None]
    with torch.no_grad():
        teacher = heads.lm_head(heads.final_norm(inputs["teacher_hidden"][rows, plan.label_positions() - 1]))
        teacher = transform_logits(teacher, multiplier=0.8, softcap=5.0)
        logits = drafter.unary_logits(output.hidden_BAKH)
    kl = _kl_rows(logits, teacher)
    weights = drafter.exp_decay_weights() * plan.label_valid
    torch.testing.assert_close(metrics["dflash_loss"], (weights * kl).sum() / weights.sum())
    valid = plan.label_valid
    assert torch.equal(output.labels_BAK[valid], teacher.argmax(-1)[valid])  # hard labels: the teacher's


def test_a_dflash2_drafter_trained_with_kl_exports_and_reloads_its_loss(tmp_path):
    target, drafter, _ = _model_case(LossSpec(loss_type="kl", loss_weighting="dpace", dpace_alpha=0.3))
    paths = export_drafter(drafter, target_config=target.config, out_dir=tmp_path,
                           verifier_name_or_path="/models/t")
    for path in paths.values():
        again = load_drafter(path)
        assert type(again) is type(drafter) and again.loss.loss_type == "kl" and again.loss.dpace_alpha == 0.3


def test_the_compiled_flag_runs_the_kl_kernel(monkeypatch):
    """compiled=True with a teacher calls the compiled KL kernel (here a counting stand-in for it: CPU
    compiles are the slow test below), never the cross-entropy one."""
    calls = []

    def counting_kl_kernel(*args, **kwargs):
        calls.append(1)
        return dflash2_loss._unary_kl_rows(*args, **kwargs)

    def refuse():
        raise AssertionError("the cross-entropy kernel under KL")

    monkeypatch.setattr(dflash2_loss, "compiled_unary_kl_kernel", lambda: counting_kl_kernel)
    monkeypatch.setattr(dflash2_loss, "compiled_unary_kernel", refuse)
    case = _case()
    eager = _objective(*case, dpace_alpha=0.4, **_TRANSFORMS[1])
    compiled = _objective(*case, dpace_alpha=0.4, compiled=True, **_TRANSFORMS[1])
    assert calls and torch.equal(compiled.loss, eager.loss)
    assert compiled_unary_kl_kernel() is compiled_unary_kl_kernel()  # made once per process, lazily


@pytest.mark.slow  # torch.compile on a CPU: C++ builds
def test_compiled_kl_kernel_matches_eager():
    torch.manual_seed(0)
    num, hidden_size, vocab = 600, 32, 3000
    weight = (torch.randn(vocab, hidden_size) / hidden_size ** 0.5).bfloat16()
    selector = CandidateSelector(vocab_size=vocab, hidden_size=hidden_size, rank=16, top_k=8)
    selector.reset_parameters(std=0.5)
    teacher = torch.randn(num, hidden_size).bfloat16()
    hidden = teacher.float() + 0.5 * torch.randn(num, hidden_size)
    labels = (teacher @ weight.T).argmax(-1)
    predecessors = torch.randint(0, vocab, (num,))
    results = []
    for compiled in (False, True):
        states = hidden.clone().requires_grad_(True)
        objective = dflash2_objective(states, lm_head_weight=weight, selector=selector, labels_N=labels,
                                      predecessor_ids_N=predecessors, token_weights_N=torch.ones(num),
                                      chunk_size=256,
                                      output_multiplier=0.7, softcap=30.0, teacher_hidden_NH=teacher,
                                      compiled=compiled)
        results.append((objective, torch.autograd.grad(objective.loss, [states])[0]))
    (eager, eager_grad), (compiled, compiled_grad) = results
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-4, atol=1e-5)
    assert torch.equal(compiled.unary_correct, eager.unary_correct)
    torch.testing.assert_close(compiled_grad.float(), eager_grad.float(), rtol=2e-2, atol=1e-4)
