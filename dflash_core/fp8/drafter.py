"""FP8 GEMMs for the drafter's own linears in training (opt-in: `TrainConfig.drafter_fp8: true`).

torchao's float8 training (`torchao.float8.convert_to_float8_training`, what torchtitan uses) swaps each
chosen nn.Linear for a Float8Linear: its forward and both backward GEMMs run through `torch._scaled_mm`
in e4m3 (tensor-wise recipe: the output gradient in e5m2) with scales computed from each operand at every
call (`recipe`: one scale per tensor, or one per row/column). The parameters stay the fp32 masters the
optimizer updates; under the step's bf16 autocast the casts to FP8 start from them.

What stays in bf16: the LM head and embedding (the target's, borrowed and not registered in the drafter,
so never converted: the loss's GEMMs against the 151,936-row vocabulary keep their precision), the
attention, and any linear whose widths are not multiples of 16 (the FP8 GEMM's alignment) or that is
narrow (fewer outputs than min(256, its inputs), e.g. DFlash 2's dynamic-conv kernel projection):
quantizing such an input costs a read of it for a GEMM that is small anyway.

torchao is imported here only, lazily: it is the `gpu` extra (pyproject.toml), not a dependency of the
CPU paths, and its float8 GEMMs need CUDA with compute capability >= 8.9 (>= 9.0 for row-wise).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

Recipe = Literal["rowwise", "tensorwise"]
RECIPES: tuple[Recipe, ...] = ("rowwise", "tensorwise")
_ALIGN = 16
_MIN_OUT_FEATURES = 256
_MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}


def supports_drafter_fp8(device: torch.device, recipe: Recipe) -> str | None:
    """None when torchao's float8 training with `recipe` runs on `device`; otherwise why not."""
    need = _MIN_CAPABILITY[recipe]
    hardware = f"a CUDA GPU of compute capability >= {need[0]}.{need[1]}"
    if device.type != "cuda":
        return f"torchao's float8 training ({recipe}) needs {hardware} (Ada/Hopper or newer), not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < need:
        return (f"torchao's float8 training ({recipe}) needs {hardware}; {torch.cuda.get_device_name(device)} is "
                f"{capability[0]}.{capability[1]}")
    return None


def is_fp8_linear_candidate(module: nn.Module) -> bool:
    """A plain nn.Linear whose widths are multiples of 16 and that is not narrow (module docstring)."""
    if type(module) is not nn.Linear:
        return False
    narrow = module.out_features < min(_MIN_OUT_FEATURES, module.in_features)
    return not (module.in_features % _ALIGN or module.out_features % _ALIGN or narrow)


def convert_drafter_linears(drafter: nn.Module, *, recipe: Recipe) -> tuple[int, int]:
    """Swap the drafter's eligible linears for torchao Float8Linears in place (before compiling it and before
    the optimizer is built). Returns (converted, kept in bf16). ValueError, naming the setting, where the
    device or the installation cannot run it."""
    if recipe not in RECIPES:
        raise ValueError(f"drafter_fp8_recipe must be one of {RECIPES}, got {recipe!r}")
    device = next(drafter.parameters()).device
    why = supports_drafter_fp8(device, recipe)
    if why is not None:
        raise ValueError(f"drafter_fp8: {why}; set drafter_fp8: false to train the drafter's GEMMs in bf16")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise ValueError(f"drafter_fp8 needs torchao (the `gpu` extra: pip install '.[gpu]'): {error}") from None
    linears = [m for m in drafter.modules() if type(m) is nn.Linear]
    convert_to_float8_training(drafter, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, _fqn: is_fp8_linear_candidate(module))
    kept = sum(type(m) is nn.Linear for m in drafter.modules())
    return len(linears) - kept, kept

