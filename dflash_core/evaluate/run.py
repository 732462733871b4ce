"""Every prompt decoded target-only and in each speculative mode, summarized per mode."""

from __future__ import annotations

from typing import Any

import torch

from dflash_core.evaluate.divergence import first_divergence
from dflash_core.evaluate.graphed import GraphedDecoder, graphs_supported
from dflash_core.evaluate.report import ResponseResult, markdown_table, summarize
from dflash_core.evaluate.speculative import MODES, SpeculativeDecoder, greedy_decode

HARNESSES = ("auto", "eager", "graphs")


def pick_harness(harness: str, *, target: torch.nn.Module, modes: tuple[str, ...]) -> str:
    """`eager` or `graphs` for a requested harness: auto takes CUDA graphs on a GPU where they can decode
    every mode asked for, eager otherwise (a CPU has no launch overhead worth removing)."""
    if harness not in HARNESSES:
        raise ValueError(f"harness must be one of {HARNESSES}, got {harness!r}")
    why_not = graphs_supported(target, modes)
    if harness == "graphs" and why_not:
        raise ValueError(f"harness 'graphs' cannot decode modes {list(modes)} here: {why_not}; use harness 'eager'")
    if harness == "auto":
        on_gpu = next(target.parameters()).device.type == "cuda"
        return "graphs" if on_gpu and why_not is None else "eager"
    return harness


def evaluate_prompts(
    *, target: torch.nn.Module, drafter: torch.nn.Module, prompts: list[list[int]], modes: tuple[str, ...] = ("block",),
    max_new_tokens: int, eos_token_id: int | None = None, tree_budget: int | None = None, warmup: bool = True,
    harness: str = "auto",
) -> dict[str, Any]:
    """Decode every prompt target-only and in each mode; returns {"summaries": [...], "table": md}.

    Both sides of every comparison run in one harness (`pick_harness`): eager transformers with a
    growing cache, or fixed-shape caches replayed as CUDA graphs (`graphed.py`). A response whose
    speculative output differs from the target's greedy output is reported, not raised, with where it
    diverged and whether the target's logits there are a near-tie (`divergence.py`): in bf16 a batched
    verify pass and one-token steps can round differently.
    """
    if not prompts:
        raise ValueError("prompts is empty")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes}")
    harness = pick_harness(harness, target=target, modes=tuple(modes))
    if harness == "graphs":
        capacity = max(len(p) for p in prompts) + max_new_tokens + 2 * drafter.config.block_size + 16
        graphed = GraphedDecoder(target=target, drafter=drafter, capacity=capacity)
        decoders: dict[str, Any] = {"block": graphed}
        baseline_decode = graphed.greedy
    else:
        decoders = {mode: SpeculativeDecoder(target=target, drafter=drafter, mode=mode, tree_budget=tree_budget)
                    for mode in modes}

        def baseline_decode(prompt, **kwargs):
            return greedy_decode(target, prompt, **kwargs)
    if warmup:  # first calls pay for allocator and kernel setup; keep them out of the timings
        baseline_decode(prompts[0], max_new_tokens=2)
        for decoder in decoders.values():
            decoder.generate(prompts[0], max_new_tokens=2)
    # Per prompt: baseline, then every mode, so drifting machine load hits all of them alike.
    results: dict[str, list[ResponseResult]] = {mode: [] for mode in modes}
    for index, prompt in enumerate(prompts):
        baseline = baseline_decode(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        for mode, decoder in decoders.items():
            decoded = decoder.generate(prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
            results[mode].append(ResponseResult(
                prompt_index=index, prompt_tokens=len(prompt), decoded=decoded, baseline_wall_s=baseline.wall_s,
                matches_target=decoded.tokens == baseline.tokens,
                divergence=first_divergence(target, prompt, greedy=baseline.tokens, decoded=decoded.tokens),
            ))
    summaries = [summarize(results[mode], block_size=drafter.config.block_size, mode=mode) | {"harness": harness}
                 for mode in modes]
    return {"summaries": summaries, "table": markdown_table(summaries)}
