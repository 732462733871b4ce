"""Packed hybrid (Gated DeltaNet) rows on flash-linear-attention's kernels: each document gets the
states it gets alone, fla's conv equals transformers' torch conv, and the capture says fla ran.
Skipped without CUDA or without fla (the `gpu` extra).

Run (CUDA machine, fla installed): python3 -m pytest tests/gpu/test_hybrid_fla_gpu.py -q
(on a machine without pydantic add --noconftest: the shared conftest imports the settings)
"""

import importlib.util
import sys

import pytest
import torch

from dflash_core.target.gdn_packing import _original, _packed_conv, packed_documents
from dflash_core.target import HiddenStateCapture, build_target, language_model, tiny_target_config

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (gpu extra)"),
]

_LENGTHS = [300, 7, 640, 1, 129]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(0)
    config = tiny_target_config("qwen3_5", num_layers=8, hidden_size=256, vocab_size=2048)
    config.linear_key_head_dim = config.linear_value_head_dim = 64  # a head shape fla's kernels tile
    target = build_target(config, device="cuda", dtype=torch.bfloat16)
    capture = HiddenStateCapture(target, layer_ids=[0, 2, 4, 6], capture_final=True)
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(1, config.vocab_size, (1, n), generator=generator).cuda() for n in _LENGTHS]
    padding = 2048 - sum(_LENGTHS)
    input_ids = torch.cat(documents + [torch.zeros(1, padding, dtype=torch.long, device="cuda")], dim=1)
    positions = torch.cat([torch.arange(n) for n in _LENGTHS] + [torch.zeros(padding, dtype=torch.long)])[None]
    return target, capture, documents, input_ids, positions


def test_fla_runs_the_recurrence_and_the_conv(hybrid):
    _, capture, _, _, _ = hybrid
    kernels = capture.gdn_kernels
    assert (kernels.recurrence, kernels.conv) == ("fla", "fla"), str(kernels)


def test_packed_row_equals_each_document_alone_on_fla(hybrid):
    _, capture, documents, input_ids, positions = hybrid
    packed = capture(input_ids, position_ids=positions.cuda(), host_position_ids=positions)
    start = 0
    for document in documents:
        end = start + document.shape[1]
        alone = capture(document, position_ids=torch.arange(document.shape[1], device="cuda")[None])
        for got, want in [(packed.tapped_hidden[:, start:end], alone.tapped_hidden),
                          (packed.final_hidden[:, start:end], alone.final_hidden)]:
            assert _relative_error(got, want) < 2e-2, (document.shape[1], _relative_error(got, want))
        start = end


def test_fla_conv_equals_the_torch_conv_per_document(hybrid):
    target, _, _, _, positions = hybrid
    source = sys.modules[type(language_model(target).layers[0].linear_attn).__module__]
    original = _original(source.causal_conv1d_fn)
    torch.manual_seed(0)
    x = torch.randn(1, positions.shape[1], 96, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # as transformers
    weight = torch.randn(96, 4, device="cuda", dtype=torch.bfloat16)
    with packed_documents(positions, device=torch.device("cuda")):
        packed = _packed_conv(original)(x, weight, None, activation="silu")
    start = 0
    for length in _LENGTHS:
        want = original(x[..., start:start + length].contiguous(), weight, None, activation="silu")
        assert _relative_error(packed[..., start:start + length], want) < 1e-2
        start += length
