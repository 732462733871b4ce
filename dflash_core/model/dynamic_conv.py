"""DFlash 2's grouped dynamic causal convolution: output slot t is sum_j (base[j] + delta_t[j, group])
* x[t - j], j < kernel_size, never reaching across a block boundary (slot 0, the anchor, sees no
previous slot). `GroupedDynamicCausalConv` is the pair around one sublayer (dflash_core.model.dflash2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_dynamic_causal_conv(
    x_BSH: torch.Tensor, delta_BSKG: torch.Tensor, base_KH: torch.Tensor, *, block_size: int, group_size: int
) -> torch.Tensor:
    """out[t] = sum_j (base[j] + delta[t, j, group]) * x[t - j], with x[t - j] = 0 when slot t - j
    lies in an earlier block. S must be a whole number of blocks (blocks back to back)."""
    batch, seq_len, hidden = x_BSH.shape
    if seq_len % block_size:
        raise ValueError(f"sequence length {seq_len} is not a whole number of {block_size}-slot blocks")
    kernel_size = base_KH.shape[0]
    num_groups = hidden // group_size
    blocks = x_BSH.view(batch, seq_len // block_size, block_size, num_groups, group_size)
    delta = delta_BSKG.reshape(batch, seq_len // block_size, block_size, kernel_size, num_groups, 1)
    base = base_KH.to(x_BSH.dtype).view(kernel_size, num_groups, group_size)
    out = None
    for tap in range(kernel_size):
        # Shift by `tap` slots inside each block; the first `tap` slots of a block get zeros.
        shifted = blocks if tap == 0 else F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        term = shifted * (base[tap] + delta[:, :, :, tap].to(x_BSH.dtype))
        out = term if out is None else out + term
    return out.view(batch, seq_len, hidden)


class GroupedDynamicCausalConv(nn.Module):
    """The conv pair around one sublayer: `prepare` convolves its input and returns the dynamic
    kernel that `finish` applies to its output (both from one projection of the input)."""

    def __init__(
        self, *, hidden_size: int, kernel_size: int, group_size: int, block_size: int, device=None
    ) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.block_size = block_size
        self.num_groups = hidden_size // group_size
        # [input side, output side] x taps x channels; names and layout are z-lab's.
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size, device=device))
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * self.num_groups, bias=False, device=device
        )
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity: tap 0 weighs 1, earlier slots 0, no content-dependent correction."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def _conv(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        return grouped_dynamic_causal_conv(
            x, delta, self.base_kernel[side], block_size=self.block_size, group_size=self.group_size
        )

    def prepare(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        delta = self.kernel_projection(x_BSH).view(*x_BSH.shape[:-1], 2, self.kernel_size, self.num_groups)
        return self._conv(x_BSH, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, y_BSH: torch.Tensor, delta_BSKG: torch.Tensor) -> torch.Tensor:
        return self._conv(y_BSH, delta_BSKG, 1)
