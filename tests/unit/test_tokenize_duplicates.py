"""Duplicate ids and oversized lines in completion shards: a later line with an id seen before (in its
shard or an earlier one) is quarantined as `duplicate_id` naming the first, and a line over
`max_record_bytes` is quarantined as `record_too_large` without being parsed; every other record is kept
and every line is counted once.

Run: .venv/bin/python -m pytest -q tests/unit/test_tokenize_duplicates.py
"""

from __future__ import annotations

import hashlib
import json

import pytest

import tasks.tokenize as tokenize_tasks
from dflash_core.data import completion
from dflash_core.storage import SHA256_METADATA_KEY, ObjectInfo, ObjectNotFound
from dflash_core.tokenize import (
    Duplicate, TokenizeConfig, TokenizePool, find_duplicates, line_ids, quarantine_bytes, read_arrow_bytes,
    summarize, tokenize_shard,
)
from dflash_core.tokenize.duplicates import _RecordId, record_id
from dflash_core.tokenize.shard import QUARANTINE_HEAD_BYTES, StaleDuplicates, shard_lines
from dflash_core.tokenize.stats import sample_frame, skipped_frame
from tests.unit.conftest_tokenize import jsonl, make_record


def records(*ids: str) -> bytes:
    return jsonl(*[make_record(id=i, content=f"Answer for {i}.") for i in ids])


def counted_once(result) -> bool:
    return result.table.num_rows + sum(result.skipped.values()) == result.num_lines


def test_find_duplicates_names_the_first_occurrence_within_and_across_shards():
    found = find_duplicates({
        "a.jsonl": ["x", "y", None, "x"],
        "b.jsonl": ["z", "y", "x", None],
        "c.jsonl": ["w"],
    })
    assert found == {
        "a.jsonl": {4: Duplicate("x", "a.jsonl", 1)},
        "b.jsonl": {2: Duplicate("y", "a.jsonl", 2), 3: Duplicate("x", "a.jsonl", 1)},
    }
    # Shard order is the mapping's order: the same shards the other way round keep b's copies.
    assert find_duplicates({"b.jsonl": ["y"], "a.jsonl": ["y"]}) == {"a.jsonl": {1: Duplicate("y", "b.jsonl", 1)}}
    assert find_duplicates({}) == {}


def test_ids_are_read_without_validation_and_unreadable_ones_are_left_out():
    lines = [
        make_record(id="ok").to_json_line().rstrip(b"\n"),
        b'{"id": "only-an-id"}',  # an invalid record still has a readable id
        b'{"id": 5}',
        b'["id", "x"]',
        b'{"id": "torn',
        b"   ",
        b'{"id": "big", "content": "' + b"x" * 2000 + b'"}',
    ]
    assert line_ids(lines, max_record_bytes=1000) == ["ok", "only-an-id", None, None, None, None, None]
    assert record_id(lines[-1], max_record_bytes=3000) == "big"


def test_a_repeated_id_within_a_shard_is_quarantined_and_names_its_first_line(qwen_target):
    data = records("a", "b") + records("a") + b"\n" + records("c", "b")
    result = tokenize_shard(data, target=qwen_target, config=TokenizeConfig(), chunk_lines=2,
                            name="s3://unit/completions/d/r/shard-00000.jsonl")
    assert result.table.column("id").to_pylist() == ["a", "b", "c"]
    assert result.skipped == {"duplicate_id": 2, "blank_line": 1}
    assert counted_once(result)
    first_a, first_b = result.quarantine
    assert (first_a.line, first_a.reason, first_a.source) == (3, "duplicate_id", "unit")
    assert first_a.raw == make_record(id="a", content="Answer for a.").to_json_line().rstrip(b"\n")
    assert first_a.detail == "id 'a' was first seen at line 1 of s3://unit/completions/d/r/shard-00000.jsonl"
    assert first_b.line == 6 and "id 'b' was first seen at line 2 of" in first_b.detail  # across chunks
    written = [json.loads(line) for line in quarantine_bytes(result.quarantine).splitlines()]
    assert [row["first_seen"] for row in written] == [
        {"shard": "s3://unit/completions/d/r/shard-00000.jsonl", "line": 1},
        {"shard": "s3://unit/completions/d/r/shard-00000.jsonl", "line": 2},
    ]


def test_within_shard_duplicates_match_through_the_process_pool(qwen_target):
    data = records("a", "b", "a", "c", "b", "a")
    config = TokenizeConfig()
    inline = tokenize_shard(data, target=qwen_target, config=config, chunk_lines=2)
    with TokenizePool(target=qwen_target, config=config, workers=1) as pool:
        pooled = tokenize_shard(data, target=qwen_target, config=config, pool=pool, chunk_lines=2)
    assert pooled.table.equals(inline.table)
    assert pooled.table.column("id").to_pylist() == ["a", "b", "c"]
    assert pooled.skipped == inline.skipped == {"duplicate_id": 3}
    assert [(q.line, q.duplicate_of.first_line) for q in pooled.quarantine] == [(3, 1), (5, 2), (6, 1)]


def test_duplicates_of_earlier_shards_are_quarantined_and_override_the_shards_own(qwen_target):
    shards = {"shard-00000.jsonl": records("a", "b"), "shard-00001.jsonl": records("c", "a", "a", "d")}
    found = find_duplicates({key: line_ids(shard_lines(data), max_record_bytes=TokenizeConfig().max_record_bytes)
                             for key, data in shards.items()})
    assert found == {"shard-00001.jsonl": {2: Duplicate("a", "shard-00000.jsonl", 1),
                                           3: Duplicate("a", "shard-00000.jsonl", 1)}}
    result = tokenize_shard(shards["shard-00001.jsonl"], target=qwen_target, config=TokenizeConfig(),
                            name="shard-00001.jsonl", duplicates=found["shard-00001.jsonl"])
    assert result.table.column("id").to_pylist() == ["c", "d"]
    assert result.skipped == {"duplicate_id": 2}
    # Line 3 repeats line 2 of its own shard, but the id was first seen in shard-00000: that is what it names.
    assert [q.detail for q in result.quarantine] == ["id 'a' was first seen at line 1 of shard-00000.jsonl"] * 2
    first = tokenize_shard(shards["shard-00000.jsonl"], target=qwen_target, config=TokenizeConfig())
    assert first.table.column("id").to_pylist() == ["a", "b"] and not first.quarantine


def test_duplicates_read_from_another_version_of_the_shard_are_refused(qwen_target):
    data = records("a", "b")
    with pytest.raises(StaleDuplicates, match=r"shard s1: duplicate id 'x' is said to be at line 2, which holds "
                                              r"id 'b'"):
        tokenize_shard(data, target=qwen_target, config=TokenizeConfig(), name="s1",
                       duplicates={2: Duplicate("x", "s0", 1)})
    with pytest.raises(StaleDuplicates, match=r"line 9, which holds nothing \(the shard has 2 lines\)"):
        tokenize_shard(data, target=qwen_target, config=TokenizeConfig(), duplicates={9: Duplicate("a", "s0", 1)})


def test_quarantined_duplicates_count_as_duplicate_ids_not_as_skipped(qwen_target):
    result = tokenize_shard(records("a", "b", "a") + b"not json\n", target=qwen_target, config=TokenizeConfig())
    samples = sample_frame(result.table, shard="s")
    skipped = skipped_frame(result.quarantine, shard="s")
    overall = summarize(samples, skipped).row(0, named=True)
    assert (overall["samples"], overall["skipped"], overall["duplicate_ids"]) == (2, 1, 1)
    by_source = summarize(samples, skipped, by="source").row(0, named=True)
    assert (by_source["source"], by_source["duplicate_ids"]) == ("unit", 1)


def test_a_line_over_max_record_bytes_is_quarantined_before_it_is_parsed(qwen_target, monkeypatch):
    huge = make_record(id="huge", content="word " * 600_000).to_json_line()  # ~3 MB
    data = records("a") + huge + records("b")
    parsed: list[int] = []  # the length of every line a JSON parser (full record or id reader) is given
    for model in (completion.CompletionRecord, _RecordId):
        monkeypatch.setattr(model, "model_validate_json", lambda raw, _real=model.model_validate_json, **kw:
                            parsed.append(len(raw)) or _real(raw, **kw))
    config = TokenizeConfig(max_record_bytes=1_000_000)
    result = tokenize_shard(data, target=qwen_target, config=config)
    assert result.table.column("id").to_pylist() == ["a", "b"]
    assert result.skipped == {"record_too_large": 1}
    assert counted_once(result)
    assert parsed and max(parsed) < 1_000_000, "the oversized line reached a JSON parser"
    (line,) = result.quarantine
    assert (line.line, line.reason) == (2, "record_too_large")
    assert f"line is {len(huge) - 1:,} bytes, over max_record_bytes 1,000,000" in line.detail
    assert line.raw == huge[:QUARANTINE_HEAD_BYTES]
    summary = summarize(sample_frame(result.table, shard="s"), skipped_frame(result.quarantine, shard="s"))
    assert summary.row(0, named=True)["skipped"] == 1
    # Under the default limit (DEFAULT_MAX_RECORD_BYTES) the same line is an ordinary record.
    assert TokenizeConfig().max_record_bytes > len(huge)


def test_the_cut_of_an_oversized_line_keeps_whole_characters(qwen_target):
    huge = make_record(id="wide", content="é" * 20_000).to_json_line()
    result = tokenize_shard(huge, target=qwen_target, config=TokenizeConfig(max_record_bytes=10_000))
    (row,) = [json.loads(line) for line in quarantine_bytes(result.quarantine).splitlines()]
    assert row["reason"] == "record_too_large" and row["raw_base64"] is None
    assert huge.decode().startswith(row["text"]) and len(row["text"].encode()) > QUARANTINE_HEAD_BYTES - 2


class MemoryStore:
    """The few ObjectStore calls the tokenize tasks make, in memory."""

    def __init__(self):
        self.objects: dict[str, tuple[bytes, ObjectInfo]] = {}

    def uri(self, key: str) -> str:
        return f"s3://unit/{key}"

    def put_bytes(self, key: str, data: bytes, **_) -> ObjectInfo:
        info = ObjectInfo(key=key, size=len(data), etag=hashlib.md5(data).hexdigest(),
                          metadata={SHA256_METADATA_KEY: hashlib.sha256(data).hexdigest()})
        self.objects[key] = (data, info)
        return info

    def head(self, key: str) -> ObjectInfo:
        if key not in self.objects:
            raise ObjectNotFound(self.uri(key))
        return self.objects[key][1]

    def get_bytes(self, key: str, **_) -> bytes:
        return self.objects[key][0]

    def exists(self, key: str) -> bool:
        return key in self.objects

    def delete_many(self, keys) -> int:
        return sum(self.objects.pop(key, None) is not None for key in keys)


def test_the_shard_task_reads_ids_quarantines_the_drops_and_keys_its_cache_on_them(qwen_target, monkeypatch):
    store = MemoryStore()
    monkeypatch.setattr(tokenize_tasks.ObjectStore, "from_settings", lambda settings: store)
    keys = ["completions/d/r/shard-00000.jsonl", "completions/d/r/shard-00001.jsonl"]
    store.put_bytes(keys[0], records("a", "b"))
    store.put_bytes(keys[1], records("b", "c"))
    config = TokenizeConfig()
    ids = {key: tokenize_tasks.read_completion_ids.fn(None, input_key=key, max_record_bytes=config.max_record_bytes)
           for key in keys}
    assert ids == {keys[0]: ["a", "b"], keys[1]: ["b", "c"]}
    duplicates = find_duplicates(ids)

    output_key = "tokenized/d/r/shard-00001.arrow"
    summary = tokenize_tasks.tokenize_completion_shard.fn(
        None, input_key=keys[1], output_key=output_key, target=qwen_target, config=config,
        duplicates=duplicates.get(keys[1], {}))
    assert (summary.samples, summary.skipped) == (1, {"duplicate_id": 1})
    assert read_arrow_bytes(store.get_bytes(output_key)).column("id").to_pylist() == ["c"]
    (quarantined,) = [json.loads(line) for line in store.get_bytes(summary.quarantine_key).splitlines()]
    assert quarantined["reason"] == "duplicate_id" and quarantined["line"] == 1
    assert quarantined["first_seen"] == {"shard": store.uri(keys[0]), "line": 2}

    def cache_key(drops):
        return tokenize_tasks.shard_cache_key(None, {"settings": None, "input_key": keys[1], "output_key": output_key,
                                                     "target": qwen_target, "config": config, "duplicates": drops})

    assert cache_key(duplicates[keys[1]]) != cache_key({}) == cache_key(None)
    assert cache_key({1: Duplicate("b", keys[0], 2)}) == cache_key(duplicates[keys[1]])
    assert cache_key({1: Duplicate("b", keys[0], 1)}) != cache_key(duplicates[keys[1]])
