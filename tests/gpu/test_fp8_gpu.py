"""FP8 target GEMMs on CUDA (row-wise torch._scaled_mm, compute capability >= 9.0): the GEMM of the
quantized operands, eager and compiled, and a tiny quantized target close to its bf16 self.
Skipped without such a GPU.

Run (H100/H200): python3 -m pytest tests/gpu/test_fp8_gpu.py -q
(on a machine without pydantic add --noconftest: the shared conftest imports the settings)
"""

import pytest
import torch
from torch import nn

from dflash_core.fp8.target import Fp8Linear, quantize_rows, supports_fp8
from dflash_core.target import (
    HiddenStateCapture, build_target, tiny_target_config,
)
from dflash_core.target.runtime import compile_decoder_layers, quantize_decoder_layers_fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or supports_fp8(torch.device("cuda")) is not None,
                                reason="needs a GPU with row-wise FP8 GEMMs (compute capability >= 9.0)")


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_linear_on_cuda_is_the_gemm_of_its_quantized_operands(compiled):
    torch.manual_seed(0)
    linear = nn.Linear(512, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear(linear)
    forward = torch.compile(fp8.forward, dynamic=False) if compiled else fp8.forward
    with torch.no_grad():
        got = forward(x)
        x_fp8, x_scale = quantize_rows(x.reshape(-1, 512))
        w_fp8, w_scale = quantize_rows(linear.weight)
        want = (x_fp8.double() * x_scale.double()) @ (w_fp8.double() * w_scale.double()).T
    assert got.dtype == torch.bfloat16 and got.shape == (2, 300, 1024)
    assert _relative_error(got.reshape(-1, 1024), want) < 1e-2
    assert _relative_error(got, linear(x)) < 0.06


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_quantized_compiled_target_stays_close_on_cuda(family):
    torch.manual_seed(0)
    config = tiny_target_config(family, num_layers=4, hidden_size=256, vocab_size=2048, initializer_range=0.02)
    target = build_target(config, device="cuda", dtype=torch.bfloat16)
    input_ids = torch.randint(1, 2048, (1, 512), device="cuda")
    capture = HiddenStateCapture(target, layer_ids=[0, 2], capture_final=True)
    reference = capture(input_ids)
    assert quantize_decoder_layers_fp8(target)[0] > 0
    eager = capture(input_ids)
    compile_decoder_layers(target)
    got = capture(input_ids)
    # Compiling (fused quantization, fla's kernels on qwen3_5) rounds differently, and a scale or an
    # e4m3 step that moves shifts whole rows: compiled vs eager FP8 measured 4.3% (qwen3) and 5.1%
    # (qwen3_5) at the taps on an H200, as far apart as FP8 from bf16 per GEMM...
    assert _relative_error(got.tapped_hidden, eager.tapped_hidden) < 0.1
    assert _relative_error(got.final_hidden, eager.final_hidden) < 0.1
    # ...and e4m3's drift from bf16 stays bounded. At this random shape it is 7-10% after 4 layers
    # (measured on CPU too: qwen3 7.9%, qwen3_5 10.3% at the final state), so the bound is 15%.
    assert _relative_error(got.tapped_hidden, reference.tapped_hidden) < 0.15
    assert _relative_error(got.final_hidden, reference.final_hidden) < 0.15
