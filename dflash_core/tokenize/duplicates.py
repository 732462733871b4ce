"""Duplicate completion ids, within a shard and across a run's shards: the first line with an id keeps it,
every later line with the same id is a `Duplicate` that names where the id was first seen.

An id is read without validating the record (`record_id`): a line that is too large, not a JSON
object or has no string id has no id here, and the shard tokenizer quarantines it for its own reason.
The first occurrence is the first line whose id can be read, valid record or not, so the rule needs
only the ids and one pass in shard order (`find_duplicates`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A line whose id an earlier line already has: the id, and that earlier line (shard, 1-based line)."""

    id: str
    first_shard: str
    first_line: int


class _RecordId(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1)


def record_id(raw: bytes, *, max_record_bytes: int) -> str | None:
    """The line's top-level "id", or None when the line is over the limit, not a JSON object or has no string id."""
    if len(raw) > max_record_bytes:
        return None
    try:
        return _RecordId.model_validate_json(raw).id
    except ValidationError:
        return None


def line_ids(lines: Sequence[bytes], *, max_record_bytes: int) -> list[str | None]:
    """`record_id` of each line (blank lines give None)."""
    return [record_id(raw, max_record_bytes=max_record_bytes) if raw and not raw.isspace() else None
            for raw in lines]


def find_duplicates(ids_by_shard: Mapping[str, Sequence[str | None]]) -> dict[str, dict[int, Duplicate]]:
    """{shard: {line: Duplicate}} for every later occurrence of an id; shards are taken in the mapping's
    order, lines in order within each (line i of a shard is `ids[i - 1]`). Shards without one are left out."""
    first_seen: dict[str, tuple[str, int]] = {}
    found: dict[str, dict[int, Duplicate]] = {}
    for shard, ids in ids_by_shard.items():
        for line, record in enumerate(ids, start=1):
            if record is None:
                continue
            first = first_seen.setdefault(record, (shard, line))
            if first != (shard, line):
                found.setdefault(shard, {})[line] = Duplicate(record, *first)
    return found
