"""The completion record: one line of a completion shard (JSONL), shared by generation and tokenization.

Generation writes one `CompletionRecord` per prompt it answered; tokenization reads them back with
`parse_completion_line`, which sorts every unusable line into a named reason (`BadRecord.reason`)
so callers can count and quarantine it instead of dropping it.

`prompt` holds the messages as they were sent to the server. Tokenization keeps only the system
and user turns of it (generation strips assistant turns the same way), so a record carrying the
source conversation's assistant turns still renders what the target really saw. A `regenerated`
record (the regenerate_turns policy) is the exception: its prompt's assistant turns are the target's
own earlier answers, fed back turn by turn, and are rendered as context.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

COMPLETION_SCHEMA_VERSION = 1

Role = Literal["system", "user", "assistant", "tool"]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str | dict[str, Any] = Field(
        description="JSON-encoded string (OpenAI wire format) or an already decoded object."
    )


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class GenerationMeta(BaseModel):
    """How the completion was produced; `enable_thinking` decides whether empty reasoning is a defect."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Model name or path the server was asked for.")
    server: str | None = Field(None, description="Engine that served it: vllm, sglang, transformers, ...")
    enable_thinking: bool | None = Field(None, description="Thinking mode requested; None when unknown.")
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    created_at: str | None = Field(None, description="ISO-8601 time the response arrived.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Engine-specific fields, kept verbatim.")


class CompletionRecord(BaseModel):
    """One answered prompt. Version 1."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = COMPLETION_SCHEMA_VERSION
    id: str = Field(min_length=1, description="Stable sample id, unique within its dataset.")
    source: str = Field(min_length=1, description="Source dataset the prompt came from.")
    prompt: list[Message] = Field(min_length=1, description="Messages sent to the server.")
    tools: list[dict[str, Any]] | None = Field(None, description="Tool schemas offered with the prompt.")
    reasoning: str | None = Field(None, description="The assistant's thinking (reasoning_content).")
    content: str = Field("", description="The assistant's answer text.")
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"]
    generation: GenerationMeta
    regenerated: bool = Field(
        False, description="The prompt's assistant turns are the target's own earlier answers (regenerate_turns): "
        "tokenization keeps them as context. False: they came from the source and are dropped.")

    def to_json_line(self) -> bytes:
        """The record as one JSONL line (UTF-8, newline-terminated)."""
        return self.model_dump_json(exclude_none=True).encode() + b"\n"


class BadRecord(ValueError):
    """A completion line that cannot be used; `reason` is one of BAD_RECORD_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


BAD_RECORD_REASONS = (
    "invalid_utf8",
    "malformed_json",
    "not_an_object",
    "unsupported_schema_version",
    "missing_field",
    "wrong_role",
    "invalid_field",
)


def parse_completion_line(raw: bytes) -> CompletionRecord:
    """Parse and validate one JSONL line, raising `BadRecord` that says why it is unusable."""
    try:
        record = CompletionRecord.model_validate_json(raw)  # rejects invalid UTF-8 itself
    except ValidationError as error:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as decode_error:
            raise BadRecord("invalid_utf8", f"byte {decode_error.start} is not valid UTF-8") from None
        raise _classify(error, text) from None
    return _check_roles(record)


def _classify(error: ValidationError, text: str) -> BadRecord:
    first = error.errors(include_url=False)[0]
    kind, loc = first["type"], tuple(first["loc"])
    where = ".".join(str(part) for part in loc) or "<record>"
    if kind == "json_invalid":
        return BadRecord("malformed_json", first["msg"])
    if kind == "model_type" and loc == ():
        return BadRecord("not_an_object", f"line is JSON {type(json.loads(text)).__name__}, not an object")
    if loc and loc[0] == "schema_version" and kind != "missing":
        return BadRecord(
            "unsupported_schema_version",
            f"schema_version {first.get('input')!r}; this reader knows {COMPLETION_SCHEMA_VERSION}",
        )
    if kind == "missing":
        return BadRecord("missing_field", f"{where} is missing")
    if loc and loc[-1] == "role":
        return BadRecord("wrong_role", f"{where} is {first.get('input')!r}; allowed: system, user, assistant, tool")
    return BadRecord("invalid_field", f"{where}: {first['msg']}")


def _check_roles(record: CompletionRecord) -> CompletionRecord:
    roles = [message.role for message in record.prompt]
    if "system" in roles[1:]:
        raise BadRecord("wrong_role", f"prompt.{roles.index('system', 1)} is a system message after the first turn")
    if "user" not in roles:
        raise BadRecord("wrong_role", f"prompt has no user turn (roles: {', '.join(roles)})")
    for index, message in enumerate(record.prompt):
        if message.role in ("system", "user") and message.content is None:
            raise BadRecord("missing_field", f"prompt.{index}.content is missing")
    return record
