"""Start a drafter from the target's own weights instead of noise.

A drafter layer has the target's shapes (`DFlashConfig.from_target`), so the target's last decoder
layers can seed it: attention and MLP projections and their norms are copied wherever the name and
shape agree (a Qwen3 target also gives q/k norms; a Llama target has none, so they stay at one),
and `fc` starts by passing the last tapped layer through unchanged, so the copied layers first see
context features close to what they saw inside the target. Everything stays trainable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

INIT_MODES = ("random", "target")


@torch.no_grad()
def init_from_target_layers(drafter: nn.Module, target_layers: Sequence[nn.Module]) -> list[str]:
    """Copy the last `len(drafter.layers)` target layers into the drafter; returns the names copied
    (as `layers.<i>.<name> <- target.layers.<j>.<name>`). Raises when nothing at all matches, which
    means the target's layers are not the drafter's kind (nothing would be gained)."""
    layers = drafter.layers
    if len(target_layers) < len(layers):
        raise ValueError(f"cannot seed {len(layers)} drafter layers from a {len(target_layers)}-layer target")
    first = len(target_layers) - len(layers)
    copied: list[str] = []
    for index, layer in enumerate(layers):
        source = {name: tensor for name, tensor in target_layers[first + index].state_dict().items()}
        for name, tensor in layer.state_dict().items():
            found = source.get(name)
            if found is not None and found.shape == tensor.shape:
                tensor.copy_(found.to(tensor.dtype))
                copied.append(f"layers.{index}.{name} <- target.layers.{first + index}.{name}")
    if not copied:
        raise ValueError("init 'target': no drafter layer tensor matches the target's layers by name and shape; "
                         "use init 'random' for this target")
    _pass_last_tap(drafter, target_layers[first])
    return copied


def _pass_last_tap(drafter: nn.Module, first_copied: nn.Module) -> None:
    """fc = [0 ... 0 | I] (the last tapped layer through), hidden_norm = the first copied layer's input
    norm: the context then enters like the residual stream entered that layer inside the target."""
    fc: nn.Linear = drafter.fc
    hidden = fc.out_features
    fc.weight.zero_()
    fc.weight[:, -hidden:] = torch.eye(hidden, dtype=fc.weight.dtype, device=fc.weight.device)
    norm = getattr(first_copied, "input_layernorm", None)
    if norm is not None and norm.weight.shape == drafter.hidden_norm.weight.shape:
        drafter.hidden_norm.weight.copy_(norm.weight.to(drafter.hidden_norm.weight.dtype))
