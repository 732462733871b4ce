"""Every prompt decoded target-only and in each speculative mode, summarized per mode."""

from __future__ import annotations

from typing import Any

import torch

from dflash_core.evaluate.report import ResponseResult, markdown_table, summarize
from dflash_core.evaluate.speculative import MODES, SpeculativeDecoder, greedy_decode


def evaluate_prompts(
    *, target: torch.nn.Module, drafter: torch.nn.Module, prompts: list[list[int]], modes: tuple[str, ...] = ("block",),
    max_new_tokens: int, eos_token_id: int | None = None, tree_budget: int | None = None, warmup: bool = True,
) -> dict[str, Any]:
    """Decode every prompt target-only and in each mode; returns {"summaries": [...], "table": md}.

    A response whose speculative output differs from the target's greedy output is reported, not
    raised: in bf16 a batched verify pass and one-token steps can round differently.
    """
    if not prompts:
        raise ValueError("prompts is empty")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes}")
    decoders = {mode: SpeculativeDecoder(target=target, drafter=drafter, mode=mode, tree_budget=tree_budget)
                for mode in modes}
    if warmup:  # first calls pay for allocator and kernel setup; keep them out of the timings
        greedy_decode(target, prompts[0], max_new_tokens=2)
        for decoder in decoders.values():
            decoder.generate(prompts[0], max_new_tokens=2)
    # Per prompt: baseline, then every mode, so drifting machine load hits all of them alike.
    results: dict[str, list[ResponseResult]] = {mode: [] for mode in modes}
    for index, prompt in enumerate(prompts):
        baseline = greedy_decode(target, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        for mode, decoder in decoders.items():
            decoded = decoder.generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
            results[mode].append(ResponseResult(
                prompt_index=index, prompt_tokens=len(prompt), decoded=decoded, baseline_wall_s=baseline.wall_s,
                matches_target=decoded.tokens == baseline.tokens,
            ))
    summaries = [summarize(results[mode], block_size=drafter.config.block_size, mode=mode) for mode in modes]
    return {"summaries": summaries, "table": markdown_table(summaries)}
