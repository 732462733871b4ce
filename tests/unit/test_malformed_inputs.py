"""The malformed-input matrix: one bad record among valid ones, in every file shape the importer reads.
Each case names the reason it must be counted under; every valid record around it is always kept.

Run: `.venv/bin/python -m pytest -q tests/unit/test_malformed_inputs.py`
"""

from __future__ import annotations

import codecs
import json

import pytest

from dflash_core.data.prompts import BAD_PROMPT_REASONS, PromptSource, import_prompts


def _good(i: int) -> dict:
    return {"id": f"ok{i}", "messages": [{"role": "user", "content": f"valid question {i}"}]}


DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
GOOD = [json.dumps(_good(i)).encode() for i in range(3)]

# case -> (bad record as raw JSON bytes, reason, extra PromptSource settings)
CASES = {
    "tools_is_a_string": (b'{"messages": [{"role": "user", "content": "q"}], "tools": "calc"}', "invalid_field", {}),
    "tools_items_not_objects": (b'{"messages": [{"role": "user", "content": "q"}], "tools": [1, 2]}',
                                "invalid_field", {}),
    "lone_surrogate": (b'{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}', "invalid_text", {}),
    "deeply_nested": (DEEP, "malformed", {}),
    "trailing_comma_in_object": (b'{"messages": [{"role": "user", "content": "q"}],}', "malformed", {}),
    "bare_word": (b"nonsense", "malformed", {}),
    "not_an_object": (b"42", "malformed", {}),
    "content_is_an_object": (b'{"messages": [{"role": "user", "content": {"x": 1}}]}', "invalid_field", {}),
    "unknown_role": (b'{"messages": [{"role": "narrator", "content": "q"}]}', "unknown_role", {}),
    "no_conversation": (b'{"text": "q"}', "not_a_conversation", {}),
    "only_an_answer": (b'{"conversations": [{"from": "gpt", "value": "a"}]}', "empty", {}),
    "starts_with_an_answer": (b'{"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}',
                              "needs_context", {}),
    "too_long": (json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode(), "too_long",
                 {"max_chars": 1000}),
    "too_long_unparsed": (json.dumps({"messages": [{"role": "user", "content": "x" * 200_000}]}).encode(),
                          "too_long", {"max_chars": 100}),
    "duplicate": (GOOD[0], "duplicate", {}),
    "content_part_text_not_a_string": (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
                                       "invalid_field", {}),
    "content_part_not_an_object": (b'{"messages": [{"role": "user", "content": ["q"]}]}', "invalid_field", {}),
    "id_is_a_list": (b'{"id": ["a"], "messages": [{"role": "user", "content": "q"}]}', "invalid_field", {}),
    # A bracket or quote left open: in a JSON array the record runs into the ones after it.
    "record_never_closed": (b'{"id": "x", "messages": [{"role": "user", "content": "q"}', "malformed", {}),
    "object_never_closed": (b'{"id": "x", "messages": [{"role": "user", "content": "q"}]', "malformed", {}),
    "string_never_closed": (b'{"id": "x", "messages": [{"role": "user", "content": "q}]}', "malformed", {}),
    "key_quote_missing": (b'{id": "x", "messages": [{"role": "user", "content": "q"}]}', "malformed", {}),
}


def _jsonl(bad: bytes) -> bytes:
    return b"\n".join([GOOD[0], GOOD[1], bad, GOOD[2]]) + b"\n"


def _json_array(bad: bytes) -> bytes:
    return b"[" + b",\n".join([GOOD[0], GOOD[1], bad, GOOD[2]]) + b"]"


@pytest.mark.parametrize("shape", ["jsonl", "json"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_bad_record_is_counted_and_every_valid_one_kept(tmp_path, case, shape) -> None:
    bad, reason, settings = CASES[case]
    path = tmp_path / f"prompts.{shape}"
    path.write_bytes((_jsonl if shape == "jsonl" else _json_array)(bad))
    prompts, report = import_prompts([PromptSource(path, "s", **settings)])
    assert reason in BAD_PROMPT_REASONS
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"]
    assert dict(report.rejected) == {reason: 1}
    assert report.read == 4 and report.accepted == 3
    [line] = report.quarantine
    assert line["reason"] == reason and line["index"] == 2 and line["detail"]
    json.loads(report.quarantine_bytes())  # any bad record can be written to the quarantine file
    json.dumps(line, ensure_ascii=False).encode()  # ... by any JSON writer


@pytest.mark.parametrize("shape", ["jsonl", "json"])
def test_invalid_utf8_and_a_bom_at_the_start(tmp_path, shape) -> None:
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    path = tmp_path / f"prompts.{shape}"
    path.write_bytes(codecs.BOM_UTF8 + (_jsonl if shape == "jsonl" else _json_array)(bad))
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"], "the BOM must not cost the first record"
    assert dict(report.rejected) == {"malformed": 1}
    assert "not valid UTF-8" in report.quarantine[0]["detail"]


def test_json_array_bad_elements_then_truncation(tmp_path) -> None:
    """Several bad elements in a row, then a file cut inside its last record: all valid ones before are kept."""
    path = tmp_path / "p.json"
    path.write_bytes(b"[" + b",".join([GOOD[0], b"{oops}", b"", GOOD[1], b"[1, 2", b"3]", GOOD[2],
                                       b'{"id": "cut", "messages": [{"role": "us']))
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"]
    assert dict(report.rejected) == {"malformed": 3, "truncated": 1}  # {oops}, the empty one, [1, 2,3]
    assert report.read == 7


UNCLOSED = b'{"id": "x", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}'


@pytest.mark.parametrize("indent", [None, 2])
def test_a_record_that_never_closes_costs_only_itself(tmp_path, indent) -> None:
    """valid, unclosed, valid, valid: the scanner resumes at the next whole record, compact or pretty-printed."""
    records = [json.dumps(_good(i), indent=indent).encode() for i in range(3)]
    path = tmp_path / "p.json"
    path.write_bytes(b"[" + b",\n".join([records[0], UNCLOSED, records[1], records[2]]) + b"]")
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"]
    assert dict(report.rejected) == {"malformed": 1} and report.read == 4
    [line] = report.quarantine
    assert line["index"] == 1 and line["record"] == UNCLOSED.decode()
    assert "reading resumed at the next whole record" in line["detail"]


OPEN_OBJECT = b'{"id": "x", "messages": [{"role": "user", "content": "q"}]'  # its closing brace is missing


@pytest.mark.parametrize("after, reason", [(b'{"text": "q"}', "not_a_conversation"), (b"42", "malformed"),
                                           (b'{"conversations": [{"from": "gpt", "value": "a"}]}', "empty")])
def test_the_element_after_an_unclosed_object_is_read_on_its_own(tmp_path, after, reason) -> None:
    """[a, {b never closed, c, d]: the decoder stops where c begins, so reading resumes there and c is counted
    under its own reason, whatever it holds (the scan for the next conversation would skip to d)."""
    path = tmp_path / "p.json"
    path.write_bytes(b"[" + b",\n".join([GOOD[0], OPEN_OBJECT, after, GOOD[1]]) + b"]")
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1"]
    assert report.read == 4 and dict(report.rejected) == ({"malformed": 2} if reason == "malformed" else
                                                          {"malformed": 1, reason: 1})
    assert [(line["index"], line["reason"]) for line in report.quarantine] == [(1, "malformed"), (2, reason)]
    assert report.quarantine[0]["record"] == OPEN_OBJECT.decode()


def test_a_valid_record_after_an_unclosed_object_is_kept(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"[" + b",".join([GOOD[0], OPEN_OBJECT, GOOD[1], GOOD[2]]) + b"]")
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"]
    assert dict(report.rejected) == {"malformed": 1} and report.quarantine[0]["record"] == OPEN_OBJECT.decode()


def test_an_unclosed_record_and_a_cut_at_the_end_are_told_apart(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"[" + b",".join([GOOD[0], UNCLOSED, GOOD[1], GOOD[2], b'{"id": "cut", "mess']))
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"]
    assert dict(report.rejected) == {"malformed": 1, "truncated": 1}
    assert [line["index"] for line in report.quarantine] == [1, 4]


def test_a_file_cut_after_a_whole_record_keeps_it(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"[" + b",".join(GOOD))  # the closing bracket is missing
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"]
    assert dict(report.rejected) == {"truncated": 1}
    assert "after record 2, before the array closes" in report.quarantine[0]["detail"]


def test_a_stray_closing_bracket_does_not_end_the_array(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b"[" + GOOD[0] + b"], " + GOOD[1] + b", " + GOOD[2] + b"]")
    prompts, report = import_prompts([PromptSource(path, "s")])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1", "ok2"]
    assert dict(report.rejected) == {"malformed": 1} and report.quarantine[0]["record"] == "]"


@pytest.mark.parametrize("text,match", [
    (b'{"data": [{"messages": []}]}', r"top level is a JSON object \(its first key, 'data', holds a list\)"),
    (b'"just a string"', "not a JSON array of records"),
    (b"", "the file is empty"),
])
def test_a_json_file_of_another_shape_is_an_error_naming_it(tmp_path, text, match) -> None:
    path = tmp_path / "wrapped.json"
    path.write_bytes(text)
    with pytest.raises(ValueError, match=match) as error:
        import_prompts([PromptSource(path, "s")])
    assert str(path) in str(error.value)


def test_a_file_that_is_not_parquet_is_an_error_naming_it(tmp_path) -> None:
    path = tmp_path / "prompts.parquet"
    path.write_bytes(b"PAR1 but not really")
    with pytest.raises(ValueError, match="not a readable Parquet file") as error:
        import_prompts([PromptSource(path, "s")])
    assert str(path) in str(error.value)


def test_bad_source_settings_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="turns='all'"):
        PromptSource(tmp_path / "x.jsonl", "s", turns="all")
    with pytest.raises(ValueError, match="max_chars must be >= 1"):
        PromptSource(tmp_path / "x.jsonl", "s", max_chars=0)


LEFT_OPEN_IN_MESSAGES = b'{"id": "b", "messages": [{"role": "user", "content": "two"'  # its message, list and record
MAX_CHARS = 1_000  # import_prompts parses records of up to 16 * 1,000 + 65,536 bytes


@pytest.mark.parametrize(("bad", "after", "reasons"), [
    (LEFT_OPEN_IN_MESSAGES, json.dumps({"id": "c", "messages": [{"role": "user", "content": "x" * 90_000}]}).encode(),
     [(1, "malformed"), (2, "too_long")]),
    (LEFT_OPEN_IN_MESSAGES[:-1] + b"x" * 90_000 + b'"', b'{"text": "q"}', [(1, "too_long"), (2, "not_a_conversation")]),
], ids=["the-next-record-is-over-the-size-limit", "the-open-record-is-over-the-size-limit"])
def test_import_reads_the_elements_the_parser_reads_after_a_record_left_open(tmp_path, bad, after, reasons) -> None:
    """[a, {b left open inside its messages, c, d]: the parser alone resumes at c (where the JSON decoder stopped);
    import_prompts, whose size limit only decides which records are too long, resumes there too, so c is counted
    under its own reason instead of vanishing into b's quarantined bytes, d is kept and b is quarantined."""
    from dflash_core.data.prompt_files import BadPrompt, iter_raw

    path = tmp_path / "p.json"
    path.write_bytes(b"[" + b", ".join([GOOD[0], bad, after, GOOD[1]]) + b"]")
    parsed = [(index, isinstance(raw, BadPrompt)) for index, raw in iter_raw(path)]
    assert parsed == [(0, False), (1, True), (2, False), (3, False)]
    prompts, report = import_prompts([PromptSource(path, "s", max_chars=MAX_CHARS)])
    assert sorted(p.id for p in prompts) == ["ok0", "ok1"] and report.read == 4
    assert [(line["index"], line["reason"]) for line in report.quarantine] == reasons
    assert "reading resumed at the next whole record" in report.quarantine[0]["detail"]
