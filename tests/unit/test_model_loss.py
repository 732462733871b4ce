"""Position weights, chunked LM-head cross-entropy, teacher tokens and acceptance metrics.

Run: .venv/bin/python -m pytest tests/unit/test_model_loss.py -q
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.model.loss import chunked_lm_head_cross_entropy, position_weights, teacher_token_ids
from dflash_core.model.metrics import (
    acceptance_length_empirical,
    acceptance_length_from_accuracy,
    accuracy_per_position,
)


def test_position_weights_block16_gamma7():
    weights = position_weights(block_size=16, gamma=7.0)
    assert weights[0] == 0.0  # the anchor slot is given, never learned
    assert weights[1] == 1.0
    assert math.isclose(float(weights[8]), math.exp(-1.0), rel_tol=1e-6)  # k-1 = 7 = gamma
    assert math.isclose(float(weights[15]), math.exp(-14 / 7), rel_tol=1e-6)
    assert (weights[1:].diff() < 0).all()
    with pytest.raises(ValueError):
        position_weights(block_size=8, gamma=0.0)


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_cross_entropy_matches_full_logits(chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,))
    token_weights = torch.rand(37, dtype=torch.float64)
    token_weights[::4] = 0.0  # masked tokens
    loss, correct = chunked_lm_head_cross_entropy(
        hidden, lm_head_weight=weight, labels_N=labels, token_weights_N=token_weights, chunk_size=chunk_size
    )
    loss.backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ weight.T
    reference = (F.cross_entropy(logits, labels, reduction="none") * token_weights).sum() / token_weights.sum()
    reference.backward()
    torch.testing.assert_close(loss, reference.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, hidden.grad)
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_masked_tokens_do_not_change_the_loss():
    torch.manual_seed(1)
    hidden, weight = torch.randn(10, 8), torch.randn(20, 8)
    labels = torch.randint(0, 20, (10,))
    token_weights = torch.ones(10)
    token_weights[5:] = 0
    loss_a, _ = chunked_lm_head_cross_entropy(hidden, lm_head_weight=weight, labels_N=labels, token_weights_N=token_weights)
    scrambled = labels.clone()
    scrambled[5:] = (labels[5:] + 7) % 20
    loss_b, _ = chunked_lm_head_cross_entropy(hidden, lm_head_weight=weight, labels_N=scrambled, token_weights_N=token_weights)
    assert torch.equal(loss_a, loss_b)


def test_trainable_lm_head_is_refused():
    with pytest.raises(ValueError, match="frozen"):
        chunked_lm_head_cross_entropy(
            torch.randn(2, 4), lm_head_weight=nn.Parameter(torch.randn(3, 4)),
            labels_N=torch.zeros(2, dtype=torch.long), token_weights_N=torch.ones(2),
        )


def test_teacher_tokens_only_at_requested_positions():
    torch.manual_seed(2)
    final_hidden = torch.randn(2, 9, 8)
    norm, lm_head = nn.LayerNorm(8), nn.Linear(8, 30, bias=False)
    index = torch.tensor([0, 4, 10, 17])  # row * 9 + position
    ids = teacher_token_ids(final_hidden, index_flat=index, final_norm=norm, lm_head=lm_head, chunk_size=3)
    full = lm_head(norm(final_hidden)).argmax(-1).flatten()
    assert torch.equal(ids, full[index])
    calls = []
    lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    teacher_token_ids(final_hidden, index_flat=index, final_norm=norm, lm_head=lm_head, chunk_size=3)
    assert calls == [3, 1]  # never the 18 positions of the batch


def test_acceptance_length_counts_the_bonus_token():
    assert float(acceptance_length_from_accuracy(torch.zeros(15))) == 1.0
    assert float(acceptance_length_from_accuracy(torch.ones(15))) == 16.0
    tau = acceptance_length_from_accuracy(torch.tensor([0.5, 0.5, 1.0]))
    assert math.isclose(float(tau), 1 + 0.5 + 0.25 + 0.25)


def test_accuracy_and_empirical_acceptance():
    correct = torch.tensor([[[True, True, False], [True, False, True], [False, True, True]]])
    valid = torch.tensor([[[True, True, True], [True, True, True], [True, True, False]]])
    anchor_valid = torch.tensor([[True, True, True]])
    accuracy = accuracy_per_position(correct_BAK=correct, valid_BAK=valid)
    torch.testing.assert_close(accuracy, torch.tensor([2 / 3, 2 / 3, 1 / 2]))
    tau = acceptance_length_empirical(correct_BAK=correct, valid_BAK=valid, anchor_valid_BA=anchor_valid)
    assert math.isclose(float(tau), 1 + (2 + 1 + 0) / 3, rel_tol=1e-6)


# -- D-PACE and KL: the chunked loss against a direct computation on full logits ------------------

def _dpace_reference(nll, valid, alpha):
    """Slot by slot, as the D-PACE definition reads: w_k = sum_{j>=k, valid_j} prod_{i<=j} c_i."""
    rows, slots = nll.shape
    weights = torch.zeros(rows, slots, dtype=torch.float64)
    for r in range(rows):
        c = [((1 - alpha) * math.exp(-float(nll[r, i])) + alpha) if valid[r, i] else 1.0 for i in range(slots)]
        for k in range(slots):
            if valid[r, k]:
                weights[r, k] = sum(math.prod(c[: j + 1]) for j in range(k, slots) if valid[r, j])
    return weights


def test_dpace_weights_match_the_definition():
    from dflash_core.model.loss import dpace_weights

    torch.manual_seed(3)
    nll = torch.rand(5, 7, dtype=torch.float64) * 4
    valid = torch.rand(5, 7) > 0.25
    for alpha in (0.5, 0.1, 1.0):
        torch.testing.assert_close(dpace_weights(nll, valid, alpha=alpha).double(), _dpace_reference(nll, valid, alpha),
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(nll, valid, alpha=0.0)


def test_dpace_weights_match_speculators():
    """Same weights as speculators 0.9's own dpace_loss_decay on its [1, anchors * block] layout,
    where slot 0 (the anchor) is masked."""
    losses = pytest.importorskip("speculators.losses")
    from dflash_core.model.loss import dpace_weights

    torch.manual_seed(4)
    anchors, block = 6, 5
    nll = torch.rand(anchors, block - 1) * 3
    valid = torch.rand(anchors, block - 1) > 0.2
    theirs_nll = torch.cat((torch.zeros(anchors, 1), nll), dim=1).reshape(1, -1)
    theirs_mask = torch.cat((torch.zeros(anchors, 1, dtype=torch.bool), valid), dim=1).reshape(1, -1)
    theirs = losses.dpace_loss_decay(torch.zeros(1), loss_mask=theirs_mask, block_size=block, dpace_alpha=0.5,
                                     elementwise_loss=theirs_nll * theirs_mask)
    torch.testing.assert_close(dpace_weights(nll, valid, alpha=0.5), theirs.view(anchors, block)[:, 1:])


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_dpace_loss_and_gradient_match_full_logits(chunk_size):
    from dflash_core.model.loss import chunked_lm_head_loss

    torch.manual_seed(5)
    blocks, slots, vocab, width = 4, 3, 30, 8
    hidden = torch.randn(blocks * slots, width, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=torch.float64)
    labels = torch.randint(0, vocab, (blocks * slots,))
    valid = torch.rand(blocks * slots) > 0.2
    out = chunked_lm_head_loss(hidden, lm_head_weight=weight, valid_N=valid, labels_N=labels, dpace_alpha=0.5,
                               num_slots=slots, chunk_size=chunk_size)
    out.loss.backward()
    grad, hidden.grad = hidden.grad.clone(), None

    ce = F.cross_entropy(hidden @ weight.T, labels, reduction="none")
    weights = _dpace_reference(ce.detach().view(blocks, slots), valid.view(blocks, slots), 0.5).flatten()
    reference = (weights * ce * valid).sum() / valid.sum()  # weights carry no gradient, as in speculators
    reference.backward()
    torch.testing.assert_close(out.loss, reference.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, hidden.grad)
    torch.testing.assert_close(out.weights.double(), weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.labels, labels)


@pytest.mark.parametrize("dpace", [False, True])
def test_kl_loss_and_gradient_match_full_logits(dpace):
    from dflash_core.model.loss import chunked_lm_head_loss

    torch.manual_seed(6)
    rows, vocab, width, slots = 12, 25, 8, 4
    hidden = torch.randn(rows, width, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(rows, width, dtype=torch.float64)
    weight = torch.randn(vocab, width, dtype=torch.float64)
    valid = torch.rand(rows) > 0.2
    token_weights = torch.rand(rows, dtype=torch.float64)
    out = chunked_lm_head_loss(hidden, lm_head_weight=weight, valid_N=valid, teacher_hidden_NH=teacher,
                               token_weights_N=None if dpace else token_weights, dpace_alpha=0.5 if dpace else None,
                               num_slots=slots, chunk_size=5)
    out.loss.backward()
    grad, hidden.grad = hidden.grad.clone(), None

    log_q = torch.log_softmax(hidden @ weight.T, dim=-1)
    teacher_logits = teacher @ weight.T
    kl = F.kl_div(log_q, torch.log_softmax(teacher_logits, dim=-1), log_target=True, reduction="none").sum(-1)
    teacher_ids = teacher_logits.argmax(-1)
    if dpace:  # the confidence D-PACE uses is the drafter's probability of the teacher's argmax
        nll = -log_q.gather(1, teacher_ids[:, None]).squeeze(1).detach()
        weights = _dpace_reference(nll.view(-1, slots), valid.view(-1, slots), 0.5).flatten()
        reference = (weights * kl * valid).sum() / valid.sum()
    else:
        reference = (token_weights * valid * kl).sum() / (token_weights * valid).sum()
    reference.backward()
    torch.testing.assert_close(out.loss, reference.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, hidden.grad)
    assert torch.equal(out.labels, teacher_ids)
    assert torch.equal(out.correct, log_q.argmax(-1) == teacher_ids)


def test_kl_is_zero_when_the_drafter_is_the_teacher():
    from dflash_core.model.loss import chunked_lm_head_loss

    torch.manual_seed(7)
    hidden, weight = torch.randn(6, 8), torch.randn(20, 8)
    out = chunked_lm_head_loss(hidden, lm_head_weight=weight, valid_N=torch.ones(6, dtype=torch.bool),
                               teacher_hidden_NH=hidden, token_weights_N=torch.ones(6))
    assert abs(float(out.loss)) < 1e-5 and out.correct.all()


def test_loss_arguments_are_checked():
    from dflash_core.model.loss import chunked_lm_head_loss

    hidden, weight, valid = torch.randn(4, 8), torch.randn(20, 8), torch.ones(4, dtype=torch.bool)
    labels = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one of labels_N"):
        chunked_lm_head_loss(hidden, lm_head_weight=weight, valid_N=valid, token_weights_N=torch.ones(4))
    with pytest.raises(ValueError, match="exactly one of token_weights_N"):
        chunked_lm_head_loss(hidden, lm_head_weight=weight, valid_N=valid, labels_N=labels)
    with pytest.raises(ValueError, match="num_slots"):
        chunked_lm_head_loss(hidden, lm_head_weight=weight, valid_N=valid, labels_N=labels, dpace_alpha=0.5,
                             num_slots=3)
