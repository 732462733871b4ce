"""bench/bench_attention_work.py: the drafter's attention work a training step asks for, dense against flex."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def work():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_attention_work", BENCH / "bench_attention_work.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH))


def test_dense_attention_counts_the_whole_grid_and_flex_a_small_share_of_it(work, capsys):
    rows = work.main(["--doc-len", "64", "--token-budget", "4096", "--anchors", "64", "256", "--rows", "1"])
    assert [(r["queries"], r["keys"]) for r in rows] == [(512, 4096 + 512), (2048, 4096 + 2048)]
    for row in rows:
        assert row["documents"] == 64  # 4,096 tokens of 64-token documents
        # a query sees its document's context before its anchor and its own block: a few percent of the grid,
        # and flex's 128 x 128 blocks hold those pairs in a small share of its blocks
        assert 0 < row["allowed"] <= row["flex_visits"] < 0.25
        assert row["flex_tflop"] == pytest.approx(row["dense_tflop"] * row["flex_visits"])
        assert row["rest_tflop"] > 0
    # the dense grid grows with query slots x keys: 4x the anchors is 4x the slots and 1.33x the keys
    assert rows[1]["dense_tflop"] / rows[0]["dense_tflop"] == pytest.approx(4 * 6144 / 4608)
    assert "| 256 | 2,048 x 6,144 |" in capsys.readouterr().out


def test_without_completions_it_says_what_to_carry_or_pass(work, tmp_path):
    with pytest.raises(SystemExit, match="no completion chunks in .*--doc-len"):
        work.main(["--completions", str(tmp_path), "--rows", "1"])
