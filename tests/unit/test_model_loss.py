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
