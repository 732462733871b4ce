"""grouped_topk gives torch.topk's values and indices (no ties in random rows).

Run: .venv/bin/python -m pytest tests/unit/test_grouped_topk.py -q
"""

import pytest
import torch

from dflash_core.model.topk import group_maxima, grouped_topk


@pytest.mark.parametrize("vocab,k,group", [(4096, 16, 256), (5000, 16, 256), (49152, 16, 256), (300, 8, 16),
                                           (1000, 40, 32), (64, 16, 256), (257, 1, 256)])
def test_matches_torch_topk(vocab, k, group):
    rows = torch.randn(37, vocab, generator=torch.Generator().manual_seed(vocab + k))
    values, indices = grouped_topk(rows, k, group_size=group)
    expected_values, expected_indices = rows.topk(k, dim=-1)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0)
    assert torch.equal(indices, expected_indices)


def test_top_entries_clustered_in_one_group_are_all_found():
    rows = torch.randn(4, 2048)
    rows[:, 512:528] += 100.0  # the whole top 16 in one group of 256
    values, indices = grouped_topk(rows, 16)
    assert sorted(indices[0].tolist()) == list(range(512, 528))
    torch.testing.assert_close(values, rows.topk(16, dim=-1).values, rtol=0, atol=0)


def test_top_entries_in_the_short_last_group_are_found():
    """5,000 = 19 whole groups of 256 and one of 136: the row is never padded, the short group is
    reduced on its own and its gathered columns past the row's end never win."""
    rows = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1))
    rows[:, -10:] += 100.0
    rows[1] = -rows[1].abs() - 1.0  # all negative: the masked columns must not win with -inf either
    values, indices = grouped_topk(rows, 16)
    expected_values, expected_indices = rows.topk(16, dim=-1)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0)
    assert torch.equal(indices, expected_indices) and indices.max() < 5000


def test_bfloat16_and_padding_keep_the_dtype():
    rows = torch.randn(3, 1000).bfloat16()
    values, indices = grouped_topk(rows, 5, group_size=64)
    assert values.dtype == torch.bfloat16 and indices.max() < 1000
    torch.testing.assert_close(values, rows.gather(1, indices), rtol=0, atol=0)


def test_rejects_other_ranks():
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        grouped_topk(torch.randn(2, 3, 4), 2)


def test_maxima_from_the_caller_give_the_same_result():
    """The DFlash 2 loss hands in the maxima its compiled kernel computed: same values and indices."""
    rows = torch.randn(9, 5000, generator=torch.Generator().manual_seed(2)).bfloat16()
    maxima = group_maxima(rows)
    assert maxima.shape == (9, 20)
    given = grouped_topk(rows, 16, maxima=maxima)
    own = grouped_topk(rows, 16)
    assert torch.equal(given[0], own[0]) and torch.equal(given[1], own[1])
    # The given maxima are what picks the groups (not recomputed): maxima that favour groups 0..15 keep
    # the top-K inside them.
    favoured = torch.full_like(maxima, -1e4)
    favoured[:, :16] = 1e4
    assert grouped_topk(rows, 16, maxima=favoured)[1].max() < 16 * 256


def test_maxima_of_another_shape_are_refused():
    rows = torch.randn(3, 5000)
    with pytest.raises(ValueError, match=r"not \[rows, groups\] = \[3, 20\]"):
        grouped_topk(rows, 16, maxima=group_maxima(rows, group_size=128))
