"""The drafter's context caches for decoding: per drafter layer, the projected (normed, rotated) K and V
of the target features of every verified token. `ContextCache` grows with each round (eager decoding);
`StaticContextCache` has a fixed shape and a device-side length, for CUDA-graph decoding."""

from __future__ import annotations

import dataclasses

import torch

from dflash_core.model.masks import drafting_mask


@dataclasses.dataclass
class ContextCache:
    """Per layer, the projected (normed, rotated) K and V of the target context: [B, kv_heads, S, D]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def is_empty(self) -> bool:
        return not self.keys

    def append(self, key_values: list[tuple[torch.Tensor, torch.Tensor]], *, keep: torch.Tensor | None = None) -> None:
        """Add each layer's K/V [B, kv_heads, n, D] of n new context positions."""
        if keep is not None:
            raise ValueError("a growing context cache keeps every row it is given: pass only the verified features")
        if not self.keys:
            self.keys, self.values = [k for k, _ in key_values], [v for _, v in key_values]
            return
        self.keys = [torch.cat((old, k), dim=2) for old, (k, _) in zip(self.keys, key_values)]
        self.values = [torch.cat((old, v), dim=2) for old, (_, v) in zip(self.values, key_values)]

    def drafting_mask(self, *, block_size: int, sliding_window: int | None) -> torch.Tensor | None:
        """The drafted block's mask over [context ; block] (None: all visible)."""
        return drafting_mask(context_len=self.length, block_size=block_size, first_position=self.length,
                             sliding_window=sliding_window, device=self.keys[0].device)

    def crop(self, length: int) -> None:
        """Keep the first `length` context positions (drop features of rejected tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a {self.length}-token context cache to {length}")
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


class StaticContextCache:
    """A context cache of fixed shape for CUDA-graph decoding: per layer, K/V buffers [1, kv_heads,
    capacity, D] and the context length as a device tensor, so that drafting and extending never
    change a shape or read a value on the host. A draft attends to the whole buffer under a mask that
    hides the positions at and past `length`; `append` writes n rows at `length` and may keep fewer
    (the rows of rejected drafts are overwritten by the next append)."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device) -> None:
        shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.capacity = capacity
        self.is_empty = True

    def reset(self) -> None:
        self.length.zero_()
        self.is_empty = True

    def positions(self, count: int) -> torch.Tensor:
        """[1, count]: the sequence positions of the next `count` context rows."""
        return (self.length + torch.arange(count, device=self.length.device))[None]

    def append(self, key_values: list[tuple[torch.Tensor, torch.Tensor]], *, keep: torch.Tensor | None = None) -> None:
        """Write each layer's K/V of n rows at `length`; the length grows by `keep` (a device tensor) or n.
        The caller keeps length + n within the capacity (index_copy_ past the end is a device error)."""
        rows = key_values[0][0].shape[2]
        index = self.length + torch.arange(rows, device=self.length.device)
        for buffer_k, buffer_v, (key, value) in zip(self.keys, self.values, key_values):
            buffer_k.index_copy_(2, index, key.to(buffer_k.dtype))
            buffer_v.index_copy_(2, index, value.to(buffer_v.dtype))
        self.length.add_(rows if keep is None else keep)
        self.is_empty = False

    def drafting_mask(self, *, block_size: int, sliding_window: int | None) -> torch.Tensor:
        """[1, 1, block, capacity + block]: the block sees the first `length` context rows (within the
        sliding window, if any) and itself."""
        device = self.length.device
        context = torch.arange(self.capacity, device=device)[None, :]
        sees_context = context < self.length
        if sliding_window is not None:
            query = self.length + torch.arange(block_size, device=device)[:, None]
            sees_context = sees_context & (query - context < sliding_window)
        else:
            sees_context = sees_context.expand(block_size, -1)
        sees_block = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
        return torch.cat((sees_context, sees_block), dim=1)[None, None]
