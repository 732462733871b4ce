"""Packed rows on a hybrid (Gated DeltaNet) target: each document gets the states it gets alone.

Run: .venv/bin/python -m pytest tests/unit/test_hybrid_packing.py -q
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_core.target.gdn_packing import _packed_conv, _packed_rule, packed_documents, packed_segments, segment_starts
from dflash_core.target import HiddenStateCapture, build_target, language_model, tiny_target_config, validate_capture


_LENGTHS = [37, 5, 70, 1, 20]  # one-token document, then a document right after it
_PADDING = 11
_LAYERS = [0, 2, 3, 4]  # GDN, GDN, full attention, GDN


def _row(vocab_size: int, generator: torch.Generator):
    documents = [torch.randint(1, vocab_size, (1, n), generator=generator) for n in _LENGTHS]
    input_ids = torch.cat(documents + [torch.zeros(1, _PADDING, dtype=torch.long)], dim=1)
    position_ids = torch.cat([torch.arange(n) for n in _LENGTHS] + [torch.zeros(_PADDING, dtype=torch.long)])[None]
    return documents, input_ids, position_ids


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(0)
    config = tiny_target_config("qwen3_5", num_layers=8)
    target = build_target(config)
    capture = HiddenStateCapture(target, layer_ids=_LAYERS, capture_final=True)
    documents, input_ids, position_ids = _row(config.vocab_size, torch.Generator().manual_seed(1))
    return target, config, capture, documents, input_ids, position_ids


def test_segments_restart_at_documents_and_keep_padding_together():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 0, 0]])
    assert segment_starts(positions).tolist() == [[True, False, False, True, True, False, True, False, False]]
    segments = packed_segments(torch.cat([positions, torch.tensor([[0, 1, 0, 1, 2, 3, 4, 0, 0]])]))
    assert segments.bounds == (((0, 3), (3, 4), (4, 6), (6, 9)), ((0, 2), (2, 7), (7, 9)))
    assert segments.cu_seqlens.tolist() == [0, 3, 4, 6, 9, 11, 16, 18]


def test_packed_row_equals_each_document_alone(hybrid):
    _, _, capture, documents, input_ids, position_ids = hybrid
    assert capture.gdn_kernels is not None and capture.gdn_kernels.recurrence == "torch"
    packed = capture(input_ids, position_ids=position_ids)
    start = 0
    for document in documents:
        end = start + document.shape[1]
        alone = capture(document, position_ids=torch.arange(document.shape[1])[None])
        torch.testing.assert_close(packed.tapped_hidden[:, start:end], alone.tapped_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(packed.final_hidden[:, start:end], alone.final_hidden, atol=1e-4, rtol=1e-4)
        start = end


def test_without_the_segments_state_leaks_into_the_next_document(hybrid):
    target, _, capture, documents, input_ids, position_ids = hybrid
    with torch.no_grad():
        leaky = language_model(target)(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    alone = capture(documents[2], position_ids=torch.arange(documents[2].shape[1])[None])
    start = sum(_LENGTHS[:2])
    gap = (leaky.last_hidden_state[:, start:start + _LENGTHS[2]] - language_model(target).norm(alone.final_hidden))
    assert gap.abs().max() > 1e-2  # the test above would catch a leak


def test_two_rows_match_one_row_each(hybrid):
    _, config, capture, _, input_ids, position_ids = hybrid
    _, other_ids, other_positions = _row(config.vocab_size, torch.Generator().manual_seed(2))
    other_positions = torch.cat([torch.zeros(1, _PADDING, dtype=torch.long),
                                 torch.cat([torch.arange(n) for n in reversed(_LENGTHS)])[None]], dim=1)
    both = capture(torch.cat([input_ids, other_ids]), position_ids=torch.cat([position_ids, other_positions]))
    for row, (ids, positions) in enumerate([(input_ids, position_ids), (other_ids, other_positions)]):
        single = capture(ids, position_ids=positions)
        torch.testing.assert_close(both.tapped_hidden[row:row + 1], single.tapped_hidden, atol=1e-4, rtol=1e-4)


def test_conv_restarts_at_every_document():
    """The conv alone: a packed call equals per-document calls, and without the segments the last
    kernel_width - 1 tokens of one document reach the next (the bug of passing cu_seqlens to the
    recurrence only)."""
    torch.manual_seed(0)
    conv = _packed_conv(_reference_conv)
    weight = torch.randn(6, 4)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 0]])
    x = torch.randn(1, 6, positions.shape[1])
    with packed_documents(positions):
        packed = conv(x, weight, None, activation="silu")
    for start, end in [(0, 5), (5, 8), (8, 12)]:
        torch.testing.assert_close(packed[..., start:end], _reference_conv(x[..., start:end], weight, None, "silu"))
    leaky = _reference_conv(x, weight, None, "silu")
    assert not torch.allclose(leaky[..., 5:8], packed[..., 5:8])
    torch.testing.assert_close(conv(x, weight, None, activation="silu"), leaky)  # no segments: unchanged


def test_recurrence_restarts_at_every_document():
    calls = []

    def cumulative_rule(query, key, value, **kwargs):  # a recurrence that carries everything forward
        calls.append(query.shape[1])
        return value.cumsum(dim=1) + kwargs["g"][..., None], None

    rule = _packed_rule(cumulative_rule, varlen=False)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0]])
    value = torch.ones(1, 7, 2, 3)
    with packed_documents(positions):
        out, _ = rule(value, value, value, g=torch.zeros(1, 7, 2), beta=torch.ones(1, 7, 2))
    assert calls == [3, 2, 2]
    assert out[0, :, 0, 0].tolist() == [1, 2, 3, 1, 2, 1, 2]


def test_varlen_recurrence_gets_the_flattened_rows_and_their_cu_seqlens():
    """The fla path: one call over the rows flattened to batch 1, `cu_seqlens` (and its host copy)
    marking every document; a stand-in kernel that honours cu_seqlens as fla's does."""
    seen = {}

    def varlen_rule(query, key, value, *, g, beta, cu_seqlens, cu_seqlens_cpu, **kwargs):
        seen.update(batch=query.shape[0], cu=cu_seqlens.tolist(), cu_cpu=cu_seqlens_cpu.tolist())
        out = torch.cat([value[:, s:e].cumsum(dim=1) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])], dim=1)
        return out + g[..., None], None

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 1, 0, 1, 2, 3, 4]])
    value = torch.arange(1, 15, dtype=torch.float).reshape(2, 7, 1, 1).expand(2, 7, 2, 3)
    with packed_documents(positions):
        out, _ = _packed_rule(varlen_rule, varlen=True)(value, value, value, g=torch.zeros(2, 7, 2),
                                                         beta=torch.ones(2, 7, 2), cu_seqlens=None)
    assert seen == {"batch": 1, "cu": [0, 3, 5, 7, 9, 14], "cu_cpu": [0, 3, 5, 7, 9, 14]}
    assert out.shape == value.shape
    assert out[:, :, 0, 0].tolist() == [[1, 3, 6, 4, 9, 6, 13], [8, 17, 10, 21, 33, 46, 60]]


def test_validator_checks_gdn_outputs_per_document(hybrid):
    target, config, capture, _, input_ids, position_ids = hybrid
    captured = capture(input_ids, position_ids=position_ids, gdn_summary=True)
    gdn_layers = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    assert sorted(captured.gdn_document_means) == gdn_layers  # capture_final: the whole stack ran
    assert captured.gdn_document_means[0].shape == (4, config.hidden_size)  # documents of >= 2 tokens
    validate_capture(captured, input_ids=input_ids, hidden_size=config.hidden_size)

    out_proj = language_model(target).layers[4].linear_attn.out_proj
    saved = out_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            out_proj.weight.zero_()
        zeroed = capture(input_ids, position_ids=position_ids, gdn_summary=True)
        with pytest.raises(ValueError, match="GDN .*layer 4: output is all zero"):
            validate_capture(zeroed, input_ids=input_ids, hidden_size=config.hidden_size)
    finally:
        with torch.no_grad():
            out_proj.weight.copy_(saved)

    same = capture(input_ids, position_ids=position_ids, gdn_summary=True)
    same.gdn_document_means[1] = same.gdn_document_means[1][:1].expand(4, -1).clone()
    with pytest.raises(ValueError, match="layer 1: output is the same for every document"):
        validate_capture(same, input_ids=input_ids, hidden_size=config.hidden_size)


def _reference_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
    """A plain causal depthwise conv, the shape of transformers' torch fallback."""
    width = weight.shape[-1]
    out = F.conv1d(hidden_states, weight[:, None], bias, padding=width - 1, groups=weight.shape[0])
    out = out[..., : hidden_states.shape[-1]]
    return F.silu(out) if activation == "silu" else out


@pytest.mark.slow  # flex attention compiled on a CPU (~5 s)
def test_flex_attention_opt_in_keeps_each_document_exact():
    """Qwen3.5 lacks transformers' flex flag only; opted in, the packed row's attention layers skip
    the other documents' blocks and each document still gets its states alone (flex on CPU)."""
    from dflash_core.target.runtime import use_flex_attention

    torch.manual_seed(0)
    config = tiny_target_config("qwen3_5", num_layers=4)
    target = build_target(config)
    assert not type(target)._supports_flex_attn  # the class flag this opts around
    assert use_flex_attention(target) is None
    assert (getattr(config, "text_config", None) or config)._attn_implementation == "flex_attention"
    capture = HiddenStateCapture(target, layer_ids=[0, 3], capture_final=True)
    # Two documents of one length: flex compiles once per shape, and CPU compiles are slow.
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(1, config.vocab_size, (1, 24), generator=generator) for _ in range(2)]
    packed = capture(torch.cat(documents, dim=1), position_ids=torch.arange(24).repeat(2)[None])
    for index, document in enumerate(documents):
        alone = capture(document, position_ids=torch.arange(24)[None])
        rows = slice(24 * index, 24 * (index + 1))
        torch.testing.assert_close(packed.final_hidden[:, rows], alone.final_hidden, atol=1e-4, rtol=1e-4)


def test_flex_attention_refused_with_the_reason_when_layers_bypass_the_interface(monkeypatch):
    from dflash_core.target import runtime as target_module

    config = tiny_target_config("qwen3_5", num_layers=4)
    target = build_target(config)
    monkeypatch.setattr(target_module, "_calls_attention_interface", lambda model: False)
    reason = target_module.use_flex_attention(target)
    assert reason is not None and "flex_attention" in reason
    assert not getattr(target, "_supports_flex_attn")
