"""What decides a tokenized shard's content: rendering, loss mask, truncation, sample-level detectors.

Everything here enters the shard task's cache key (with the tokenizer's content hash), so a change
to any field re-tokenizes; the quality gate's thresholds live apart (`gate.GateThresholds`) because
they judge the output without changing it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from dflash_core.strict import StrictModel

# A completion line longer than this is quarantined unread (`record_too_large`). No real record comes
# near it: the importer caps a prompt at 200,000 characters (data/prompts.py DEFAULT_MAX_PROMPT_CHARS,
# <= 800 KB even at 4 UTF-8 bytes each) and a 128K-token completion is ~0.5 MB of text, while 4 MiB is
# ~1M tokens, past any target's context. It bounds the tokenizer time one line can cost, for text
# that max_length would cut to 8,192 tokens anyway.
DEFAULT_MAX_RECORD_BYTES = 4 * 1024 * 1024


class TokenizeConfig(StrictModel):
    model_config = ConfigDict(frozen=True)

    include_thinking_in_loss: bool = Field(
        True, description="Train on the assistant's thinking tokens too (off: loss starts after `</think>`)."
    )
    max_length: int = Field(8192, gt=0, description="Longest sequence kept, in tokens.")
    max_record_bytes: int = Field(
        DEFAULT_MAX_RECORD_BYTES, gt=0, description="Longest completion line read, in bytes; a longer one is "
        "quarantined as record_too_large before it is parsed or tokenized."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="What to do with sequences over max_length; counted either way."
    )
    expect_thinking: bool = Field(
        False, description="Treat empty reasoning as a defect when a record does not say whether thinking was on."
    )
    template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables for the chat template (e.g. enable_thinking)."
    )
    end_of_turn: str | None = Field(
        None, description="Token that ends the assistant turn; default: the tokenizer's eos token."
    )
    think_start: str = Field("<think>", description="Opening tag of the thinking block.")
    think_end: str = Field("</think>", description="Closing tag of the thinking block.")
    repetition_ngram: int = Field(6, ge=2, description="n of the n-grams the loop detector counts.")
    repetition_window: int = Field(512, ge=16, description="Loss tokens (from the end) the loop detector looks at.")
    repetition_min_distinct: float = Field(
        0.3, gt=0, le=1, description="A window with fewer distinct n-grams than this fraction is a loop."
    )
    max_repeated_tool_calls: int = Field(
        3, ge=2, description="This many identical tool calls in one completion count as a tool-call loop."
    )
