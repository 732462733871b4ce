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

import functools

import torch
from torch import nn

from dflash_core.model.topk import grouped_topk

FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max  # 448
GRAD_FP8 = torch.float8_e5m2  # gradients: e5m2's range keeps the small softmax terms e4m3 would flush to 0
ARGMAX_CANDIDATES = 16  # Fp8LMHead.argmax: FP8's top-16 logits re-scored exactly (0 label changes measured on CPU)
_ALIGN = 16
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


@functools.cache
def _compiled_quantize_rows():
    """`quantize_rows` torch.compile'd: one reduction and one cast pass over the rows, where eager makes fp32
    temporaries of them (a [2,048, 152K] gradient chunk is 1.2 GB in fp32). For the loss's gradient chunks
    only, whose shape is the same every step: the teacher's row count changes each step, and a static-shape
    compile would recompile for each until dynamo's limit sends it back to eager."""
    return torch.compile(quantize_rows, dynamic=False)


def _quantize_blocked(x: torch.Tensor, *, block_rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` a block of rows at a time: a whole [V, H] head (or its transpose) in fp32 at once is
    4 bytes a parameter of temporaries (~5 GiB for Qwen3.5's head) beside the target still in memory."""
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], block_rows):
        out[start:start + block_rows], scales[start:start + block_rows] = quantize_rows(x[start:start + block_rows])
    return out, scales


class Fp8LMHead(nn.Module):
    """The target's frozen LM head, for the drafter's loss with its two GEMMs in FP8 (`TrainConfig.lm_head_fp8`).

    The loss computes, a chunk of rows at a time, logits = hidden @ W.T and the gradient grad_logits @ W
    (`dflash_core.model.loss`, `dflash2_loss`). Here both run through `torch._scaled_mm`: the logits from
    e4m3 hidden rows (a scale per row) and an e4m3 copy of W scaled per vocabulary row; the gradient from
    e5m2 gradient rows (softmax terms far below a row's largest, which e4m3 would flush to zero) and an e4m3
    copy of W scaled per hidden column, stored transposed so it is the column-major operand the GEMM takes.
    Both copies are made once (W is frozen): 2 bytes per LM-head parameter beside the bf16 weight, which
    stays for everything else that reads the head (calling the module: drafting; the selector's candidate
    rows; a KL teacher's logits), so those keep their precision. The teacher's labels (`argmax`) take FP8's
    top candidates and re-score them on the exact rows."""

    def __init__(self, weight_VH: torch.Tensor) -> None:
        super().__init__()
        if weight_VH.dim() != 2 or weight_VH.shape[0] % _ALIGN or weight_VH.shape[1] % _ALIGN:
            raise ValueError(f"lm_head_fp8 needs an LM head whose vocabulary and width are multiples of {_ALIGN} "
                             f"(the FP8 GEMM's alignment), got {tuple(weight_VH.shape)}; set lm_head_fp8: false")
        self.weight = weight_VH.detach()  # the target's own tensor, not copied and not a parameter of ours
        logits_weight, logits_scale = _quantize_blocked(self.weight)
        self.logits_weight, self.logits_scale = logits_weight, logits_scale.reshape(1, -1)  # [V, H], [1, V]
        grad_weight_t, grad_scale = _quantize_blocked(self.weight.t())
        self.grad_weight_t, self.grad_scale = grad_weight_t, grad_scale.reshape(1, -1)  # [H, V], [1, H]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.weight.dtype) @ self.weight.T  # the exact head, for every caller but the loss

    def logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] @ W.T in FP8 -> [N, V] in W's dtype."""
        rows, scale = quantize_rows(hidden_NH)  # [N, H]: small beside the GEMM
        return torch._scaled_mm(rows, self.logits_weight.t(), scale_a=scale, scale_b=self.logits_scale,
                                out_dtype=torch.bfloat16).to(self.weight.dtype)

    def grad_input(self, grad_NV: torch.Tensor) -> torch.Tensor:
        """grad_logits [N, V] @ W in FP8 -> [N, H] in W's dtype."""
        rows, scale = (_compiled_quantize_rows() if grad_NV.is_cuda else quantize_rows)(grad_NV, GRAD_FP8)
        return torch._scaled_mm(rows, self.grad_weight_t.t(), scale_a=scale, scale_b=self.grad_scale,
                                out_dtype=torch.bfloat16).to(self.weight.dtype)

    def argmax(self, hidden_NH: torch.Tensor, *, candidates: int = ARGMAX_CANDIDATES) -> torch.Tensor:
        """The head's argmax per row [N] (the teacher's labels): the FP8 logits' top `candidates`, re-scored on the
        exact head rows and rounded to the head's dtype, ties to the lowest token id, as `argmax` over the head's
        own logits breaks them. It is that argmax unless it falls outside FP8's top `candidates` (a row with that
        many logits within FP8's rounding of its best) or a different order of summation rounds differently."""
        hidden = hidden_NH.to(self.weight.dtype)
        _, ids = grouped_topk(self.logits(hidden), min(candidates, self.weight.shape[0]))
        exact = torch.einsum("nh,nkh->nk", hidden, self.weight[ids])  # as the head's GEMM: fp32 sums, its dtype out
        best = exact == exact.amax(dim=-1, keepdim=True)
        return torch.where(best, ids, self.weight.shape[0]).amin(dim=-1)

    def extra_repr(self) -> str:
        vocab, width = self.weight.shape
        return f"vocab={vocab}, width={width}, loss GEMMs in fp8"


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
            if child.in_features % _ALIGN or child.out_features % _ALIGN or narrow:
                kept += 1
                continue
            setattr(parent, name, Fp8Linear(child, fast_accum=fast_accum))
            quantized += 1
    return quantized, kept
