"""The completion record schema and how unusable lines are classified.

Run: .venv/bin/python -m pytest -q tests/unit/test_completion_record.py
"""

from __future__ import annotations

import json

import pytest

from dflash_core.data.completion import (
    BAD_RECORD_REASONS, COMPLETION_SCHEMA_VERSION, BadRecord, CompletionRecord, parse_completion_line,
)

GOOD = {
    "id": "sharegpt-1",
    "source": "sharegpt",
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "reasoning": "Greet back.",
    "content": "Hello!",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    "finish_reason": "stop",
    "generation": {"model": "Qwen/Qwen3-8B", "server": "vllm", "enable_thinking": True, "temperature": 0.6},
}


def line(**changes) -> bytes:
    record = {**GOOD, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not ...}).encode()


def test_round_trip_keeps_every_field():
    record = parse_completion_line(line())
    assert record.schema_version == COMPLETION_SCHEMA_VERSION == 1
    again = parse_completion_line(record.to_json_line())
    assert again == record
    assert record.to_json_line().endswith(b"\n") and record.to_json_line().count(b"\n") == 1


def test_assistant_turns_in_the_prompt_are_allowed():
    prompt = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert len(parse_completion_line(line(prompt=prompt)).prompt) == 3


@pytest.mark.parametrize(
    ("raw", "reason", "detail"),
    [
        (b'{"id": "caf\xe9"}', "invalid_utf8", "byte 11"),
        (b'{"id": "x",', "malformed_json", "Invalid JSON"),
        (b"[1, 2]", "not_an_object", "JSON list"),
        (line(schema_version=2), "unsupported_schema_version", "schema_version 2"),
        (line(id=...), "missing_field", "id is missing"),
        (line(generation={"server": "vllm"}), "missing_field", "generation.model is missing"),
        (line(prompt=[{"role": "human", "content": "Hi"}]), "wrong_role", "prompt.0.role is 'human'"),
        (line(prompt=[{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]), "wrong_role",
         "system message after the first turn"),
        (line(prompt=[{"role": "system", "content": "only"}]), "wrong_role", "no user turn"),
        (line(prompt=[{"role": "user"}]), "missing_field", "prompt.0.content"),
        (line(finish_reason="eos"), "invalid_field", "finish_reason"),
        (line(content=["parts"]), "invalid_field", "content"),
        (line(surprise=1), "invalid_field", "surprise"),
    ],
)
def test_bad_lines_are_classified(raw: bytes, reason: str, detail: str):
    with pytest.raises(BadRecord) as error:
        parse_completion_line(raw)
    assert error.value.reason == reason
    assert reason in BAD_RECORD_REASONS
    assert detail in error.value.detail
    assert isinstance(error.value, ValueError)


def test_model_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt"):
        CompletionRecord.model_validate({**GOOD, "prompt": []})
