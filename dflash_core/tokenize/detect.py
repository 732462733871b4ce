"""Sample-level defect detectors: generation loops in the loss tokens and repeated tool calls."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np

from dflash_core.data.completion import CompletionRecord

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MIN_LOOP_TOKENS = 64  # shorter spans are too short to call a loop


def distinct_ngram_fraction(ids: np.ndarray, *, n: int) -> float:
    """Distinct n-grams / n-grams in `ids` (1.0 when there are fewer than n tokens)."""
    count = len(ids) - n + 1
    if count <= 0:
        return 1.0
    values = ids.astype(np.uint64)
    hashes = np.zeros(count, dtype=np.uint64)
    for offset in range(n):
        # Polynomial hash, wrapping mod 2**64; collisions only make a loop look less repetitive.
        hashes = hashes * np.uint64(1_000_003) + values[offset:offset + count]
    hashes.sort()
    return (1 + int(np.count_nonzero(hashes[1:] != hashes[:-1]))) / count


def is_repetition_loop(loss_ids: np.ndarray, *, n: int, window: int, min_distinct: float) -> bool:
    """Whether the last `window` loss tokens are mostly the same n-grams over and over."""
    tail = loss_ids[-window:]
    return len(tail) >= _MIN_LOOP_TOKENS and distinct_ngram_fraction(tail, n=n) < min_distinct


def max_identical_tool_calls(record: CompletionRecord) -> int:
    """Most times one tool call (name + arguments) repeats, in parsed calls or raw `<tool_call>` text."""
    if not record.tool_calls and "<tool_call>" not in record.content:
        return 0
    calls: Counter[str] = Counter()
    for call in record.tool_calls:
        arguments = call.function.arguments
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, sort_keys=True)
        calls[f"{call.function.name}\x00{arguments}"] += 1
    if "<tool_call>" in record.content:
        calls.update(block.strip() for block in _TOOL_CALL_BLOCK.findall(record.content))
    return max(calls.values(), default=0)


def has_empty_reasoning(record: CompletionRecord, *, expect_thinking: bool, think_start: str) -> bool:
    """Thinking was on (or expected) but the completion carries no reasoning at all."""
    expected = record.generation.enable_thinking
    if expected is None:
        expected = expect_thinking
    if not expected:
        return False
    return not (record.reasoning or "").strip() and think_start not in record.content
