"""Statistics, defect detectors and the quality gate: an empty dataset fails with a message that says
what is wrong and what to do, a healthy one passes, and the override turns failures into warnings.

Run: .venv/bin/python -m pytest -q tests/unit/test_tokenize_gate.py
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from dflash_core.tokenize import (
    GateThresholds, QualityGateError, TokenizeConfig, check_gate, enforce_gate, histogram_png, loss_histogram,
    sample_frame, skipped_frame, stats_markdown, stats_rows, summarize, tokenize_shard,
)
from dflash_core.tokenize.detect import distinct_ngram_fraction, is_repetition_loop, max_identical_tool_calls
from tests.unit.conftest_tokenize import jsonl, make_record


def frames(target, data: bytes, shard: str = "shard-00000", config=TokenizeConfig()):
    result = tokenize_shard(data, target=target, config=config)
    return (sample_frame(result.table, shard=shard),
            skipped_frame(result.quarantine, shard=shard, blank_lines=result.skipped.get("blank_line", 0)))


def test_gate_trips_on_a_dataset_generated_without_thinking(qwen_target):
    empty = [make_record(id=f"e{i}", source="empty-set", reasoning="", content="") for i in range(9)]
    data = jsonl(*empty, make_record(id="fine", source="empty-set", content="A real answer with some words."))
    samples, skipped = frames(qwen_target, data)
    summary = summarize(samples, skipped, by="source")
    row = summary.row(0, named=True)
    assert (row["samples"], row["boilerplate_only"], row["empty_reasoning"], row["short_loss"]) == (10, 9, 9, 9)
    problems = check_gate(summary, GateThresholds())
    assert {p.check for p in problems} >= {"max_short_fraction", "max_boilerplate_fraction",
                                           "max_empty_reasoning_fraction"}
    with pytest.raises(QualityGateError) as error:
        enforce_gate(problems, override=False)
    message = str(error.value)
    assert ("dataset 'empty-set': 90% of samples have <= 8 loss tokens: completions look empty; "
            "were they generated with thinking mode?") in message
    assert "override_quality_gate=True" in message
    warnings = enforce_gate(problems, override=True)
    assert len(warnings) == len(problems) and all(w.startswith("quality gate overridden") for w in warnings)


def test_healthy_dataset_passes_and_bad_lines_count_against_skipped_fraction(qwen_target):
    good = [make_record(id=f"g{i}", content=f"Answer number {i}, explained in a sentence.") for i in range(20)]
    samples, skipped = frames(qwen_target, jsonl(*good))
    assert check_gate(summarize(samples, skipped), GateThresholds()) == []
    samples, skipped = frames(qwen_target, jsonl(*good) + b"{oops\n" * 5)
    problems = check_gate(summarize(samples, skipped, by="shard"), GateThresholds())
    assert [p.check for p in problems] == ["max_skipped_fraction"]
    assert "20% of lines were quarantined" in problems[0].message


def test_summary_numbers_and_table():
    samples = pl.DataFrame({
        "id": [f"s{i}" for i in range(10)] + ["s0"],
        "source": ["a"] * 6 + ["b"] * 5,
        "num_tokens": [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110],
        "num_loss_tokens": [0, 2, 5, 8, 9, 20, 40, 60, 80, 90, 100],
        **{flag: [False] * 10 + [True] for flag in ("truncated", "boilerplate_only", "empty_reasoning",
                                                   "degenerate_repetition", "degenerate_tool_calls")},
        "shard": ["x"] * 11,
    })
    skipped = pl.DataFrame({"shard": ["x", "x"], "source": ["b", None], "reason": ["too_long", "malformed_json"]})
    overall = summarize(samples, skipped).row(0, named=True)
    assert overall["samples"] == 11 and overall["skipped"] == 2
    assert overall["total_tokens"] == 660 and overall["loss_tokens"] == 414
    assert overall["median_len"] == 60 and overall["p90_len"] == 100 and overall["max_len"] == 110
    assert overall["short_loss"] == 4 and overall["duplicate_ids"] == 1 and overall["truncated"] == 1
    by_source = {row["source"]: row for row in stats_rows(summarize(samples, skipped, by="source"))}
    assert by_source["a"]["samples"] == 6 and by_source["b"]["skipped"] == 1
    assert by_source["a"]["loss_ratio"] == round(44 / 210, 3)
    # Split in two narrow tables, the gate's counts first, so the gate columns show in the UI.
    gate_table, size_table = stats_markdown(summarize(samples, skipped)).split("Sizes (tokens)")
    assert gate_table.splitlines()[2] == ("| dataset | samples | skipped | short_loss | boilerplate_only | "
                                          "empty_reasoning | degenerate_repetition | degenerate_tool_calls | "
                                          "truncated | duplicate_ids |")
    assert gate_table.splitlines()[4].startswith("| all | 11 | 2 | 4 |")
    assert size_table.splitlines()[2].startswith("| dataset | samples | total_tokens | loss_tokens |")
    bins = {row["bin"]: row["samples"] for row in loss_histogram(samples)}
    assert bins["0"] == 1 and bins["1-2"] == 1 and bins["5-8"] == 2 and bins["9-16"] == 1 and bins["33-64"] == 2 and bins["65-128"] == 3
    assert histogram_png(samples).startswith(b"\x89PNG\r\n\x1a\n")


def test_repetition_and_tool_call_loop_detectors(qwen_target):
    rng = np.random.default_rng(0)
    varied = rng.integers(0, 40_000, size=800, dtype=np.uint32)
    looped = np.concatenate([varied[:200], np.tile(varied[:7], 100)])
    assert distinct_ngram_fraction(varied, n=6) == 1.0
    assert not is_repetition_loop(varied, n=6, window=1024, min_distinct=0.3)
    assert is_repetition_loop(looped, n=6, window=1024, min_distinct=0.3)
    assert not is_repetition_loop(looped[:40], n=6, window=1024, min_distinct=0.3), "too short to judge"

    call = {"function": {"name": "search", "arguments": '{"q": "x"}'}}
    assert max_identical_tool_calls(make_record(tool_calls=[call] * 4)) == 4
    text_loop = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n' * 5
    assert max_identical_tool_calls(make_record(content=text_loop)) == 5

    loop_text = "I will check again. " * 150
    data = jsonl(make_record(id="loop", content=loop_text), make_record(id="tools", tool_calls=[call] * 3),
                 make_record(id="ok", content="A normal answer."))
    samples, skipped = frames(qwen_target, data)
    flags = {row["id"]: row for row in samples.iter_rows(named=True)}
    assert flags["loop"]["degenerate_repetition"] and not flags["ok"]["degenerate_repetition"]
    assert flags["tools"]["degenerate_tool_calls"] and not flags["loop"]["degenerate_tool_calls"]
    problems = check_gate(summarize(samples, skipped), GateThresholds())
    assert [p.check for p in problems] == ["max_degenerate_fraction"]
    assert "1 n-gram loops, 1 repeated <tool_call> blocks" in problems[0].message


def test_duplicate_ids_are_checked_not_only_counted(qwen_target):
    records = [make_record(id=f"r{i % 4}", content=f"Answer {i}, in a short sentence.") for i in range(6)]
    samples, skipped = frames(qwen_target, jsonl(*records))
    problems = check_gate(summarize(samples, skipped), GateThresholds())
    assert [p.check for p in problems] == ["max_duplicate_ids"]
    assert "all datasets: 2 samples repeat the id of another sample" in problems[0].message
    assert check_gate(summarize(samples, skipped), GateThresholds(max_duplicate_ids=2)) == []


def test_gate_error_names_the_dataset_and_checks_and_survives_pickling():
    import pickle

    from dflash_core.tokenize import GateProblem, QualityGateError, enforce_gate

    problems = [GateProblem("all", "max_short_fraction", 1.0, 0.2, "all datasets: 100% of samples are short"),
                GateProblem("web", "max_short_fraction", 1.0, 0.2, "dataset 'web': 100% of samples are short")]
    try:
        enforce_gate(problems, override=False, dataset="demo/smollm2")
    except QualityGateError as error:
        raised = error
    message = str(raised)
    assert message.startswith("dataset demo/smollm2 failed the quality gate (max_short_fraction):")
    assert "override_quality_gate" in message and message.count("max_short_fraction") == 1
    again = pickle.loads(pickle.dumps(raised))  # how a failed run's state reaches the result store
    assert str(again) == message and again.problems == problems
