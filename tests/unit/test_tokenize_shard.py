"""Whole-shard tokenization: bad records are counted and quarantined with their original bytes while
every valid record reaches the table; truncation policy; Arrow output; the process pool matches
the inline path exactly.

Run: .venv/bin/python -m pytest -q tests/unit/test_tokenize_shard.py
"""

from __future__ import annotations

import base64
import json

import pyarrow as pa
import pytest

from dflash_core.tokenize import (
    SCHEMA, TokenizeConfig, TokenizePool, arrow_bytes, quarantine_bytes, read_arrow_bytes, tokenize_shard,
)
from tests.unit.conftest_tokenize import jsonl, make_record

BAD_LINES = {
    "malformed_json": b'{"id": "broken", ',
    "invalid_utf8": b'{"id": "\xff\xfe"}',
    "not_an_object": b'"just a string"',
    "missing_field": json.dumps({"id": "x", "source": "unit"}).encode(),
    "wrong_role": json.dumps(make_record(id="bad-role").model_dump() | {
        "prompt": [{"role": "gpt", "content": "hi"}]}).encode(),
    "unsupported_schema_version": json.dumps(make_record(id="v9").model_dump() | {"schema_version": 9}).encode(),
    "invalid_field": json.dumps(make_record(id="bad-finish").model_dump() | {"finish_reason": "eos"}).encode(),
}


def test_bad_record_matrix_quarantines_each_line_and_keeps_every_valid_one(qwen_target):
    lines, good_ids, expected_lines = [], [], {}
    for index, (reason, raw) in enumerate(BAD_LINES.items()):
        lines.append(make_record(id=f"good-{index}").to_json_line())
        good_ids.append(f"good-{index}")
        lines.append(raw + b"\n")
        expected_lines[reason] = len(lines)
    lines.append(b"\n")  # a blank line is counted, not quarantined
    lines.append(make_record(id="last").to_json_line())
    good_ids.append("last")

    result = tokenize_shard(b"".join(lines), target=qwen_target, config=TokenizeConfig())

    assert result.table.column("id").to_pylist() == good_ids
    assert result.skipped == {**{reason: 1 for reason in BAD_LINES}, "blank_line": 1}
    assert result.num_lines == len(lines)
    by_reason = {q.reason: q for q in result.quarantine}
    assert set(by_reason) == set(BAD_LINES)
    for reason, raw in BAD_LINES.items():
        assert by_reason[reason].line == expected_lines[reason]
        assert by_reason[reason].raw == raw
    written = [json.loads(row) for row in quarantine_bytes(result.quarantine).splitlines()]
    utf8 = next(row for row in written if row["reason"] == "invalid_utf8")
    assert utf8["text"] is None and base64.b64decode(utf8["raw_base64"]) == BAD_LINES["invalid_utf8"]
    malformed = next(row for row in written if row["reason"] == "malformed_json")
    assert malformed["text"].encode() == BAD_LINES["malformed_json"] and malformed["detail"]


def test_truncate_policy_cuts_and_counts(qwen_target):
    long = make_record(id="long", content="word " * 200)
    short = make_record(id="short")
    config = TokenizeConfig(max_length=64, overlong="truncate")
    result = tokenize_shard(jsonl(long, short), target=qwen_target, config=config)
    rows = {row["id"]: row for row in result.table.to_pylist()}
    assert rows["long"]["truncated"] and rows["long"]["num_tokens"] == 64 == len(rows["long"]["input_ids"])
    assert rows["long"]["num_loss_tokens"] == sum(rows["long"]["loss_mask"]) > 0
    assert rows["long"]["loss_mask"][-1] == 1
    assert not rows["short"]["truncated"]


def test_drop_policy_quarantines_long_samples_and_prompts_too_long(qwen_target):
    long = make_record(id="long", content="word " * 200)
    long_prompt = make_record(id="long-prompt", prompt=[{"role": "user", "content": "question " * 200}])
    dropped = tokenize_shard(jsonl(long, make_record(id="ok")), target=qwen_target,
                             config=TokenizeConfig(max_length=64, overlong="drop"))
    assert dropped.table.column("id").to_pylist() == ["ok"]
    assert dropped.skipped == {"too_long": 1}
    assert "> max_length 64" in dropped.quarantine[0].detail and dropped.quarantine[0].source == "unit"
    cut = tokenize_shard(jsonl(long_prompt), target=qwen_target, config=TokenizeConfig(max_length=64))
    assert cut.table.num_rows == 0 and cut.skipped == {"prompt_too_long": 1}


def test_arrow_output_schema_and_metadata(qwen_target):
    result = tokenize_shard(jsonl(make_record(id="a"), make_record(id="b")), target=qwen_target,
                            config=TokenizeConfig())
    table = read_arrow_bytes(arrow_bytes(result.table, metadata={"dflash.tokenizer_sha256": qwen_target.content_hash}))
    assert table.schema.field("input_ids").type == pa.list_(pa.uint32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.uint8())
    assert table.schema.remove_metadata().equals(SCHEMA)
    assert table.schema.metadata[b"dflash.tokenizer_sha256"] == qwen_target.content_hash.encode()
    assert table.schema.metadata[b"dflash.tokenized_schema_version"] == b"1"
    assert table.column("num_tokens").to_pylist() == [len(ids) for ids in table.column("input_ids").to_pylist()]


def test_process_pool_gives_the_same_table_as_inline(qwen_target):
    records = [make_record(id=f"r{i}", content=f"answer {i} " * (i % 7 + 1)) for i in range(40)]
    data = jsonl(*records) + b"not json\n"
    config = TokenizeConfig()
    inline = tokenize_shard(data, target=qwen_target, config=config, chunk_lines=8)
    with TokenizePool(target=qwen_target, config=config, workers=2) as pool:
        pooled = tokenize_shard(data, target=qwen_target, config=config, pool=pool, chunk_lines=8)
    assert pooled.table.equals(inline.table)
    assert pooled.skipped == inline.skipped == {"malformed_json": 1}
    assert [q.line for q in pooled.quarantine] == [41]


def test_pool_rejects_zero_workers(qwen_target):
    with pytest.raises(ValueError, match="workers must be >= 1"):
        TokenizePool(target=qwen_target, config=TokenizeConfig(), workers=-1)
