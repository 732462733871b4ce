"""Anchor sampling and block plans: property-based invariants.

Run: .venv/bin/python -m pytest tests/unit/test_model_anchors.py -q
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_core.model.anchors import document_ids_from_positions, eligible_anchor_positions, plan_blocks


@st.composite
def packed_batches(draw):
    """(loss_mask [B, T], position_ids [B, T] reset per document, block_size, num_anchors, seed)."""
    batch = draw(st.integers(1, 3))
    seq_len = draw(st.integers(4, 60))
    block_size = draw(st.sampled_from([2, 4, 8]))
    rows_positions, rows_masks = [], []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq_len:
            length = min(draw(st.integers(1, seq_len)), seq_len - total)
            lengths.append(length)
            total += length
        rows_positions.append(torch.cat([torch.arange(n) for n in lengths]))
        rows_masks.append(torch.tensor(draw(st.lists(st.booleans(), min_size=seq_len, max_size=seq_len))))
    num_anchors = draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.stack(rows_masks), torch.stack(rows_positions), block_size, num_anchors, seed


@settings(max_examples=80, deadline=None)
@given(packed_batches())
def test_anchor_invariants(case):
    loss_mask, position_ids, block_size, num_anchors, seed = case
    plan = plan_blocks(
        loss_mask_BT=loss_mask,
        num_anchors=num_anchors,
        block_size=block_size,
        position_ids_BT=position_ids,
        generator=torch.Generator().manual_seed(seed),
    )
    seq_len = loss_mask.shape[1]
    docs = document_ids_from_positions(position_ids)
    assert plan.anchors.shape == plan.anchor_valid.shape == (loss_mask.shape[0], num_anchors)
    for row in range(loss_mask.shape[0]):
        valid = plan.anchor_valid[row]
        anchors = plan.anchors[row][valid].tolist()
        # valid anchors come first, sorted and distinct
        assert valid.tolist() == sorted(valid.tolist(), reverse=True)
        assert anchors == sorted(set(anchors))
        eligible = [
            p for p in range(1, seq_len - 1)
            if loss_mask[row, p] and loss_mask[row, p + 1] and docs[row, p - 1] == docs[row, p] == docs[row, p + 1]
        ]
        assert set(anchors) <= set(eligible)
        assert len(anchors) == min(num_anchors, len(eligible))
        for p in anchors:
            assert loss_mask[row, p] and loss_mask[row, p + 1]  # slot 1 always carries loss
            assert docs[row, p - 1] == docs[row, p] == docs[row, p + 1]  # context before, label after
        # label slots carry loss exactly where the data's loss mask does, inside the row and the document
        for slot, p in enumerate(plan.anchors[row].tolist()):
            expected = [
                bool(valid[slot]) and p + k < seq_len and bool(loss_mask[row, p + k])
                and bool(docs[row, p + k] == docs[row, p])
                for k in range(1, block_size)
            ]
            assert plan.label_valid[row, slot].tolist() == expected


@settings(max_examples=40, deadline=None)
@given(packed_batches())
def test_teacher_index_is_exactly_the_positions_before_each_learned_token(case):
    loss_mask, position_ids, block_size, num_anchors, seed = case
    plan = plan_blocks(
        loss_mask_BT=loss_mask, num_anchors=num_anchors, block_size=block_size,
        position_ids_BT=position_ids, generator=torch.Generator().manual_seed(seed),
    )
    seq_len = loss_mask.shape[1]
    expected = set()
    for row in range(loss_mask.shape[0]):
        for slot, p in enumerate(plan.anchors[row].tolist()):
            for k in range(1, block_size):
                if plan.label_valid[row, slot, k - 1]:
                    expected.add(row * seq_len + p + k - 1)
    assert plan.teacher_index.tolist() == sorted(expected)


def test_sampling_is_uniform_enough_and_seeded():
    loss_mask = torch.ones(1, 200, dtype=torch.bool)
    first = plan_blocks(loss_mask_BT=loss_mask, num_anchors=20, block_size=4, generator=torch.Generator().manual_seed(1))
    again = plan_blocks(loss_mask_BT=loss_mask, num_anchors=20, block_size=4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first.anchors, again.anchors)
    counts = torch.zeros(200)
    generator = torch.Generator().manual_seed(2)
    for _ in range(300):
        plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=20, block_size=4, generator=generator)
        counts[plan.anchors[0]] += 1
    eligible = counts[1:199]  # the last token has no next token to learn; the first has no context
    assert counts[0] == 0 and counts[199] == 0
    assert eligible.min() > 5 and eligible.max() < 65  # expected 300 * 20 / 198 ~ 30


def test_blocks_may_run_past_the_end_of_a_response():
    """The end-of-turn token is learned at every slot: anchors reach the last loss token but one,
    and slots past the document get no label (the next document's prompt is never a label)."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=12, block_size=4, position_ids_BT=position_ids)
    assert plan.anchors[plan.anchor_valid].tolist() == [2, 3, 4, 8, 9, 10]
    by_anchor = dict(zip(plan.anchors[0].tolist(), plan.label_valid[0].tolist()))
    assert by_anchor[4] == [True, False, False]  # token 5 ends document 0; 6, 7 belong to document 1
    assert by_anchor[10] == [True, False, False]  # token 11 ends the row


def test_document_ids_from_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 5, 6]])
    assert document_ids_from_positions(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]


def test_short_rows_have_no_anchors_and_bad_inputs_raise():
    eligible = eligible_anchor_positions(
        loss_mask_BT=torch.ones(1, 2, dtype=torch.bool), document_ids_BT=torch.zeros(1, 2, dtype=torch.long), block_size=4
    )
    assert not eligible.any()
    with pytest.raises(ValueError, match="num_anchors"):
        plan_blocks(loss_mask_BT=torch.ones(1, 8), num_anchors=0, block_size=2)
    with pytest.raises(ValueError, match="batch, seq"):
        plan_blocks(loss_mask_BT=torch.ones(8), num_anchors=1, block_size=2)
