"""The target's frozen LM head for the drafter's loss with its GEMMs in FP8 (opt-in: `TrainConfig.lm_head_fp8`).

The row-wise quantization is `dflash_core.fp8.target`'s, the one the target's FP8 layers use; this module adds what the
loss needs beside it: an e5m2 gradient (its range keeps the small softmax terms e4m3 would flush to zero), a
second copy of the head laid out for the gradient's GEMM, and labels re-scored on the exact head.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dflash_core.fp8.target import ALIGN, FP8, quantize_rows
from dflash_core.model.topk import grouped_topk

GRAD_FP8 = torch.float8_e5m2
ARGMAX_CANDIDATES = 16  # Fp8LMHead.argmax: FP8's top-16 logits re-scored exactly (0 label changes measured on CPU)


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
        if weight_VH.dim() != 2 or weight_VH.shape[0] % ALIGN or weight_VH.shape[1] % ALIGN:
            raise ValueError(f"lm_head_fp8 needs an LM head whose vocabulary and width are multiples of {ALIGN} "
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
