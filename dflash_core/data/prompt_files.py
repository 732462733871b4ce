"""Reading prompt files record by record: JSONL lines, the elements of a JSON array (a memory-mapped
scanner, so a file of hundreds of MB is never loaded whole and a bad element costs only itself) and
Parquet row batches. A record that cannot be read raises `BadPrompt` with a reason; a file whose shape
is not understood is a `ValueError` naming it."""

from __future__ import annotations

import codecs
import json
import mmap
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class BadPrompt(ValueError):
    """A record that cannot be a prompt; `raw` keeps its bytes when it could not even be parsed."""

    def __init__(self, reason: str, detail: str, raw: bytes | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.raw = raw




def iter_raw(path: Path, *, max_bytes: int | None = None) -> Iterator[tuple[int, Any]]:
    """(index, record) for every record in a .json (array), .jsonl/.ndjson or .parquet file, streamed.
    A record that cannot be parsed comes back as a `BadPrompt` and reading goes on; a file cut short
    ends with a `BadPrompt("truncated")`. A record over `max_bytes` is not parsed (`too_long`)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from _iter_jsonl(path, max_bytes=max_bytes)
    elif suffix == ".json":
        yield from _iter_json_array(path, max_bytes=max_bytes)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise ValueError(f"{path}: unknown prompt file type {suffix!r}; use .json, .jsonl, .ndjson or .parquet")


def _parse(text: bytes, *, where: str, max_bytes: int | None) -> Any:
    """One JSON record, or a `BadPrompt` saying why it is unusable."""
    if max_bytes is not None and len(text) > max_bytes:
        return BadPrompt("too_long", f"{where} is {len(text):,} bytes, over the {max_bytes:,}-byte limit")
    try:
        return json.loads(text)
    except UnicodeDecodeError as error:
        return BadPrompt("malformed", f"{where}: byte {error.start} is not valid UTF-8")
    except ValueError as error:
        return BadPrompt("malformed", f"{where}: {error}")
    except RecursionError:
        return BadPrompt("malformed", f"{where}: nested deeper than the JSON parser allows")


def _iter_jsonl(path: Path, *, max_bytes: int | None) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as handle:
        for index, line in enumerate(handle):
            if index == 0:
                line = line.removeprefix(codecs.BOM_UTF8)
            if not line.strip():
                continue
            record = _parse(line, where=f"line {index + 1}", max_bytes=max_bytes)
            if isinstance(record, BadPrompt) and record.reason == "malformed" and not line.endswith(b"\n"):
                record = BadPrompt("truncated", f"the last line ({index + 1}) is cut short: {record.detail}")
            if isinstance(record, BadPrompt):
                record.raw = line
            yield index, record


# Outside strings the scanner stops at whole strings (one match, escapes included) and at brackets and
# commas; a lone quote means a string that never closes.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]|"', re.DOTALL)
_SPACE = b" \t\r\n"
# Where a record may begin inside a bad element that ran on past its end: an object after a comma.
_OBJECT_AFTER_COMMA = re.compile(rb",[ \t\r\n]*\{")
_CONVERSATION_KEYS = ("conversations", "messages")  # a record holds one of these lists (ShareGPT, OpenAI)
# Bytes the scanner reads to find where the element after a bad one begins: of the bad element, for the decoder to
# stop in, and of each candidate, to parse it whole. Never the record size limit: that only decides which records
# are too long, so an import with a limit resumes where the parser without one does.
RUN_ON_WINDOW = 4 * 1024 * 1024


def _iter_json_array(path: Path, *, max_bytes: int | None) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array, each parsed on its own: a bad element is reported and the
    scanner goes on with the next one (found by bracket depth outside strings)."""
    with open(path, "rb") as handle:
        if not path.stat().st_size:
            raise ValueError(f"{path}: the file is empty; expected a JSON array of records")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            yield from _scan_array(data, path=path, max_bytes=max_bytes)


def _scan_array(data, *, path: Path, max_bytes: int | None) -> Iterator[tuple[int, Any]]:
    """Elements split at commas and the closing bracket outside strings and nested brackets. A bracket or
    quote left open (or one too many) runs an element into the records after it, or seems to close the array
    early: the bad part is cut where the next element begins and reading resumes there. That is where the
    JSON decoder stopped when it stopped at a whole element after a comma (`_resume_at_error`: an object
    left open before the next record), else the next whole record found by scanning (`_next_record`); both
    read up to RUN_ON_WINDOW whatever `max_bytes` is. Only a record cut by the end of the file is `truncated`."""
    pos = 3 if data[:3] == codecs.BOM_UTF8 else 0
    while pos < len(data) and data[pos] in _SPACE:
        pos += 1
    if data[pos:pos + 1] != b"[":
        raise ValueError(_shape_error(path, data, pos))
    index, start = 0, pos + 1
    while True:
        end, token = _element_end(data, start)
        if end is None:  # the file ends inside this element
            raw, record, rest = b"", None, b""
        else:
            raw = bytes(data[start:end].strip(_SPACE))
            record = _parse_element(raw, index=index, max_bytes=max_bytes)
            rest = bytes(data[end + 1:end + 201].strip(_SPACE)) if token == b"]" else b""  # after the array
        if end is None or rest or isinstance(record, BadPrompt):
            resume = _resume_at_error(data, start) if end is None or rest else None
            resume = resume or _next_record(data, start, end if token == b"," else len(data))
            if resume is not None:
                comma, resume_at = resume
                if end is not None and not isinstance(record, BadPrompt):  # a whole record, then a stray `]`
                    yield index, record
                    index, start = index + 1, end
                yield index, _ran_on(bytes(data[start:comma].strip(_SPACE)), index=index, resume_at=resume_at,
                                     max_bytes=max_bytes)
                index, start = index + 1, resume_at
                continue
        if end is None:
            yield from _cut_short(bytes(data[start:].strip(_SPACE)), index=index, name=path.name, max_bytes=max_bytes)
            return
        if raw or index or token == b",":  # `[]` is an empty array, not an empty record
            yield index, record
        if token == b",":
            index, start = index + 1, end + 1
            continue
        if rest:
            yield index + 1, BadPrompt("malformed", f"{path.name}: data after the array ends: {rest[:60]!r}", rest)
        return


def _element_end(data, start: int, *, limit: int | None = None) -> tuple[int | None, bytes | None]:
    """(position, token) of the `,` or `]` that ends the array element starting at `start`; (None, None)
    when the file ends first or (with `limit`) the element runs past `limit` bytes."""
    depth, pos = 0, start
    stop = len(data) if limit is None else min(len(data), start + limit + 1)
    search = _JSON_TOKEN.search
    while (match := search(data, pos, stop)) is not None:
        token, pos = match.group(), match.end()
        if token in (b"[", b"{"):
            depth += 1
        elif token in (b"]", b"}"):
            if depth:
                depth -= 1
            elif token == b"]":
                return match.start(), token
        elif token == b",":
            if not depth:
                return match.start(), token
        elif token == b'"':  # a lone quote: a string that never closes
            break
    return None, None


def _parse_element(raw: bytes, *, index: int, max_bytes: int | None) -> Any:
    if not raw:
        return BadPrompt("malformed", f"record {index} is empty (two commas in a row or a trailing comma)", raw)
    record = _parse(raw, where=f"record {index}", max_bytes=max_bytes)
    if isinstance(record, BadPrompt):
        record.raw = raw
    return record


def _resume_at_error(data, start: int) -> tuple[int, int] | None:
    """(comma, start) of the element where the JSON decoder stopped reading the element that begins at `start`
    and ran on: an object left open stops it where the next element begins (`{"id": "b", "messages": [...],
    {"id": "c", ...` fails at c's brace, a value where a key belongs). None when it stopped anywhere else, or
    the element there does not parse whole."""
    window = bytes(data[start:start + RUN_ON_WINDOW])
    try:
        text = window.decode("utf-8")
    except UnicodeDecodeError as error:  # a character cut by the window's end, or bad bytes: read up to them
        text = window[:error.start].decode("utf-8")
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError as error:
        pos = error.pos
    except RecursionError:
        return None
    before = text[:pos].rstrip(" \t\r\n")
    if pos >= len(text) or not before.endswith(","):
        return None
    begin, comma = start + len(text[:pos].encode()), start + len(before.encode()) - 1
    if isinstance(_whole_element(data, begin), BadPrompt):
        return None
    return comma, begin


def _next_record(data, start: int, stop: int) -> tuple[int, int] | None:
    """(comma, start) of the first record that begins after `start` and before `stop`: an object after a
    comma that parses whole as an element and holds a conversation list. None when there is none."""
    for match in _OBJECT_AFTER_COMMA.finditer(data, start + 1, stop):
        record = _whole_element(data, match.end() - 1)
        if isinstance(record, dict) and any(isinstance(record.get(key), list) for key in _CONVERSATION_KEYS):
            return match.start(), match.end() - 1
    return None


def _whole_element(data, begin: int) -> Any:
    """The element that begins at `begin`, parsed, when it ends within RUN_ON_WINDOW bytes; else a `BadPrompt`."""
    end, _ = _element_end(data, begin, limit=RUN_ON_WINDOW)
    if end is None:
        return BadPrompt("malformed", f"no element ends within {RUN_ON_WINDOW:,} bytes of byte {begin}")
    return _parse(bytes(data[begin:end]), where=f"byte {begin}", max_bytes=None)


def _ran_on(raw: bytes, *, index: int, resume_at: int, max_bytes: int | None) -> Any:
    """Record `index`, cut where the next whole record begins: still bad, or (rarely) whole once cut."""
    record = _parse_element(raw, index=index, max_bytes=max_bytes)
    if not isinstance(record, BadPrompt):
        return record
    return BadPrompt(record.reason, f"{record.detail}; a bracket or string left open ran it into the records after "
                                    f"it: reading resumed at the next whole record (byte {resume_at:,})", raw)


def _cut_short(raw: bytes, *, index: int, name: str, max_bytes: int | None) -> Iterator[tuple[int, Any]]:
    """The end of a file cut before its array closes: a whole last record is kept, then `truncated`."""
    if raw and not isinstance(record := _parse(raw, where=f"record {index}", max_bytes=max_bytes), BadPrompt):
        yield index, record
        index, raw = index + 1, b""
    where = f"inside record {index}" if raw else f"after record {index - 1}, before the array closes"
    yield index, BadPrompt("truncated", f"{name} ends {where}", raw)


def _shape_error(path: Path, data, pos: int) -> str:
    first = data[pos:pos + 1]
    if first == b"{":
        key = re.match(rb'\{\s*"([^"\\]{1,60})"\s*:\s*\[', data[pos:pos + 4096])
        hint = f" (its first key, {key.group(1).decode(errors='replace')!r}, holds a list)" if key else ""
        return (f"{path}: the top level is a JSON object{hint}, not an array of records; write the records as "
                f"a JSON array or as JSONL, e.g. `jq -c '.data[]' {path.name} > {path.stem}.jsonl`")
    return f"{path}: not a JSON array of records (the file starts with {first!r}); use a JSON array or JSONL"


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield index, row
                index += 1
    except (pa.ArrowException, OSError) as error:
        if not index:
            raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
        yield index, BadPrompt("truncated", f"{path.name}: unreadable after record {index - 1} ({error})")
