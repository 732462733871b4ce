"""The acceptance curve (bench/acceptance/curve.py): result files of several runs merge into one row per
(point, recipe, lr), each recipe's best lr is picked at every point, our default's ratios are taken against
the speculators recipes at their best lr, other variants stay out, and the PNG is drawn.

Run: .venv/bin/python -m pytest tests/unit/test_bench_acceptance_curve.py -q
"""

import json

import pytest


def _row(variant, seed, tau, *, steps=2000, multiplier=4, **extra):
    row = {"variant": variant, "seed": seed, "steps": steps, "tau": tau,
           "acceptance_per_position": [tau - 1, 0.1, 0.05, 0.01], "tau_by_source": {"sharegpt": tau, "own": tau},
           "train_tau": tau + 0.5, "steps_per_s": 7.0, "all_match_target": True, "mask_token_id": 16,
           "target_layer_ids": [1, 8, 14, 20, 27], **extra}  # the default's taps
    if multiplier:
        row.update(data_multiplier=multiplier, train_completions=1024 * multiplier)
    return row


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_curve_merges_calls_and_compares_each_recipe_at_its_best_lr(tmp_path):
    from bench.acceptance import curve

    first = _write(tmp_path / "call1.jsonl", [
        _row("default", 0, 1.64), _row("default", 1, 1.66),
        _row("speculators", 0, 1.47), _row("speculators+lr=3e-4", 0, 1.50),
        _row("speculators-dflash2", 0, 1.52), _row("speculators-dflash2+lr=3e-4", 0, 1.54),
        _row("default+kl", 0, 1.90),  # another variant: not a recipe of the curve
        _row("default", 0, 1.28, steps=200, multiplier=None),  # before the data-scaling runs: 1x
        _row("speculators", 0, 1.20, steps=200, multiplier=None)])
    second = _write(tmp_path / "call2.jsonl", [
        _row("default", 0, 1.10),  # seed 0 again in a later run: the first result counts
        _row("speculators+lr=3e-4", 1, 1.52)])
    rows = curve.curve_rows(curve.load([first, second]))

    assert {r["variant"] for r in rows} == {"default", "speculators", "speculators+lr=3e-4", "speculators-dflash2",
                                           "speculators-dflash2+lr=3e-4"}
    big = {(r["recipe"], r["lr"]): r for r in rows if r["point"] == (4096, 2000 * 2048)}
    ours = big[("default", 6e-4)]
    assert ours["seeds"] == [0, 1] and ours["tau_mean"] == pytest.approx(1.65)
    assert big[("speculators", 3e-4)]["best"] and not big[("speculators", 6e-4)]["best"]
    assert big[("speculators", 3e-4)]["seeds"] == [0, 1]
    assert ours["ratios"] == {"speculators": pytest.approx(0.65 / 0.51),
                              "speculators-dflash2": pytest.approx(0.65 / 0.54)}
    small = [r for r in rows if r["point"] == (1024, 200 * 2048)]
    assert [r["recipe"] for r in small] == ["default", "speculators"]
    assert small[0]["ratios"] == {"speculators": pytest.approx(0.28 / 0.20)}
    assert small[0]["training_tokens"] == 200 * 2048

    out = tmp_path / "out"
    text = curve.main([str(first), str(second), "--out", str(out)])
    assert "| 4,096 | 2,000 | 4.10M | **ours (default)** | 6e-4 | 0, 1 |" in text
    assert "**1.27x**" in text and "3e-4" in text and "| yes |" in text and "| NO |" not in text
    assert (out / "curve.md").read_text() == text and (out / "curve.png").stat().st_size > 0


def test_a_point_on_larger_steps_is_compared_within_its_step_size(tmp_path):
    from bench.acceptance import curve

    results = _write(tmp_path / "r.jsonl", [
        _row("default", 0, 1.64), _row("speculators", 0, 1.50),  # 2,000 x 2,048 tokens (no token_budget: 2,048)
        _row("default", 0, 1.60, steps=500, token_budget=8192),  # the bridge: the same tokens, a quarter the steps
        _row("speculators", 0, 1.40, steps=500, token_budget=8192),
        _row("speculators+lr=3e-4", 0, 1.45, steps=500, token_budget=8192)])
    rows = curve.curve_rows(curve.load([results]))
    assert {r["point"] for r in rows} == {(4096, 2000 * 2048)}
    small, large = ([r for r in rows if r["recipe"] == "default" and r["token_budget"] == size]
                    for size in (2048, 8192))
    assert small[0]["ratios"] == {"speculators": pytest.approx(0.64 / 0.50)}
    assert large[0]["ratios"] == {"speculators": pytest.approx(0.60 / 0.45)}, "its best lr on 8,192-token steps"
    text = curve.main([str(results), "--out", str(tmp_path / "out")])
    assert "| 4,096 | 500 x 8,192 tokens | 4.10M | **ours (default)** |" in text
    assert "| 4,096 | 2,000 | 4.10M | **ours (default)** |" in text


def test_the_default_before_its_five_taps_is_a_recipe_of_its_own(tmp_path):
    """2026-12-05 moved the default from one tap per drafter layer (2 on the bench) to 5: a `default` row that
    read 2 taps is `default-2-taps`, the ablation's `default+taps=5` row is the default, and both of ours carry
    ratios to the speculators recipes."""
    from bench.acceptance import curve

    two = [1, 27]
    results = _write(tmp_path / "r.jsonl", [
        _row("default", 0, 1.93, target_layer_ids=two), _row("default", 1, 1.90, target_layer_ids=two),
        _row("default+taps=5", 1, 2.01), _row("default+taps=2", 2, 1.91, target_layer_ids=two),
        _row("default+lr=3e-4", 0, 1.85, target_layer_ids=two),
        _row("default+taps=speculators", 1, 1.97, target_layer_ids=[1, 14, 26]),  # an ablation row: left out
        _row("speculators-dflash2", 0, 1.85)])
    rows = {(r["recipe"], r["lr"]): r for r in curve.curve_rows(curve.load([results]))}
    assert set(rows) == {("default", 6e-4), ("default-2-taps", 6e-4), ("default-2-taps", 3e-4),
                         ("speculators-dflash2", 6e-4)}
    assert rows[("default", 6e-4)]["seeds"] == [1]
    assert rows[("default-2-taps", 6e-4)]["seeds"] == [0, 1, 2]
    assert rows[("default", 6e-4)]["ratios"] == {"speculators-dflash2": pytest.approx(1.01 / 0.85)}
    assert rows[("default-2-taps", 6e-4)]["ratios"] == {"speculators-dflash2": pytest.approx((0.93 + 0.90 + 0.91) / 3 / 0.85)}
    text = curve.main([str(results), "--out", str(tmp_path / "out")])
    assert "**ours, 2 taps (the default until 2026-12-05)**" in text


def test_the_curve_names_a_bad_result_file(tmp_path):
    from bench.acceptance import curve

    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(_row("default", 0, 1.5)) + "\n{not json\n")
    with pytest.raises(SystemExit, match=r"broken.jsonl:2: not a JSON result row"):
        curve.load([broken])
    with pytest.raises(SystemExit, match="no such result file"):
        curve.main([str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    other = _write(tmp_path / "other.jsonl", [_row("default+kl", 0, 1.5)])
    with pytest.raises(SystemExit, match="none of 1 files holds a row"):
        curve.main([str(other), "--out", str(tmp_path)])
