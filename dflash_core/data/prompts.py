"""Prompt sets: streaming import from JSON arrays, JSONL or Parquet in ShareGPT or OpenAI-messages
form, normalized by a turn policy, deduplicated, mixed from several sources by weight.

Files are streamed (a memory-mapped scanner for JSON arrays, row batches for Parquet): a prompt
file of hundreds of MB is never loaded whole. A bad record never stops an import: it is counted by
reason and kept as a quarantine line that says why, and reading goes on with the next record (in a
JSON array too: elements are split by the scanner and parsed one by one). A file whose shape is
not understood (a `.json` object instead of an array, an unknown suffix) is an error naming it.

Multi-turn conversations keep their meaning under one of two policies (`TURN_POLICIES`):
- `first_user_turn` (default): the system turn and the first user turn only, a single-turn prompt.
- `regenerate_turns`: the first user turn as the prompt, the later user turns as `followups`, asked
  in order after the target answered each earlier one (`regenerate_completion`), so every
  assistant turn is the target's own. The source's assistant turns are never kept.
Either way a conversation whose first kept user turn answers something missing (an assistant turn
before it, or a bare "continue") is rejected as `needs_context`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from dflash_core.data.completion import CompletionRecord, Message
from dflash_core.data.prompt_files import BadPrompt, iter_raw

PROMPT_SCHEMA_VERSION = 1
USER_ROLES = {"user", "human"}
SYSTEM_ROLES = {"system"}
# Turns that were answers in the source conversation: dropped, the target answers for itself.
DROPPED_ROLES = {"assistant", "gpt", "chatgpt", "bard", "bing", "model", "tool", "function", "observation", "ipython"}
BAD_PROMPT_REASONS = ("malformed", "truncated", "empty", "unknown_role", "not_a_conversation", "duplicate",
                      "invalid_field", "invalid_text", "too_long", "needs_context")
TurnPolicy = Literal["first_user_turn", "regenerate_turns"]
TURN_POLICIES: tuple[str, ...] = ("first_user_turn", "regenerate_turns")
DEFAULT_MAX_PROMPT_CHARS = 200_000  # ~50K tokens: longer prompts leave no room to answer in any target's context
QUARANTINE_RECORD_CHARS = 20_000  # a quarantined record is kept up to this many characters
# A first user turn that only asks to go on answers a turn the source cut off.
_CONTINUATIONS = re.compile(r"^\W*(please\s+)?(continue|go on|keep going|more|next|continue please|ok,? continue)\W*$",
                            re.IGNORECASE)


class PromptRecord(BaseModel):
    """One prompt to generate a completion for. Version 1."""

    schema_version: int = PROMPT_SCHEMA_VERSION
    id: str = Field(min_length=1)
    source: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1, description="An optional system turn and one user turn.")
    tools: list[dict[str, Any]] | None = None
    followups: list[str] | None = Field(
        None, description="regenerate_turns: later user turns, asked in order after the target answered each.")

    def to_json_line(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode() + b"\n"

    def content_hash(self) -> str:
        """Identity for deduplication: the messages, follow-ups and tools, not the id or source."""
        payload = json.dumps([[m.role, m.content] for m in self.messages] + [self.followups or [], self.tools or []],
                             ensure_ascii=False)
        return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class PromptSource:
    path: Path
    name: str
    weight: float = 1.0
    turns: TurnPolicy = "first_user_turn"
    max_chars: int = DEFAULT_MAX_PROMPT_CHARS  # longer prompts (all kept turns together) are rejected as too_long

    def __post_init__(self) -> None:
        if self.turns not in TURN_POLICIES:
            raise ValueError(f"prompt source {self.name!r}: turns={self.turns!r}; use one of {', '.join(TURN_POLICIES)}")
        if self.max_chars < 1:
            raise ValueError(f"prompt source {self.name!r}: max_chars must be >= 1, got {self.max_chars}")


@dataclass
class ImportReport:
    read: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    per_source: Counter = field(default_factory=Counter)
    renamed_ids: int = 0
    quarantine: list[dict[str, Any]] = field(default_factory=list)

    def reject(self, source: str, index: int, error: BadPrompt, raw: Any) -> None:
        self.rejected[error.reason] += 1
        self.quarantine.append({"source": source, "index": index, "reason": error.reason, "detail": error.detail,
                                "record": _quarantinable(raw)})

    def quarantine_bytes(self) -> bytes:
        """The quarantine as JSONL (ASCII-escaped, so lone surrogates of a bad record survive)."""
        return b"".join(json.dumps(line).encode() + b"\n" for line in self.quarantine)

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "accepted": self.accepted, "rejected": dict(self.rejected),
                "per_source": dict(self.per_source), "renamed_ids": self.renamed_ids}


def normalize(raw: Any, *, source: str, index: int, turns: TurnPolicy = "first_user_turn",
              max_chars: int | None = None) -> PromptRecord:
    """A ShareGPT (`conversations`: from/value) or OpenAI (`messages`: role/content) record as a prompt,
    under the turn policy `turns`; raises `BadPrompt` with the reason it cannot be one."""
    if isinstance(raw, BadPrompt):
        raise raw
    if not isinstance(raw, dict):
        raise BadPrompt("malformed", f"record is {type(raw).__name__}, not an object")
    if isinstance(raw.get("conversations"), list):
        turn_list, role_key, text_key = raw["conversations"], "from", "value"
    elif isinstance(raw.get("messages"), list):
        turn_list, role_key, text_key = raw["messages"], "role", "content"
    else:
        raise BadPrompt("not_a_conversation", "no `conversations` (ShareGPT) or `messages` (OpenAI) list")
    system: str | None = None
    users: list[str] = []
    answered_before_first_user = False
    for position, turn in enumerate(turn_list):
        if not isinstance(turn, dict):
            raise BadPrompt("malformed", f"turn {position} is {type(turn).__name__}, not an object")
        role = str(turn.get(role_key, "")).strip().lower()
        if role in DROPPED_ROLES:
            answered_before_first_user |= not users
            continue
        if role not in USER_ROLES | SYSTEM_ROLES:
            raise BadPrompt("unknown_role", f"turn {position} has role {turn.get(role_key)!r}")
        text = _text(turn.get(text_key), where=f"turn {position}")
        if role in SYSTEM_ROLES:
            if system is None and not users and not answered_before_first_user and text.strip():
                system = text  # a later or empty system turn carries nothing to keep
        elif text.strip():
            users.append(text)
    if not users:
        raise BadPrompt("empty", "no user turn with text")
    if answered_before_first_user:
        raise BadPrompt("needs_context", "the conversation starts with an assistant turn: the first user turn "
                                         "answers context that is not in the prompt")
    if _CONTINUATIONS.match(users[0]):
        raise BadPrompt("needs_context", f"the first user turn is {users[0].strip()[:40]!r}: it continues a "
                                         "conversation that is not in the prompt")
    kept = users if turns == "regenerate_turns" else users[:1]
    chars = sum(len(text) for text in kept) + len(system or "")
    if max_chars is not None and chars > max_chars:
        raise BadPrompt("too_long", f"{chars:,} characters in the kept turns, over the {max_chars:,} limit")
    tools = _tools(raw.get("tools"))
    record_id = _record_id(raw, source=source, index=index)
    messages = ([Message(role="system", content=system)] if system is not None else []) + \
        [Message(role="user", content=kept[0])]
    try:
        record = PromptRecord(id=record_id, source=source, messages=messages, tools=tools,
                              followups=kept[1:] or None)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        raise BadPrompt("invalid_field", f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    _check_encodable(record)
    return record


def _text(content: Any, *, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, (str, int, float)) and not isinstance(content, bool):
        return str(content)
    if isinstance(content, list):  # OpenAI content parts
        return "".join(_part_text(part, where=f"{where} content part {number}")
                       for number, part in enumerate(content))
    raise BadPrompt("invalid_field", f"{where} is a {type(content).__name__}, not text")


def _part_text(part: Any, *, where: str) -> str:
    """The text of one OpenAI content part; "" for a part without text (an image)."""
    if not isinstance(part, dict):
        raise BadPrompt("invalid_field", f"{where} is a {type(part).__name__}, not a content part object")
    text = part.get("text")
    if text is None or isinstance(text, str):
        return text or ""
    raise BadPrompt("invalid_field", f"{where} has `text` {text!r:.60} ({type(text).__name__}); it must be a string")


def _record_id(raw: dict[str, Any], *, source: str, index: int) -> str:
    """The record's `id` (else `conversation_id`) as text; without either, one made of source and position."""
    for key in ("id", "conversation_id"):
        value = raw.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return str(value)
        raise BadPrompt("invalid_field", f"`{key}` is {value!r:.60} ({type(value).__name__}); an id must be a "
                                         "string or an integer")
    return f"{source}-{index}"


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        kind = type(tools).__name__ if not isinstance(tools, list) else "list with non-object items"
        raise BadPrompt("invalid_field", f"`tools` is a {kind}; expected a list of tool schemas (objects)")
    return tools


def _check_encodable(record: PromptRecord) -> None:
    """Text that cannot be UTF-8 (a lone surrogate from a `\\ud800` escape) would break every writer downstream."""
    try:
        record.to_json_line()
    except (UnicodeEncodeError, ValueError) as error:
        texts = [m.content or "" for m in record.messages] + (record.followups or []) + [record.id]
        bad = next((t for t in texts if _has_surrogate(t)), None)
        where = f" near {bad[max(0, _surrogate_at(bad) - 20):_surrogate_at(bad)]!r}" if bad else ""
        raise BadPrompt("invalid_text", f"text is not valid Unicode (a lone surrogate){where}: {error}") from None


def _has_surrogate(text: str) -> bool:
    return _surrogate_at(text) >= 0


def _surrogate_at(text: str) -> int:
    return next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), -1)


def _quarantinable(raw: Any) -> Any:
    """The record as the quarantine keeps it: the object itself when any JSON writer can write it,
    else its text (invalid bytes and lone surrogates escaped), cut at QUARANTINE_RECORD_CHARS."""
    if isinstance(raw, BadPrompt):
        raw = raw.raw or b""
    if isinstance(raw, bytes):
        text = raw.decode("utf-8", "backslashreplace")
    else:
        try:
            text = json.dumps(raw, ensure_ascii=False, default=repr)
            text.encode()
            if len(text) <= QUARANTINE_RECORD_CHARS:
                return raw
        except UnicodeEncodeError:
            text = json.dumps(raw, default=repr)
        except (ValueError, RecursionError):
            text = f"<{type(raw).__name__} nested too deep to write>"
    return text if len(text) <= QUARANTINE_RECORD_CHARS else text[:QUARANTINE_RECORD_CHARS] + " ...[cut]"


def import_prompts(sources: Iterable[PromptSource], *, total: int | None = None, seed: int = 0,
                   report: ImportReport | None = None) -> tuple[list[PromptRecord], ImportReport]:
    """Valid, unique prompts from every source, mixed by weight.

    Without `total` every valid prompt is kept. With it, each source contributes
    round(total * weight / sum(weights)) prompts (fewer if it has fewer), sampled uniformly by a
    seeded reservoir, so only the kept prompts are ever held in memory."""
    sources = list(sources)
    report = report or ImportReport()
    weights = sum(source.weight for source in sources)
    seen: set[str] = set()
    seen_ids: set[str] = set()
    rng = random.Random(seed)
    mixed: list[PromptRecord] = []
    for source in sources:
        quota = None if total is None else round(total * source.weight / weights)
        kept: list[PromptRecord] = []
        valid = 0
        # Raw JSON can be ~8x its text (\uXXXX escapes, keys, dropped turns): only far larger records skip parsing.
        for index, raw in iter_raw(source.path, max_bytes=16 * source.max_chars + 65_536):
            report.read += 1
            try:
                record = normalize(raw, source=source.name, index=index, turns=source.turns,
                                   max_chars=source.max_chars)
                digest = record.content_hash()
                if digest in seen:
                    raise BadPrompt("duplicate", f"same messages as an earlier prompt ({digest[:12]})")
            except BadPrompt as error:
                report.reject(source.name, index, error, raw)
                continue
            seen.add(digest)
            if record.id in seen_ids:  # ids must be unique: answers are matched to prompts by id
                record = record.model_copy(update={"id": f"{source.name}-{index}"})
                report.renamed_ids += 1
                if record.id in seen_ids:
                    report.reject(source.name, index, BadPrompt("duplicate", f"id {record.id!r} repeats"), raw)
                    continue
            seen_ids.add(record.id)
            valid += 1
            if quota is None or len(kept) < quota:
                kept.append(record)
            else:
                slot = rng.randrange(valid)
                if slot < quota:
                    kept[slot] = record
        report.per_source[source.name] = len(kept)
        mixed.extend(kept)
    rng.shuffle(mixed)
    report.accepted = len(mixed)
    return mixed, report


async def regenerate_completion(prompt: PromptRecord,
                                complete: Callable[[list[Message]], Awaitable[CompletionRecord]]) -> CompletionRecord:
    """Answer a prompt turn by turn with the target's own answers as context (regenerate_turns).

    `complete(messages)` asks the target once; each follow-up is sent after the target's answer to
    the turn before it. The result is the last turn's record, its prompt the whole conversation so far
    (`regenerated=True`). A turn cut at max_tokens or ending in tool calls (which need tool results,
    not a user turn) ends the conversation early; `generation.extra` says how many turns were answered.
    A single-turn prompt is one `complete` call."""
    turns = [None, *(prompt.followups or [])]
    conversation = list(prompt.messages)
    record: CompletionRecord | None = None
    for answered, followup in enumerate(turns):
        if followup is not None:
            assert record is not None
            if record.finish_reason in ("length", "tool_calls", "content_filter"):
                break
            conversation += [Message(role="assistant", content=record.content, tool_calls=record.tool_calls or None),
                             Message(role="user", content=followup)]
        record = await complete(list(conversation))
    else:
        answered = len(turns)
    assert record is not None
    if len(turns) == 1:
        return record
    extra = {**record.generation.extra, "turns_answered": answered, "turns_total": len(turns)}
    return record.model_copy(update={"prompt": conversation, "regenerated": True,
                                     "generation": record.generation.model_copy(update={"extra": extra})})


def shard_prompts(records: list[PromptRecord], *, shard_size: int) -> list[list[PromptRecord]]:
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [records[start:start + shard_size] for start in range(0, len(records), shard_size)]


def read_prompt_lines(data: bytes) -> list[PromptRecord]:
    """Prompts of one stored shard (written by us, so a bad line is a bug and raises, naming the line)."""
    records = []
    for number, line in enumerate(data.splitlines(), start=1):
        if line.strip():
            try:
                records.append(PromptRecord.model_validate_json(line))
            except ValueError as error:
                raise ValueError(f"prompt shard line {number} is not a PromptRecord: {error}") from error
    return records
