"""Tokenize one completion shard: JSONL bytes in, an Arrow table + quarantine lines + skip counts out.

Pure: no object store, no files. `ShardTokenizer` holds one process's state (tokenizer, caches)
and turns a chunk of lines into a record batch; `tokenize_shard` splits a shard into chunks and
runs them inline or on a `TokenizePool`. Every line ends up in exactly one place: the table, the
quarantine (with its reason), or the `blank_line` count. Two reasons are decided before a line is
parsed: `record_too_large` (over `TokenizeConfig.max_record_bytes`, so a huge line costs nothing) and
`duplicate_id` (a later line with an id seen before, in this shard or, from the caller, an earlier one).
"""

from __future__ import annotations

import base64
import codecs
import time
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dflash_core.data.completion import BadRecord, CompletionRecord, parse_completion_line
from dflash_core.tokenize.config import TokenizeConfig
from dflash_core.tokenize.detect import has_empty_reasoning, is_repetition_loop, max_identical_tool_calls
from dflash_core.tokenize.duplicates import Duplicate, find_duplicates, line_ids
from dflash_core.tokenize.encode import EncodedSample, TailEncoder, encode_samples
from dflash_core.tokenize.render import PrefixUnstable, render_sample
from dflash_core.tokenize.target import TargetTokenizer

TOKENIZED_SCHEMA_VERSION = 1
FLAG_COLUMNS = ("truncated", "boilerplate_only", "empty_reasoning", "degenerate_repetition", "degenerate_tool_calls")
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.uint32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        *[(name, pa.bool_()) for name in FLAG_COLUMNS],
    ]
)
# Valid records that are not written to the table (they go to quarantine with the bad ones).
SKIP_REASONS = ("prefix_unstable", "too_long", "prompt_too_long", "render_error")
# Lines quarantined from their raw bytes, before parsing (so whether they are valid is not known).
DUPLICATE_ID = "duplicate_id"  # a later line with an id an earlier line has (duplicates.py)
LINE_REASONS = ("record_too_large", DUPLICATE_ID)
QUARANTINE_HEAD_BYTES = 16_384  # a record_too_large line is kept in the quarantine up to this many bytes


class TemplateFailed(ValueError):
    """The chat template fails on a plain one-turn conversation: it would fail every record of a shard."""


class StaleDuplicates(ValueError):
    """The caller's duplicates name lines that hold other ids: they were read from another version of the shard."""


@dataclass(slots=True)
class QuarantineLine:
    line: int  # 1-based line number in the shard
    reason: str
    detail: str
    raw: bytes  # the line (a record_too_large line: its first QUARANTINE_HEAD_BYTES)
    source: str | None = None  # known when the line parsed as a record
    duplicate_of: Duplicate | None = None  # a duplicate_id line: where its id was first seen

    def to_json(self) -> dict:
        try:
            text, raw_base64 = self.raw.decode("utf-8"), None
        except UnicodeDecodeError:
            text, raw_base64 = None, base64.b64encode(self.raw).decode()
        out = {"line": self.line, "reason": self.reason, "detail": self.detail, "source": self.source,
               "text": text, "raw_base64": raw_base64}
        if self.duplicate_of is not None:
            out["first_seen"] = {"shard": self.duplicate_of.first_shard, "line": self.duplicate_of.first_line}
        return out


@dataclass(slots=True)
class ChunkResult:
    batch: pa.RecordBatch | None = None
    quarantine: list[QuarantineLine] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    cpu_seconds: float = 0.0


@dataclass(slots=True)
class ShardResult:
    table: pa.Table
    quarantine: list[QuarantineLine]
    skipped: Counter  # reason -> count, for every line not in the table
    num_lines: int
    cpu_seconds: float = 0.0  # CPU time of the chunk work, summed over processes


class ShardTokenizer:
    """One process's tokenization state: the target, the config, and caches that last across chunks."""

    def __init__(self, *, target: TargetTokenizer, config: TokenizeConfig):
        self.target = target
        self.config = config
        self.tails = TailEncoder(target)
        self._boilerplate: dict[bool | None, int] = {}
        self._boilerplate_tokens(None)  # fail fast on a template that is not prefix-stable

    def tokenize_lines(self, lines: list[bytes], *, first_line: int = 1,
                       duplicates: dict[int, Duplicate] | None = None) -> ChunkResult:
        """Tokenize lines numbered from `first_line`; `duplicates` (by line number) are quarantined unparsed."""
        started = time.process_time()
        result = ChunkResult()
        records: list[tuple[int, bytes, CompletionRecord]] = []
        duplicates = duplicates or {}
        limit = self.config.max_record_bytes
        for number, raw in enumerate(lines, start=first_line):
            if not raw or raw.isspace():
                result.skipped["blank_line"] += 1
                continue
            if len(raw) > limit:
                self._quarantine(result, number, _head(raw), "record_too_large",
                                 f"line is {len(raw):,} bytes, over max_record_bytes {limit:,}: not parsed; the quarantine "
                                 f"keeps its first {QUARANTINE_HEAD_BYTES:,} bytes, the input shard the whole line")
                continue
            if number in duplicates:
                first = duplicates[number]
                result.skipped[DUPLICATE_ID] += 1
                result.quarantine.append(QuarantineLine(
                    number, DUPLICATE_ID, f"id {first.id!r} was first seen at line {first.first_line} of "
                    f"{first.first_shard}", raw, _source_of(raw), first))
                continue
            try:
                records.append((number, raw, parse_completion_line(raw)))
            except BadRecord as bad:
                self._quarantine(result, number, raw, bad.reason, bad.detail)
        for setting in {record.generation.enable_thinking for _, _, record in records}:
            self._boilerplate_tokens(setting)  # the template check, once per thinking setting
        rendered, kept = [], []
        for number, raw, record in records:
            try:
                rendered.append(render_sample(record, target=self.target, config=self.config))
                kept.append((number, raw, record))
            except PrefixUnstable as error:
                self._quarantine(result, number, raw, "prefix_unstable", str(error), record.source)
            except Exception as error:  # a template's raise_exception() or a jinja error on this record
                self._quarantine(result, number, raw, "render_error", f"{type(error).__name__}: {error}",
                                 record.source)
        rows = []
        for (number, raw, record), encoded in zip(kept, encode_samples(rendered, target=self.target, tails=self.tails)):
            if isinstance(encoded, PrefixUnstable):
                self._quarantine(result, number, raw, "prefix_unstable", str(encoded), record.source)
                continue
            row = self._fit(encoded)
            if isinstance(row, str):
                self._quarantine(result, number, raw, row,
                                 f"{len(encoded.ids)} tokens > max_length {self.config.max_length}", record.source)
                continue
            rows.append((record, row))
        result.batch = self._batch(rows)
        result.cpu_seconds = time.process_time() - started
        return result

    def _fit(self, encoded: EncodedSample) -> tuple[EncodedSample, bool] | str:
        """Apply the max_length policy: (sample, truncated) or the skip reason."""
        limit = self.config.max_length
        if len(encoded.ids) <= limit:
            return encoded, False
        if self.config.overlong == "drop":
            return "too_long"
        if encoded.loss_start >= limit:
            return "prompt_too_long"
        return EncodedSample(encoded.ids[:limit], encoded.loss_start, min(encoded.loss_end, limit)), True

    def _batch(self, rows: list[tuple[CompletionRecord, tuple[EncodedSample, bool]]]) -> pa.RecordBatch:
        config = self.config
        lengths = np.fromiter((len(s.ids) for _, (s, _) in rows), dtype=np.int32, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.concatenate([s.ids for _, (s, _) in rows]) if rows else np.zeros(0, np.uint32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        num_loss = np.zeros(len(rows), dtype=np.int32)
        flags = {name: np.zeros(len(rows), dtype=bool) for name in FLAG_COLUMNS}
        for index, (record, (sample, truncated)) in enumerate(rows):
            start = offsets[index]
            mask[start + sample.loss_start:start + sample.loss_end] = 1
            num_loss[index] = sample.loss_end - sample.loss_start
            loss_ids = sample.ids[sample.loss_start:sample.loss_end]
            flags["truncated"][index] = truncated
            flags["boilerplate_only"][index] = num_loss[index] <= self._boilerplate_tokens(
                record.generation.enable_thinking)
            flags["empty_reasoning"][index] = has_empty_reasoning(
                record, expect_thinking=config.expect_thinking, think_start=config.think_start)
            flags["degenerate_repetition"][index] = is_repetition_loop(
                loss_ids, n=config.repetition_ngram, window=config.repetition_window,
                min_distinct=config.repetition_min_distinct)
            flags["degenerate_tool_calls"][index] = max_identical_tool_calls(record) >= config.max_repeated_tool_calls
        offsets_array = pa.array(offsets, type=pa.int32())
        columns = [
            pa.array([record.id for record, _ in rows], type=pa.string()),
            pa.array([record.source for record, _ in rows], type=pa.string()),
            pa.ListArray.from_arrays(offsets_array, pa.array(ids, type=pa.uint32())),
            pa.ListArray.from_arrays(offsets_array, pa.array(mask, type=pa.uint8())),
            pa.array(lengths, type=pa.int32()),
            pa.array(num_loss, type=pa.int32()),
            *[pa.array(flags[name], type=pa.bool_()) for name in FLAG_COLUMNS],
        ]
        return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)

    def _boilerplate_tokens(self, enable_thinking: bool | None) -> int:
        """Loss tokens of an empty completion with this thinking setting; checks the template once per setting.

        A template that is not prefix-stable for a plain answer raises `PrefixUnstable` for the whole
        shard: it would quarantine every record, so it is the template (or tokenizer) to fix.
        """
        if enable_thinking not in self._boilerplate:
            thought = "" if enable_thinking is False else "Let me think."
            probes = [_probe_record(reasoning=thought, content="Hello! How can I help?",
                                    enable_thinking=enable_thinking),
                      _probe_record(reasoning="", content="", enable_thinking=enable_thinking)]
            try:
                rendered = [render_sample(probe, target=self.target, config=self.config) for probe in probes]
            except PrefixUnstable:
                raise
            except Exception as error:  # a template's raise_exception() or a jinja error
                raise TemplateFailed(
                    f"the chat template of {self.target.name} fails on a plain one-turn conversation "
                    f"(enable_thinking={enable_thinking}), so it would fail every record: "
                    f"{type(error).__name__}: {error}. Fix the template (chat_template) or its template_kwargs"
                ) from None
            answer, empty = encode_samples(rendered, target=self.target, tails=self.tails)
            for encoded in (answer, empty):
                if isinstance(encoded, PrefixUnstable):
                    raise PrefixUnstable(
                        f"the chat template of {self.target.name} is not prefix-stable in tokens "
                        f"(enable_thinking={enable_thinking}): {encoded}. The prompt's tokens change once the "
                        "answer follows them, so no loss mask matches what the target saw; fix the template's "
                        "generation prompt or use the target's own tokenizer"
                    )
            self._boilerplate[enable_thinking] = empty.loss_end - empty.loss_start
        return self._boilerplate[enable_thinking]

    @staticmethod
    def _quarantine(result: ChunkResult, number: int, raw: bytes, reason: str, detail: str,
                    source: str | None = None) -> None:
        result.skipped[reason] += 1
        result.quarantine.append(QuarantineLine(number, reason, detail, raw, source))


def _head(raw: bytes) -> bytes:
    """The first QUARANTINE_HEAD_BYTES of a line, cut at a character boundary when it is UTF-8."""
    head = raw[:QUARANTINE_HEAD_BYTES]
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(head).encode()
    except UnicodeDecodeError:
        return head


def _source_of(raw: bytes) -> str | None:
    """The source of a line that is a valid record (a duplicate's, for the per-source counts), else None."""
    try:
        return parse_completion_line(raw).source
    except BadRecord:
        return None


def _probe_record(*, reasoning: str, content: str, enable_thinking: bool | None) -> CompletionRecord:
    return CompletionRecord(
        id="probe", source="probe", prompt=[{"role": "user", "content": "Hi"}], reasoning=reasoning,
        content=content, finish_reason="stop", generation={"model": "probe", "enable_thinking": enable_thinking},
    )


def shard_lines(data: bytes) -> list[bytes]:
    """A shard's lines as the tokenizer numbers them (line n is item n - 1): a UTF-8 byte-order mark at the
    start is not part of the first record, and a final newline does not make an extra line."""
    lines = data.removeprefix(codecs.BOM_UTF8).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def split_lines(lines: list[bytes], *, chunk_lines: int,
                duplicates: dict[int, Duplicate]) -> list[tuple[int, list[bytes], dict[int, Duplicate]]]:
    """Chunks of (first line number, lines, the chunk's duplicates by line number)."""
    chunks = []
    for start in range(0, len(lines), chunk_lines):
        numbers = range(start + 1, min(start + chunk_lines, len(lines)) + 1)
        chunks.append((start + 1, lines[start:start + chunk_lines],
                       {n: duplicates[n] for n in numbers if n in duplicates}))
    return chunks


def merge_chunks(results: list[ChunkResult], *, num_lines: int) -> ShardResult:
    skipped: Counter = Counter()
    quarantine: list[QuarantineLine] = []
    for chunk in results:
        skipped.update(chunk.skipped)
        quarantine.extend(chunk.quarantine)
    table = pa.Table.from_batches([chunk.batch for chunk in results], schema=SCHEMA)
    assert table.num_rows + sum(skipped.values()) == num_lines, "a line was neither kept nor counted"
    return ShardResult(table=table, quarantine=quarantine, skipped=skipped, num_lines=num_lines,
                       cpu_seconds=sum(chunk.cpu_seconds for chunk in results))


def tokenize_shard(data: bytes, *, target: TargetTokenizer, config: TokenizeConfig, pool=None,
                   chunk_lines: int | None = None, name: str | None = None,
                   duplicates: dict[int, Duplicate] | None = None) -> ShardResult:
    """Tokenize a whole JSONL shard; with `pool` (a TokenizePool) the chunks run on its workers.

    By default chunks are up to 256 lines, and small enough to give each pool worker ~4 of them.
    Errors that fail the whole shard (the template, a dead worker) name it (`name`, e.g. its URI).
    A UTF-8 byte-order mark at the start is not part of the first record (`shard_lines`).
    A line whose id an earlier line of the shard has is quarantined as `duplicate_id`; `duplicates`
    adds the lines whose id an earlier shard has (`find_duplicates` over all shards' ids) and wins
    where both name a line. A duplicate whose line holds another id is refused (`StaleDuplicates`):
    the ids were read from another version of the shard.
    """
    try:
        return _tokenize_shard(data, target=target, config=config, pool=pool, chunk_lines=chunk_lines,
                               name=name, duplicates=duplicates or {})
    except (TemplateFailed, PrefixUnstable) as error:
        if name is None:
            raise
        raise type(error)(f"shard {name}: {error}") from None
    except BrokenProcessPool as error:
        raise RuntimeError(f"shard {name or '<unnamed>'}: a tokenizer process died ({error}); "
                           "was it killed for memory? Retry with fewer workers") from error


def _tokenize_shard(data: bytes, *, target: TargetTokenizer, config: TokenizeConfig, pool, chunk_lines: int | None,
                    name: str | None, duplicates: dict[int, Duplicate]) -> ShardResult:
    lines = shard_lines(data)
    ids = line_ids(lines, max_record_bytes=config.max_record_bytes)
    for number, duplicate in duplicates.items():
        if not 1 <= number <= len(lines) or ids[number - 1] != duplicate.id:
            found = (f"nothing (the shard has {len(lines)} lines)" if not 1 <= number <= len(lines)
                     else "no readable id" if ids[number - 1] is None else f"id {ids[number - 1]!r}")
            raise StaleDuplicates(f"shard {name or '<unnamed>'}: duplicate id {duplicate.id!r} is said to be at "
                                  f"line {number}, which holds {found}: the ids were read from another version of "
                                  "the shard (or with another max_record_bytes); read them again")
    label = name or "this shard"
    drops = {**find_duplicates({label: ids}).get(label, {}), **duplicates}
    if chunk_lines is None:
        workers = pool.workers if pool is not None else 1
        chunk_lines = max(16, min(256, -(-len(lines) // (4 * workers))))
    chunks = split_lines(lines, chunk_lines=chunk_lines, duplicates=drops)
    if pool is not None:
        return merge_chunks(pool.map_chunks(chunks), num_lines=len(lines))
    worker = ShardTokenizer(target=target, config=config)
    return merge_chunks([worker.tokenize_lines(chunk, first_line=first, duplicates=dups)
                         for first, chunk, dups in chunks], num_lines=len(lines))
