"""metrics.jsonl survives a crash mid-write and a resume: the reader skips a torn record and names it,
and a resumed run cuts the log after the step it resumes at (the steps after it, and a torn line, are
logged again), so every step is in the log once and no record is glued to a fragment.

Run: `.venv/bin/python -m pytest tests/unit/test_metrics_log.py -q`
"""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_core.train.checkpoint import complete_checkpoints
from dflash_core.train.assemble import build_trainer
from dflash_core.train.report import load_metrics, read_metrics, trim_metrics
from tests.unit.test_trainer import tiny_config


def _line(step: int, loss: float) -> str:
    return json.dumps({"step": step, "loss": loss}) + "\n"


def test_a_torn_record_is_skipped_by_name_and_the_relogged_step_wins(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_line(1, 3.0) + _line(2, 2.5)[:12] + "\n" + _line(2, 2.4) + '{"loss": 1}\n')
    with pytest.warns(UserWarning, match=r"metrics.jsonl: skipped 2 torn or malformed line\(s\) \(line 2, 4\);"):
        records = read_metrics(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 3.0), (2, 2.4)]


def test_only_dicts_with_an_integer_step_are_records_and_a_glued_record_is_recovered(tmp_path):
    path = tmp_path / "metrics.jsonl"
    bad = ['{"step": "3", "loss": 1}', '{"step": 2.7}', '{"step": true}', "[1, 2]", '"step"', "null"]
    # a log from before end_torn_line: the resumed run's record glued onto the torn one
    glued = '{"step": 2, "lo' + _line(2, 2.4).strip()
    path.write_text("\n".join([_line(1, 3.0).strip(), *bad, glued]) + "\n")
    metrics = load_metrics(path)
    assert [(r["step"], r["loss"]) for r in metrics.records] == [(1, 3.0), (2, 2.4)]
    assert metrics.skipped_lines == [2, 3, 4, 5, 6, 7, 8]
    path.write_text("x\n" * 12)
    assert load_metrics(path).skipped_message().endswith("(line 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ...); a record cut short by a crash "
                                           "mid-write is logged again after the resume")


def test_trim_cuts_after_the_resumed_step_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert trim_metrics(path, step=3) == 0 and not path.exists()  # no file yet
    path.write_text("")
    assert trim_metrics(path, step=3) == 0 and path.read_text() == ""
    path.write_text(_line(1, 3.0) + _line(2, 2.5))
    assert trim_metrics(path, step=3) == 0 and path.read_text() == _line(1, 3.0) + _line(2, 2.5)
    path.write_text(_line(1, 3.0) + "x\n" + _line(2, 2.5) + _line(3, 2.0) + _line(4, 1.5) + '{"step": 5, "lo')
    assert trim_metrics(path, step=2) == 3
    assert path.read_text() == _line(1, 3.0) + "x\n" + _line(2, 2.5)  # a bad line before the step stays
    assert trim_metrics(path, step=0) == 3 and path.read_text() == ""  # started over: nothing is kept
    path.write_text(_line(1, 3.0) + _line(2, 2.5).strip())  # cut just before its newline
    assert trim_metrics(path, step=2) == 0 and path.read_text() == _line(1, 3.0) + _line(2, 2.5)


def test_a_resumed_run_logs_each_step_once(tmp_path, capsys):
    # checkpoints at 2, 4, 6; the one at 6 lost: the run resumes at 4 and logs 5 and 6 again
    config = tiny_config(tmp_path, max_steps=6, log_every=1, checkpoint_every=2, keep_last=3)
    build_trainer(config).run()
    shutil.rmtree(complete_checkpoints(config.run_dir / "checkpoints")[-1])
    resumed = build_trainer(config)
    assert resumed.resume() and resumed.step == 4
    resumed.run()
    assert "cut 2 line(s) after step 4" in capsys.readouterr().out
    metrics = config.run_dir / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_a_resumed_run_appends_after_a_torn_record(tmp_path):
    # killed while writing step 4's record, i.e. before step 4's checkpoint
    config = tiny_config(tmp_path, max_steps=4, log_every=2, checkpoint_every=2)
    build_trainer(config).run()
    shutil.rmtree(complete_checkpoints(config.run_dir / "checkpoints")[-1])
    metrics = config.run_dir / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole[: whole.rindex("\n", 0, len(whole) - 1) + 40])
    resumed = build_trainer(config)
    assert resumed.resume() and resumed.step == 2
    resumed.run()
    assert load_metrics(metrics).skipped_lines == []  # the torn line is cut, not kept beside the new record
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [2, 4]
