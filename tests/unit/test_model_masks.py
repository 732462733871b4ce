"""Training attention masks: flex mask_mod, dense SDPA mask and the loop reference agree.

Run: .venv/bin/python -m pytest tests/unit/test_model_masks.py -q
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_core.model.anchors import plan_blocks
from dflash_core.model import masks
from dflash_core.model.masks import (
    create_flex_block_mask,
    dense_mask,
    drafting_mask,
    flex_attend,
    tuned_flex_options,
    reference_dense_mask,
    resolve_attention_backend,
    sdpa_attend,
)

_SEQ = 48
_BLOCK = 4


def _packed_plan(*, num_anchors: int, seed: int = 0):
    """Two rows: row 0 packs three documents (positions reset), row 1 is one document with a
    partial loss mask."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.cat((torch.arange(20), torch.arange(12), torch.arange(16)))
    position_ids = torch.stack((positions, torch.arange(_SEQ)))
    loss_mask = torch.ones(2, _SEQ, dtype=torch.bool)
    loss_mask[1, :10] = False
    return plan_blocks(
        loss_mask_BT=loss_mask,
        num_anchors=num_anchors,
        block_size=_BLOCK,
        position_ids_BT=position_ids,
        generator=generator,
    )


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("num_anchors", [3, 40])  # 40 > eligible positions: padded, invalid anchors
def test_dense_mask_matches_reference_element_by_element(window, num_anchors):
    plan = _packed_plan(num_anchors=num_anchors)
    assert plan.anchor_valid.all() == (num_anchors == 3)
    assert torch.equal(dense_mask(plan, sliding_window=window)[:, 0], reference_dense_mask(plan, sliding_window=window))


def test_mask_never_crosses_documents_or_blocks():
    plan = _packed_plan(num_anchors=10)
    mask = reference_dense_mask(plan)
    for row in range(2):
        for slot in range(plan.num_anchors):
            rows = mask[row, slot * _BLOCK : (slot + 1) * _BLOCK]
            context_seen = rows[:, :_SEQ].any(dim=0).nonzero().flatten()
            anchor = int(plan.anchors[row, slot])
            if len(context_seen):
                assert context_seen.max() < anchor
                assert (plan.document_ids[row, context_seen] == plan.document_ids[row, anchor]).all()
            blocks_seen = rows[:, _SEQ:].any(dim=0).nonzero().flatten() // _BLOCK
            assert blocks_seen.tolist() == [slot] * _BLOCK  # its own block, all of it
            assert rows[:, _SEQ:][:, slot * _BLOCK : (slot + 1) * _BLOCK].all()  # non-causal within


def test_block_mask_covers_every_visible_element():
    plan = _packed_plan(num_anchors=12)
    block_mask = create_flex_block_mask(plan, sliding_window=None, compile_mask=False)
    reference = reference_dense_mask(plan)
    blocks = block_mask.to_dense()[:, 0].bool()  # [B, q_blocks, kv_blocks]
    q_block, kv_block = block_mask.BLOCK_SIZE
    for row in range(2):
        visible = reference[row].nonzero()
        assert blocks[row, visible[:, 0] // q_block, visible[:, 1] // kv_block].all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 8])
def test_flex_and_sdpa_attention_agree_forward(window):
    torch.manual_seed(0)
    plan = _packed_plan(num_anchors=10)
    q_len = plan.num_anchors * _BLOCK
    query = torch.randn(2, 4, q_len, 16)
    key = torch.randn(2, 2, _SEQ + q_len, 16)  # GQA: 4 query heads over 2 kv heads
    value = torch.randn(2, 2, _SEQ + q_len, 16)
    block_mask = create_flex_block_mask(plan, sliding_window=window, compile_mask=False)
    with torch.no_grad():  # flex_attention has no backward on CPU
        flex_out = flex_attend(block_mask, compiled=False)(query, key, value)
    sdpa_out = sdpa_attend(dense_mask(plan, sliding_window=window))(query, key, value)
    torch.testing.assert_close(flex_out, sdpa_out, atol=1e-5, rtol=1e-5)
    explicit = F.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1),
        attn_mask=reference_dense_mask(plan, sliding_window=window)[:, None],
    )
    torch.testing.assert_close(sdpa_out, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("capability, head_dim, tuned", [((9, 0), 256, True), ((9, 0), 192, True),
                                                       ((9, 0), 128, False), ((10, 0), 256, False), ((8, 0), 256, False)])
def test_the_tuned_backward_is_for_wide_heads_on_hopper_only(monkeypatch, capability, head_dim, tuned):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    options = tuned_flex_options(head_dim, torch.device("cuda", 0))
    assert (options is not None) == tuned
    if tuned:
        assert options == {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                           "bwd_num_stages": 2, "bwd_num_warps": 8}


def test_tuned_options_go_to_flex_for_16_bit_inputs_only(monkeypatch):
    assert tuned_flex_options(256, torch.device("cpu")) is None  # CPU: torch's defaults
    calls = []
    monkeypatch.setattr(masks, "_flex_attention", lambda compiled: lambda *args, **kwargs: calls.append(kwargs))
    options = {"bwd_BLOCK_M1": 64}
    attend = flex_attend("a block mask", compiled=True, kernel_options=options)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        attend(torch.zeros(1, 4, 8, 16, dtype=dtype), torch.zeros(1, 2, 8, 16, dtype=dtype), None)
    # fp32 tiles of a config tuned for 16-bit inputs may not fit in shared memory: fp32 keeps the defaults
    assert [call.get("kernel_options") for call in calls] == [None, options, options]
    assert all(call["block_mask"] == "a block mask" and call["enable_gqa"] for call in calls)


def test_window_smaller_than_block_is_rejected():
    with pytest.raises(ValueError, match="sliding_window"):
        dense_mask(_packed_plan(num_anchors=2), sliding_window=_BLOCK - 1)


def test_drafting_mask_windows_only_context():
    assert drafting_mask(context_len=10, block_size=4, first_position=10, sliding_window=None, device="cpu") is None
    mask = drafting_mask(context_len=10, block_size=4, first_position=10, sliding_window=6, device="cpu")[0, 0]
    # Query slot k sits at 10 + k and sees context j with (10 + k) - j < 6.
    assert mask[0, :10].nonzero().flatten().tolist() == [5, 6, 7, 8, 9]
    assert mask[3, :10].nonzero().flatten().tolist() == [8, 9]
    assert mask[:, 10:].all()


def test_the_attention_setting_resolves_to_flex_on_a_gpu_and_the_dense_path_elsewhere():
    assert [resolve_attention_backend("auto", cuda=cuda) for cuda in (True, False)] == ["flex", "sdpa"]
    assert [resolve_attention_backend(name, cuda=True) for name in ("flex", "sdpa")] == ["flex", "sdpa"]
    with pytest.raises(ValueError, match="attention_backend must be 'flex', 'sdpa' or 'auto', got 'dense'"):
        resolve_attention_backend("dense", cuda=True)
