"""bench/gpu_background.sh: a bench run that outlives one device call, waited for over several calls."""

import os
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_background.sh"


def _run(args, *, bg, out):
    env = {**os.environ, "BG": str(bg), "OUT": str(out)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_a_background_run_is_waited_for_across_calls_and_brings_back_its_out(tmp_path):
    bg, release = tmp_path / "bg", tmp_path / "release"
    # the run writes under its own $OUT, then waits until the test lets it finish
    command = f'echo started; echo row > "$OUT/results.jsonl"; while [ ! -f {release} ]; do sleep 0.2; done; echo done'
    try:
        started = _run(["start", "bash", "-c", command], bg=bg, out=tmp_path / "call0")
        assert started.returncode == 0 and "started (pid" in started.stdout
        refused = _run(["start", "true"], bg=bg, out=tmp_path / "call0")
        assert refused.returncode == 1 and "still going" in refused.stderr
        first = _run(["wait", "5"], bg=bg, out=tmp_path / "call1")  # a call that ends before the run
        assert "still running" in first.stdout and "started" in first.stdout
        assert (tmp_path / "call1" / "results.jsonl").read_text() == "row\n"
    finally:
        release.touch()  # the run never outlives the test
    second = _run(["wait", "30"], bg=bg, out=tmp_path / "call2")
    assert "done" in second.stdout and second.stdout.strip().endswith("finished: rc 0")
    assert (tmp_path / "call2" / "results.jsonl").is_file()
    assert _run(["start", "true"], bg=bg, out=tmp_path / "call3").returncode == 0  # brought back: a new run may start


def test_a_finished_run_no_wait_brought_back_is_kept_from_the_next_start(tmp_path):
    bg = tmp_path / "bg"
    assert _run(["start", "bash", "-c", 'echo row > "$OUT/results.jsonl"'], bg=bg, out=tmp_path / "c0").returncode == 0
    for _ in range(100):  # the run ends at once; its exit status lands a moment later
        if (bg / "rc").is_file():
            break
        time.sleep(0.1)
    refused = _run(["start", "true"], bg=bg, out=tmp_path / "c1")
    assert refused.returncode == 1 and "no wait brought its output back" in refused.stderr
    assert (bg / "out" / "results.jsonl").read_text() == "row\n"
    forced = subprocess.run(["bash", str(SCRIPT), "start", "true"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "BG": str(bg), "FORCE": "1"})
    assert forced.returncode == 0 and not (bg / "out" / "results.jsonl").exists()


def test_waiting_without_a_run_says_so(tmp_path):
    waited = _run(["wait", "1"], bg=tmp_path / "none", out=tmp_path / "out")
    assert waited.returncode == 2 and "no run started" in waited.stderr
