"""Where a speculative output leaves the target's greedy output, and whether that is a near-tie.

Speculative decoding emits exactly the target's greedy tokens in exact arithmetic. In bf16 the verify
pass (B tokens in one forward) and a one-token step round differently, so where the target's two best
logits lie within a few units in the last place (ulps) of each other, the two paths can pick different
tokens; from there the outputs differ, while both are the target's own greedy choices within its
precision. Measured on SmolLM2-135M in bf16 (2026-12-04): the margins at such divergences were 0 to 1
ulp of the top logit, in both directions.

A divergence is judged once, at the first token where the outputs differ: one eager forward of the
target over the prompt and the common prefix gives its logits there; the margin is
logit(greedy token) - logit(speculative token). Within `TIE_ULPS` ulps of the top logit (in the target's
dtype) it is a near-tie; otherwise the speculative path chose a token the target does not, which is a
bug to report. In fp32 the tolerance is ~1e-6 of the logit: any real divergence shows.
"""

from __future__ import annotations

import dataclasses
import math

import torch

TIE_ULPS = 4  # the bf16 divergences measured were within 1 ulp; 4 leaves room for deeper targets' rounding


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first new-token index where the outputs differ; margin: logit(greedy) - logit(speculative) there
    (None when one output only ends earlier); tolerance: TIE_ULPS ulps of the top logit there."""

    index: int
    margin: float | None
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.margin is not None and abs(self.margin) <= self.tolerance

    def as_dict(self) -> dict:
        return {"index": self.index, "margin": self.margin, "tolerance": self.tolerance, "near_tie": self.near_tie}


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at `value` (at 1.0 for values below it)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(value), 1.0)))


@torch.no_grad()
def first_divergence(target: torch.nn.Module, prompt: list[int], *, greedy: list[int], decoded: list[int],
                     tie_ulps: int = TIE_ULPS) -> Divergence | None:
    """None when `decoded` equals `greedy`; else where and by how much they part (module docstring)."""
    if decoded == greedy:
        return None
    index = next((i for i, (a, b) in enumerate(zip(greedy, decoded)) if a != b), None)
    if index is None:
        return Divergence(index=min(len(greedy), len(decoded)), margin=None, tolerance=0.0)
    device = next(target.parameters()).device
    ids = torch.tensor([prompt + greedy[:index]], device=device)
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1]
    top = float(logits.max())
    margin = float(logits[greedy[index]]) - float(logits[decoded[index]])
    return Divergence(index=index, margin=margin, tolerance=tie_ulps * ulp(top, logits.dtype))
