"""Bytes in and out of the tokenized formats: Arrow IPC shards and quarantine JSONL.

Kept apart from the computation so callers choose where bytes go (object store, local file, test).
"""

from __future__ import annotations

import json

import pyarrow as pa

from dflash_core.tokenize.shard import TOKENIZED_SCHEMA_VERSION, QuarantineLine


def arrow_bytes(table: pa.Table, *, metadata: dict[str, str] | None = None) -> bytes:
    """The table as an Arrow IPC file, with `metadata` (and the schema version) in its schema."""
    meta = {"dflash.tokenized_schema_version": str(TOKENIZED_SCHEMA_VERSION), **(metadata or {})}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **{k.encode(): v.encode()
                                                                               for k, v in meta.items()}})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def read_arrow_bytes(data: bytes) -> pa.Table:
    return pa.ipc.open_file(pa.BufferReader(data)).read_all()


def quarantine_bytes(lines: list[QuarantineLine]) -> bytes:
    """JSONL, one object per unusable line: line number, reason, detail, original text (or base64 bytes)."""
    return b"".join(json.dumps(line.to_json(), ensure_ascii=False).encode() + b"\n" for line in lines)
