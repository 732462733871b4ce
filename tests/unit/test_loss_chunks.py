"""The LM-head losses split their rows into equal chunks; the split changes no result."""

from __future__ import annotations

import pytest
import torch

from dflash_core.model.loss import chunked_lm_head_loss, even_chunk_size


@pytest.mark.parametrize(("rows", "limit", "expected"), [
    (7680, 2048, 1920),   # the 8B bench: 4 x 1,920, not 3 x 2,048 + 1,536
    (8192, 2048, 2048),   # already even
    (100, 2048, 112),     # one chunk, rounded up to the multiple of 16
    (2049, 2048, 1040),   # two chunks of about half
    (5, 4, 4),            # rounding never exceeds the limit
    (0, 2048, 2048),
])
def test_even_chunk_size(rows, limit, expected):
    size = even_chunk_size(rows, limit)
    assert size == expected
    if rows:
        chunks = -(-rows // size)
        assert chunks == -(-rows // limit)  # as few chunks as the limit allows
        assert size <= limit


def test_uneven_rows_give_the_same_loss_and_gradient_as_one_chunk():
    torch.manual_seed(0)
    rows, hidden, vocab = 200, 16, 40
    weight = torch.randn(vocab, hidden, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,))
    valid = torch.ones(rows)
    assert even_chunk_size(rows, 96) == 80  # 3 chunks of at most 96 run as 80 + 80 + 40
    results = []
    for chunk_size in (rows, 96):
        h = torch.randn(rows, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = chunked_lm_head_loss(h, lm_head_weight=weight, valid_N=valid, labels_N=labels,
                                   token_weights_N=torch.ones(rows, dtype=torch.float64), chunk_size=chunk_size)
        out.loss.backward()
        results.append((out.loss.detach(), h.grad, out.correct))
    (loss_a, grad_a, correct_a), (loss_b, grad_b, correct_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(grad_a, grad_b)
    assert torch.equal(correct_a, correct_b)
