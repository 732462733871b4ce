"""How many anchors a packed row gets when a run does not say: a fixed density per token of the row,
so the drafter's query tokens (anchors x block_size), its memory and its step time follow
`token_budget`. Torch-free, so the planner reads the same constant."""

from __future__ import annotations

# 512 anchors per 2,048 tokens (2,048 at the default 8,192-token budget): the density of the default recipe
# in bench/acceptance/, where it beat 128 per 2,048 (speculators' 512 per 8,192) for every variant.
ANCHORS_PER_1024_TOKENS = 256


def default_num_anchors(token_budget: int) -> int:
    """Anchors per packed row of `token_budget` tokens at ANCHORS_PER_1024_TOKENS (at least one)."""
    return max(1, token_budget * ANCHORS_PER_1024_TOKENS // 1024)
