"""FP8 GEMMs for the frozen target's forward (opt-in: `TrainConfig.target_fp8: true`).

The target only runs forward, and its GEMMs are most of a training step (the Qwen3.5-27B hybrid's
target forward is ~70% of it, at ~650 TFLOP/s in bf16 on an H200). FP8 e4m3 with row-wise scales
(one per token of the input, one per output channel of the weight: the "FP8 dynamic" scheme serving
engines use for FP8 checkpoints) runs those GEMMs through `torch._scaled_mm`, and stores the
weights in half the memory. The tapped states then come from an FP8 target: what a drafter for an
FP8-served target should learn from, and close to, not equal to, the bf16 target's.

Only the decoder layers' linears are quantized; the embedding and the LM head stay as loaded (the
drafter reads the LM head's weight for its loss, and the teacher's logits come from it). A linear
whose input or output width is not a multiple of 16 (the FP8 GEMM's alignment) keeps its dtype, and
so does a narrow one (fewer outputs than min(256, its inputs), e.g. a 27B GDN layer's 48-wide gate
projections of a 5,120-wide input): its GEMM is bound by reading the input, which quantizing would
read once more.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max  # 448
ALIGN = 16  # _scaled_mm's operand widths
_MIN_OUT_FEATURES = 256


def supports_fp8(device: torch.device) -> str | None:
    """None when row-wise FP8 GEMMs run on `device`; otherwise why not."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 target GEMMs run on CUDA (compute capability >= 9.0) or CPU, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        return (f"row-wise FP8 GEMMs need compute capability >= 9.0 (H100/H200 or newer); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")
    return None


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x in FP8 `dtype`, fp32 scales [M, 1]) with x ~= fp8 * scale, each row scaled to its max."""
    top = torch.finfo(dtype).max
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / top
    # row-major whatever x's strides: _scaled_mm takes its first operand row-major only
    return (x.float() / scale).clamp(-top, top).to(dtype).contiguous(), scale


class Fp8Linear(nn.Module):
    """A frozen nn.Linear whose GEMM runs in FP8: weight [N, K] quantized per output channel once,
    the input per row at every call; the output in the input's dtype. `fast_accum`: the GEMM's
    `use_fast_accum` (Hopper accumulates in reduced precision between its periodic promotions to fp32:
    faster, less exact)."""

    def __init__(self, linear: nn.Linear, *, fast_accum: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fast_accum = fast_accum
        weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("weight_scale", scale.reshape(1, -1))  # [1, N]: _scaled_mm's row-wise scale_b
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        x_fp8, x_scale = quantize_rows(rows)
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype  # CUDA's row-wise FP8 GEMM writes bf16
        y = torch._scaled_mm(x_fp8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale,
                             out_dtype=out_dtype, use_fast_accum=self.fast_accum).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves the FP8 weight and its scales; a dtype change (`.half()`, `.to(bf16)`)
        leaves them as they are (they are the quantization, not the module's compute dtype)."""
        kept = {name: self._buffers.pop(name) for name in ("weight_fp8", "weight_scale")}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in kept.items():
                device = fn(torch.empty(0, dtype=buffer.dtype, device=buffer.device)).device
                self._buffers[name] = buffer.to(device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8" + (
            ", fast_accum" if self.fast_accum else "")


def quantize_linears(module: nn.Module, *, fast_accum: bool = False) -> tuple[int, int]:
    """Replace every nn.Linear under `module` whose widths are multiples of 16 and that is not narrow
    (module docstring) by an Fp8Linear, in place (the original weights are freed). Returns (quantized,
    kept)."""
    quantized = kept = 0
    # Hold the parents only: a list of every module would keep each replaced bf16 linear alive until
    # the end, a peak of the whole bf16 target plus its FP8 copy (+11 GiB measured on the 27B hybrid).
    parents = [m for m in module.modules() if type(m) is not nn.Linear]
    for parent in parents:
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            narrow = child.out_features < min(_MIN_OUT_FEATURES, child.in_features)
            if child.in_features % ALIGN or child.out_features % ALIGN or narrow:
                kept += 1
                continue
            setattr(parent, name, Fp8Linear(child, fast_accum=fast_accum))
            quantized += 1
    return quantized, kept
