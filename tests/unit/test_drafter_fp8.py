"""FP8 drafter GEMMs (TrainConfig.drafter_fp8, dflash_core.fp8.drafter): the setting and its recipe in the
run schema, which linears it would convert, and its refusal on a CPU (torchao's float8 training needs a
CUDA GPU of compute capability >= 8.9): by the setting's name and the hardware it needs, before any
torchao import, so none of this needs torchao. The GPU side: tests/gpu/test_drafter_fp8_gpu.py.

Run: .venv/bin/python -m pytest -q -n 0 tests/unit/test_drafter_fp8.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_core.fp8.drafter import convert_drafter_linears, is_fp8_linear_candidate, supports_drafter_fp8
from dflash_core.train.assemble import build_trainer
from dflash_core.train.config import TrainConfig
from dflash_core.train.devices import TrainDevices
from dflash_core.train.entry import refuse_unsupported_fp8
from tests.unit.test_trainer import tiny_config

CPU = TrainDevices(torch.device("cpu"), torch.device("cpu"))


def test_the_setting_is_off_by_default_and_its_recipe_is_checked(tmp_path):
    config = tiny_config(tmp_path)
    assert config.drafter_fp8 is False and config.drafter_fp8_recipe == "tensorwise"
    path = tmp_path / "run.yaml"
    path.write_text(config.to_yaml())
    loaded = TrainConfig.from_yaml(path, overrides=["drafter_fp8=true", "drafter_fp8_recipe=rowwise"])
    assert loaded.drafter_fp8 is True and loaded.drafter_fp8_recipe == "rowwise"
    with pytest.raises(ValueError, match="drafter_fp8_recipe"):
        TrainConfig.from_yaml(path, overrides=["drafter_fp8_recipe=blockwise"])


@pytest.mark.parametrize("recipe, capability", [("tensorwise", "8.9"), ("rowwise", "9.0")])
def test_a_cpu_is_refused_by_the_settings_name_and_the_hardware_it_needs(tmp_path, recipe, capability):
    why = supports_drafter_fp8(torch.device("cpu"), recipe)
    assert f"compute capability >= {capability}" in why and "not cpu" in why
    with pytest.raises(ValueError, match=rf"^drafter_fp8: .*>= {capability}.*; set drafter_fp8: false"):
        convert_drafter_linears(nn.Sequential(nn.Linear(32, 32)), recipe=recipe)
    config = tiny_config(tmp_path, drafter_fp8=True, drafter_fp8_recipe=recipe)
    with pytest.raises(SystemExit, match=rf"^error: drafter_fp8: torchao's float8 training \({recipe}\) needs a CUDA"):
        refuse_unsupported_fp8(config, CPU)
    refuse_unsupported_fp8(config.model_copy(update={"drafter_fp8": False}), CPU)


def test_the_trainer_refuses_it_on_a_cpu_before_training(tmp_path):
    with pytest.raises(ValueError, match="^drafter_fp8: .*compute capability"):
        build_trainer(tiny_config(tmp_path, drafter_fp8=True))


def test_aligned_wide_linears_are_converted_unaligned_and_narrow_ones_kept():
    assert is_fp8_linear_candidate(nn.Linear(4096, 1024))  # a GQA key projection
    assert is_fp8_linear_candidate(nn.Linear(64, 64))  # narrow only below min(256, inputs)
    assert not is_fp8_linear_candidate(nn.Linear(576, 192))  # SmolLM2's K/V: fewer outputs than 256
    assert not is_fp8_linear_candidate(nn.Linear(4096, 64))  # a dynamic-conv kernel projection
    assert not is_fp8_linear_candidate(nn.Linear(100, 256))  # inputs not a multiple of 16
    assert not is_fp8_linear_candidate(nn.Embedding(256, 64))


def test_the_acceptance_bench_has_the_variant():
    from bench.acceptance.variants import SUITES, variants

    variant = variants()["default+drafter_fp8"]
    assert variant.train == {"drafter_fp8": True}
    assert variants()["default+target_fp8+drafter_fp8"].train == {"target_fp8": True, "drafter_fp8": True}
    assert SUITES["drafter_fp8"] == ["default", "default+drafter_fp8", "default+target_fp8+drafter_fp8"]
