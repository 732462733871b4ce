"""Capacity planner arithmetic and its CLI interface.

Run: `.venv/bin/python -m pytest tests/unit/test_planner.py -q`
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from dflash_core.cli import app
from dflash_core import planner
from dflash_core.model.build import build_drafter
from dflash_core.planner import GiB, PRESETS, TB, ModelShape, PlanInputs, plan

runner = CliRunner()


def _plan(**kwargs):
    defaults = dict(target=ModelShape(hidden_size=5120), tapped_layers=5)
    return plan(PlanInputs(**{**defaults, **kwargs}))


def test_field_figure_offline_90_tb() -> None:
    result = _plan(samples=902_087, mean_tokens=2000)
    assert result.bytes_per_token == 5 * 5120 * 2 == 51_200
    assert result.offline_bytes == 51_200 * 2000 * 902_087
    assert result.offline_bytes / TB == pytest.approx(92.37, abs=0.01)  # "~90 TB"
    assert result.online_bytes == 0


def test_field_figure_34860_gib() -> None:
    # The field quotes "34,860.9 GB" for 913,786 samples x 800 tokens: the unit is GiB (2^30).
    result = _plan(samples=913_786, mean_tokens=800)
    assert result.offline_bytes / GiB == pytest.approx(34_860, rel=2e-4)


def test_field_figure_anchor_only_23_6_tb() -> None:
    result = _plan(samples=902_087, mean_tokens=2000, anchors_per_sample=512)
    assert result.anchor_only_bytes == 51_200 * 512 * 902_087
    assert result.anchor_only_bytes / TB == pytest.approx(23.6, abs=0.05)


def test_anchor_only_never_exceeds_all_tokens() -> None:
    result = _plan(samples=10, mean_tokens=100, anchors_per_sample=512)
    assert result.anchor_only_bytes == result.offline_bytes


def test_presets_match_published_parameter_counts() -> None:
    assert PRESETS["qwen3-8b"].params() / 1e9 == pytest.approx(8.19, abs=0.05)
    assert PRESETS["qwen3-32b"].params() / 1e9 == pytest.approx(32.8, abs=0.1)
    assert PRESETS["smollm2-135m"].params() / 1e6 == pytest.approx(134.5, abs=1)


def test_memory_verdicts_follow_gpu_size() -> None:
    big = plan(PlanInputs(target=PRESETS["qwen3-8b"], samples=1, mean_tokens=1, gpu_memory_gib=139))
    small = plan(PlanInputs(target=PRESETS["qwen3-8b"], samples=1, mean_tokens=1, gpu_memory_gib=24))
    colocated = {v.layout: v for v in big.layouts}["colocated"]
    assert colocated.fits is True and colocated.peak_bytes_per_gpu > big.target_weight_bytes
    assert {v.layout: v for v in small.layouts}["colocated"].fits is False
    assert {v.layout: v for v in big.layouts}["pair"].replicas == 0  # one GPU: no pair layout
    two = plan(PlanInputs(target=PRESETS["qwen3-32b"], samples=1, mean_tokens=1, num_gpus=2))
    pair = {v.layout: v for v in two.layouts}["pair"]
    assert pair.replicas == 1 and pair.peak_bytes_per_gpu < {v.layout: v for v in two.layouts}["colocated"].peak_bytes_per_gpu


def test_transfer_and_generation_time() -> None:
    result = plan(PlanInputs(target=PRESETS["qwen3-8b"], samples=1000, mean_tokens=2000,
                             mean_completion_tokens=1500, token_budget=8192, interconnect_gb_s=50,
                             generation_tokens_per_s=1000, inference_instances=2))
    assert result.transfer_bytes_per_batch == 8192 * 6 * 4096 * 2  # 5 taps + final state, bf16
    assert result.transfer_ms_per_batch == pytest.approx(result.transfer_bytes_per_batch / 50e9 * 1e3)
    assert result.generation_hours == pytest.approx(1000 * 1500 / 2000 / 3600)


def test_tapped_layers_beyond_target_rejected() -> None:
    with pytest.raises(ValueError, match="tapped-layers 40"):
        PlanInputs(target=PRESETS["qwen3-8b"], tapped_layers=40, samples=1, mean_tokens=1)
    # as many as a run can list (ids 0 .. N-2 of the 36 layers: the last one's output is final-normed), no more
    PlanInputs(target=PRESETS["qwen3-8b"], tapped_layers=35, samples=1, mean_tokens=1)
    with pytest.raises(ValueError, match=r"tapped-layers 36 exceeds the 35 layers .*\(ids 0..34\)"):
        PlanInputs(target=PRESETS["qwen3-8b"], tapped_layers=36, samples=1, mean_tokens=1)


def test_cli_json_interface_is_stable() -> None:
    result = runner.invoke(app, ["plan", "--tapped-layers", "5", "--hidden-size", "5120", "--samples", "902087",
                                 "--mean-tokens", "2000", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["offline_bytes"] == 51_200 * 2000 * 902_087
    assert data["anchor_only_bytes"] == 51_200 * 512 * 902_087
    assert data["online_bytes"] == 0
    assert {v["fits"] for v in data["layouts"]} == {None}  # no target size given


def test_cli_taps_default_to_trains() -> None:
    """Without --tapped-layers the plan reads what train would: one per drafter layer, at least 5."""
    def tapped(*args: str) -> int:
        result = runner.invoke(app, ["plan", "--hidden-size", "1000", "--num-layers", "36", *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["bytes_per_token"] // (1000 * 2)

    assert (tapped("--drafter-layers", "2"), tapped("--drafter-layers", "7")) == (5, 7)
    assert tapped("--drafter-layers", "2", "--tapped-layers", "3") == 3


def test_cli_table_and_model_config(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"text_config": {"hidden_size": 1024, "num_hidden_layers": 28,
                                                  "intermediate_size": 3072, "num_attention_heads": 16,
                                                  "num_key_value_heads": 8, "head_dim": 128,
                                                  "vocab_size": 151936}}))
    result = runner.invoke(app, ["plan", "--model-config", str(config), "--samples", "1000"])
    assert result.exit_code == 0, result.output
    assert "offline storage" in result.output and "fits" in result.output


def test_cli_errors_name_the_flag(tmp_path) -> None:
    assert "--preset" in runner.invoke(app, ["plan", "--preset", "nope"]).output
    assert "--hidden-size" in runner.invoke(app, ["plan"]).output
    bad = tmp_path / "c.json"
    bad.write_text("{}")
    assert "hidden_size" in runner.invoke(app, ["plan", "--model-config", str(bad)]).output


@pytest.mark.parametrize("flags,match", [
    (["--preset", "qwen3-8b", "--hidden-size", "-5"], "--hidden-size -5: out of range; it must be > 0 and <= 10,000,000"),
    (["--preset", "qwen3-8b", "--num-layers", "0"], "--num-layers 0: out of range"),
    (["--hidden-size", "-5"], "--hidden-size -5: out of range; it must be > 0 and <= 10,000,000"),
    (["--hidden-size", "4096", "--mean-tokens", "inf"], "--mean-tokens inf: Input should be a finite number"),
    (["--hidden-size", "4096", "--mean-tokens", "nan"], "--mean-tokens nan: Input should be a finite number"),
    (["--hidden-size", "4096", "--gpu-memory-gib", "inf"], "--gpu-memory-gib inf"),
    (["--hidden-size", "4096", "--target-params", "inf"], "--target-params inf: it must be > 0 and <= 1,000,000"),
    (["--hidden-size", "4096", "--target-params", "-8"], "--target-params -8.0"),
    (["--hidden-size", "4096", "--interconnect-gb-s", "-1"], "--interconnect-gb-s -1.0: out of range"),
])
def test_every_input_is_validated_overrides_on_a_preset_too(flags, match) -> None:
    """A preset overridden with a negative size used to give negative bytes and 'fits'; inf crashed."""
    result = runner.invoke(app, ["plan", *flags, "--samples", "10"])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and match in result.output
    assert "Traceback" not in result.output and "fits" not in result.output


@pytest.mark.parametrize("flags,match", [
    (["--interconnect-gb-s", "1e-320"], "--interconnect-gb-s 1e-320: out of range; it must be >= 0.001 and <= "),
    (["--generation-tokens-per-s", "1e-320"], "--generation-tokens-per-s 1e-320: out of range; it must be >= 0.001"),
    (["--samples", "1e23"], "--samples 1e+23: out of range; it must be > 0 and <= 1,000,000,000,000"),
    (["--mean-tokens", "1e300"], "--mean-tokens 1e+300: out of range; it must be > 0 and <= 100,000,000"),
    (["--gpu-memory-gib", "1e300"], "--gpu-memory-gib 1e+300: out of range"),
    (["--token-budget", str(10**23)], f"--token-budget {10**23}: out of range"),
])
def test_cli_json_refuses_what_would_not_be_finite_naming_flag_and_range(flags, match) -> None:
    """These printed `Infinity` (not JSON) or absurd figures; now each names its flag and valid range."""
    result = runner.invoke(app, ["plan", "--preset", "qwen3-8b", *flags, "--json"])
    assert result.exit_code == 2, result.output
    assert match in " ".join(result.output.split())  # the error panel may wrap lines
    assert "Infinity" not in result.output and "Traceback" not in result.output


def test_cli_samples_may_be_written_in_scientific_notation() -> None:
    result = runner.invoke(app, ["plan", "--preset", "qwen3-8b", "--samples", "1e6", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["inputs"]["samples"] == 1_000_000
    assert "fractional part" in runner.invoke(app, ["plan", "--preset", "qwen3-8b", "--samples", "1.5"]).output


def test_every_figure_is_finite_at_the_ends_of_the_ranges() -> None:
    """All sizes at their maximum and the divisors (bandwidth, generation speed) at their minimum."""
    top = planner.MAX_SIZE
    target = ModelShape(num_layers=top, hidden_size=top, intermediate_size=top, num_attention_heads=top,
                        num_key_value_heads=top, head_dim=top, vocab_size=top)
    result = plan(PlanInputs(target=target, tapped_layers=top - 1, dtype_bytes=8, samples=planner.MAX_SAMPLES,
                             mean_tokens=planner.MAX_TOKENS, anchors_per_sample=planner.MAX_TOKENS,
                             drafter_layers=top, block_size=top, token_budget=planner.MAX_TOKENS,
                             anchors_per_1k_tokens=planner.MAX_TOKENS, gpu_memory_gib=top, num_gpus=top,
                             interconnect_gb_s=0.001, generation_tokens_per_s=0.001))
    json.dumps(result.model_dump(), allow_nan=False)
    assert result.generation_hours > 0 and result.transfer_ms_per_batch > 0


def test_ranges_reach_the_prefect_form_and_a_non_finite_plan_is_refused() -> None:
    properties = PlanInputs.model_json_schema()["properties"]
    assert properties["samples"]["maximum"] == planner.MAX_SAMPLES
    assert properties["interconnect_gb_s"]["minimum"] == 0.001
    figures = _plan(samples=1, mean_tokens=1).model_dump()
    with pytest.raises(ValidationError, match="finite"):
        planner.Plan.model_validate({**figures, "transfer_ms_per_batch": float("inf")})


def test_an_overridden_preset_is_validated_again_in_code() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        PlanInputs(target=PRESETS["qwen3-8b"].model_copy(update={"hidden_size": -5}), samples=1, mean_tokens=1)


def test_drafter_params_count_what_the_model_builds():
    """Both variants, Qwen3-8B's shape on the meta device: the estimate is the built drafter's size to
    within its q/k norms (DFlash 2's selector codebooks alone are 78M parameters there)."""
    import warnings

    from dflash_core.model import DFlashConfig
    from dflash_core.model.dflash2 import drafter_config
    from dflash_core.target import real_shape_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = DFlashConfig.from_target(real_shape_config("qwen3-8b"), num_layers=5, block_size=16,
                                        num_tapped_layers=5)
    for variant in ("dflash", "dflash2"):
        built = sum(p.numel() for p in build_drafter(drafter_config(variant, base), device="meta").parameters())
        estimate = planner.drafter_params(planner.PRESETS["qwen3-8b"], drafter_layers=5, tapped_layers=5,
                                          variant=variant)
        assert abs(estimate - built) < 2_000, (variant, estimate, built)
