"""The pipeline's summary page in the Prefect UI (dflash_core/run_summary.py `summary_markdown`) keeps its links in
view: a table cell of a long unbroken URI widens the table past the page, so each row's links (a stage's flow run,
an artifact group's lineage) come before the long cells, the "made" cells name a long URI by its last segments, and
every URI so shortened is in the artifacts section in full.

Run: `.venv/bin/python -m pytest -n 0 -q tests/unit/test_run_summary_markdown.py`
"""

from __future__ import annotations

import re

from dflash_core.run_summary import StageRun, summary_markdown

BUCKET = "s3://dflash-bucket-of-a-real-team"
PLAN = f"{BUCKET}/reports/plan/qwen3.6-27b-4gpu/2b6f0c1e-6a53-4d0c-9a3e-55d2f7b1e0aa/plan.json"
CKPT = f"{BUCKET}/checkpoints/qwen3.6-27b-dflash-drafter-5-layers/step-001000"
EXPORT = f"{BUCKET}/exports/qwen3.6-27b-dflash-drafter-5-layers/step-001000/speculators"


def _result() -> dict:
    return {"report": PLAN,
            "artifacts": [{"uri": PLAN, "kind": "report"}],
            "training": {"uri": CKPT, "step": 1000, "data": [],
                         "artifacts": [{"uri": f"{CKPT}/model.safetensors", "kind": "checkpoint"}]},
            "export": {"exports": {"speculators": EXPORT},
                       "artifacts": [{"uri": f"{EXPORT}/config.json", "kind": "export"}]}}


def _stages() -> list[StageRun]:
    ui = "http://127.0.0.1:4200/runs/flow-run"
    return [StageRun("pipeline", "brisk-otter", "0", "Completed", 200.0, f"{ui}/0", 0),
            StageRun("train", "brisk-otter-train", "1", "Completed", 95.0, f"{ui}/1", 1),
            StageRun("export", "brisk-otter-export", "2", "Completed", 4.0, f"{ui}/2", 1)]


def _table(markdown: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return [cell.strip() for cell in lines[start].strip("|").split("|")], rows


def test_each_stage_row_has_its_link_before_what_it_made_and_no_long_uri():
    markdown = summary_markdown(_result(), _stages())
    header, rows = _table(markdown, "| stage |")
    assert header.index("flow run") < header.index("made")
    for row in rows:
        assert re.fullmatch(r"\[[\w-]+\]\(http://127\.0\.0\.1:4200/runs/flow-run/\d\)", row[header.index("flow run")])
        made = row[header.index("made")]
        assert not any(len(uri) > 48 for uri in re.findall(r"s3://\S+", made)), made
    made = {row[0].removeprefix("↳ "): row[header.index("made")] for row in rows}
    assert made["train"].startswith("checkpoint …/qwen3.6-27b-dflash-drafter-5-layers/step-001000 (step 1000")
    assert made["export"] == "speculators …/step-001000/speculators"


def test_every_uri_shortened_in_a_made_cell_is_in_the_artifacts_section_in_full():
    markdown = summary_markdown(_result(), _stages())
    header, rows = _table(markdown, "| kind |")
    assert header.index("lineage") < header.index("where")
    where = " ".join(row[header.index("where")] for row in rows)
    for uri in (PLAN, CKPT, EXPORT):
        assert uri in where, uri


def test_a_long_uri_found_nowhere_else_stays_whole():
    audit = f"{BUCKET}/reports/s3-audit/2026-12-05T04-00-00Z/report.json"
    stages = [*_stages(), StageRun("s3-audit", "brisk-otter-s3-audit", "3", "Completed", 2.0, "http://u/3", 1)]
    markdown = summary_markdown({**_result(), "audit": {"report": audit, "objects": 3, "dead_objects": 0}}, stages)
    assert f"report {audit}" in markdown


def test_the_served_stage_shows_the_engines_figures_beside_ours():
    from rich.console import Console

    from dflash_core.run_summary import served_lines, summary

    served = {"engine": "vllm 0.26.0", "tau": 2.104, "evaluator_tau": 2.087, "all_outputs_equal": True,
              "rows": [{"concurrency": 1, "prompts": 64, "target_tokens_per_s": 340.0, "drafted_tokens_per_s": 512.0,
                        "speedup": 1.506, "tau": 2.1, "outputs_equal_target": 64}]}
    text = "\n".join(served_lines(served))
    assert "Served by vllm 0.26.0: engine tau 2.104, our evaluator's 2.087" in text
    assert "| 1 | 340 | 512 | 1.51x | 2.100 | 64/64 |" in text
    assert served_lines({}) == []
    console = Console(width=160, record=True)
    console.print(summary({"served": served}, []))
    assert "drafter served by vllm 0.26.0" in console.export_text()
