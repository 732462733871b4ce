"""Prompt sets: streaming import from JSON arrays, JSONL or Parquet in ShareGPT or OpenAI-messages
form, normalized to system + user turns, deduplicated, mixed from several sources by weight.

Files are streamed (ijson for JSON arrays, row batches for Parquet): a prompt file of hundreds of
MB is never loaded whole. A bad record never stops an import: it is counted by reason and kept as a
quarantine line that says why.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from dflash_core.data.completion import Message

PROMPT_SCHEMA_VERSION = 1
USER_ROLES = {"user", "human"}
SYSTEM_ROLES = {"system"}
# Turns that were answers in the source conversation: dropped, the target answers for itself.
DROPPED_ROLES = {"assistant", "gpt", "chatgpt", "bard", "bing", "model", "tool", "function", "observation", "ipython"}
BAD_PROMPT_REASONS = ("malformed", "truncated", "empty", "unknown_role", "not_a_conversation", "duplicate")


class PromptRecord(BaseModel):
    """One prompt to generate a completion for. Version 1."""

    schema_version: int = PROMPT_SCHEMA_VERSION
    id: str = Field(min_length=1)
    source: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1, description="System and user turns only.")
    tools: list[dict[str, Any]] | None = None

    def to_json_line(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode() + b"\n"

    def content_hash(self) -> str:
        """Identity for deduplication: the messages and tools, not the id or source."""
        payload = json.dumps([[m.role, m.content] for m in self.messages] + [self.tools or []], ensure_ascii=False)
        return hashlib.sha256(payload.encode()).hexdigest()


class BadPrompt(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class PromptSource:
    path: Path
    name: str
    weight: float = 1.0


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
                                "record": raw if isinstance(raw, (dict, list, str, int, float)) else repr(raw)})

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "accepted": self.accepted, "rejected": dict(self.rejected),
                "per_source": dict(self.per_source), "renamed_ids": self.renamed_ids}


def iter_raw(path: Path) -> Iterator[tuple[int, Any]]:
    """(index, record) for every record in a .json (array), .jsonl/.ndjson or .parquet file, streamed.
    A record that cannot be parsed comes back as a `BadPrompt`; a file cut short ends with a
    `BadPrompt("truncated")`."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from _iter_jsonl(path)
    elif suffix == ".json":
        yield from _iter_json_array(path)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise ValueError(f"{path}: unknown prompt file type {suffix!r}; use .json, .jsonl, .ndjson or .parquet")


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                reason = "truncated" if not line.endswith(b"\n") else "malformed"
                yield index, BadPrompt(reason, f"line {index + 1}: {error}")


def _iter_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    import ijson

    index = -1
    with open(path, "rb") as handle:
        try:
            for index, item in enumerate(ijson.items(handle, "item", use_float=True)):
                yield index, item
        except ijson.IncompleteJSONError as error:
            yield index + 1, BadPrompt("truncated", f"{path.name} ends inside record {index + 1}: {error}")
        except ijson.JSONError as error:
            yield index + 1, BadPrompt("malformed", f"{path.name} is not valid JSON after record {index}: {error}")


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield index, row
            index += 1


def normalize(raw: Any, *, source: str, index: int) -> PromptRecord:
    """A ShareGPT (`conversations`: from/value) or OpenAI (`messages`: role/content) record as a prompt."""
    if isinstance(raw, BadPrompt):
        raise raw
    if not isinstance(raw, dict):
        raise BadPrompt("malformed", f"record is {type(raw).__name__}, not an object")
    if isinstance(raw.get("conversations"), list):
        turns, role_key, text_key = raw["conversations"], "from", "value"
    elif isinstance(raw.get("messages"), list):
        turns, role_key, text_key = raw["messages"], "role", "content"
    else:
        raise BadPrompt("not_a_conversation", "no `conversations` (ShareGPT) or `messages` (OpenAI) list")
    messages: list[Message] = []
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadPrompt("malformed", f"turn {position} is {type(turn).__name__}, not an object")
        role = str(turn.get(role_key, "")).strip().lower()
        if role in DROPPED_ROLES:
            continue
        if role not in USER_ROLES | SYSTEM_ROLES:
            raise BadPrompt("unknown_role", f"turn {position} has role {turn.get(role_key)!r}")
        text = _text(turn.get(text_key))
        if role in SYSTEM_ROLES:
            if messages or not text.strip():
                continue  # a system turn after the first, or an empty one, carries nothing to keep
            messages.append(Message(role="system", content=text))
        elif text.strip():
            messages.append(Message(role="user", content=text))
    if not any(message.role == "user" for message in messages):
        raise BadPrompt("empty", "no user turn with text")
    tools = raw.get("tools") if isinstance(raw.get("tools"), list) else None
    record_id = str(raw.get("id") or raw.get("conversation_id") or f"{source}-{index}")
    return PromptRecord(id=record_id, source=source, messages=messages, tools=tools)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


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
        for index, raw in iter_raw(source.path):
            report.read += 1
            try:
                record = normalize(raw, source=source.name, index=index)
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
