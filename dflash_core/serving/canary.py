"""A look at the first K completions before the full run: empty answers, missing reasoning when
thinking was asked for, degenerate loops and truncation stop the run with a message that says what
to check."""

from __future__ import annotations

from pydantic import BaseModel, Field

from dflash_core.data.completion import CompletionRecord
from dflash_core.serving.client import FailedPrompt
from dflash_core.strict import StrictModel
from dflash_core.tokenize.detect import max_identical_tool_calls


class CanaryThresholds(StrictModel):
    min_nonempty_fraction: float = Field(0.9, ge=0, le=1, description="Answers with any content or tool call.")
    min_reasoning_fraction: float = Field(0.8, ge=0, le=1, description="With thinking on: answers with reasoning.")
    max_degenerate_fraction: float = Field(0.1, ge=0, le=1, description="Answers stuck in a loop.")
    max_length_fraction: float = Field(0.5, ge=0, le=1, description="Answers cut by max_tokens.")
    max_failed_fraction: float = Field(0.1, ge=0, le=1, description="Prompts that got no answer at all.")


class CanaryReport(BaseModel):
    samples: int
    failed: int
    empty: int
    without_reasoning: int
    degenerate: int
    truncated: int
    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems


def looks_degenerate(text: str, *, n: int = 4, window_words: int = 200, min_distinct: float = 0.3) -> bool:
    """True when the last `window_words` words repeat a few n-grams over and over."""
    words = text.split()[-window_words:]
    if len(words) < 4 * n:
        return False
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) < min_distinct


def check_canary(results: list[CompletionRecord | FailedPrompt], *, expect_thinking: bool,
                 thresholds: CanaryThresholds) -> CanaryReport:
    records = [r for r in results if isinstance(r, CompletionRecord)]
    failed = len(results) - len(records)
    empty = sum(1 for r in records if not r.content.strip() and not r.tool_calls and not (r.reasoning or "").strip())
    without_reasoning = sum(1 for r in records if not (r.reasoning or "").strip())
    degenerate = sum(1 for r in records if looks_degenerate((r.reasoning or "") + " " + r.content)
                     or max_identical_tool_calls(r) >= 3)
    truncated = sum(1 for r in records if r.finish_reason == "length")
    total = max(1, len(results))
    answered = max(1, len(records))
    problems = []
    if failed / total > thresholds.max_failed_fraction:
        problems.append(f"{failed} of {len(results)} canary prompts got no answer: check the server logs")
    if (answered - empty) / answered < thresholds.min_nonempty_fraction:
        problems.append(f"{empty} of {len(records)} answers are empty: is the chat template right for this model?")
    if expect_thinking and (answered - without_reasoning) / answered < thresholds.min_reasoning_fraction:
        problems.append(
            f"{without_reasoning} of {len(records)} answers have no reasoning although thinking mode is on: "
            "does the server run a reasoning parser (vLLM/SGLang --reasoning-parser) and does the template honour "
            "enable_thinking? Training on these would teach the drafter boilerplate"
        )
    if degenerate / answered > thresholds.max_degenerate_fraction:
        problems.append(f"{degenerate} of {len(records)} answers loop on repeated text or tool calls: "
                        "check sampling (temperature, repetition penalty)")
    if truncated / answered > thresholds.max_length_fraction:
        problems.append(f"{truncated} of {len(records)} answers hit max_tokens: raise max_tokens or check for loops")
    return CanaryReport(samples=len(results), failed=failed, empty=empty, without_reasoning=without_reasoning,
                        degenerate=degenerate, truncated=truncated, problems=problems)
