"""Exact top-k over a large vocabulary, fast on a GPU.

`torch.topk` over rows of a 248K-entry vocabulary runs a radix select per row: on an H200 the DFlash 2
selector's top-16 over Qwen3.5's vocabulary took ~100 ms of a 1.1 s training step. `grouped_topk`
cuts the row into groups, keeps the k groups with the largest maxima and runs the top-k over those
k * group_size values only. It is exact: an entry of the row's top k lies in a group whose maximum
is at least that entry, and fewer than k groups can have a larger maximum (each would hold a
distinct larger entry). Ties may pick a different one of equal values than `torch.topk`.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 256


def group_maxima(values_NV: torch.Tensor, *, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """[rows, ceil(vocab / group_size)]: each group's maximum. The whole groups are a view and the
    short last group (if any) is reduced on its own, so no row is padded (that would copy it). A
    caller that already reads the rows in a compiled kernel computes this there (dflash2_loss)."""
    rows, vocab = values_NV.shape
    whole = vocab // group_size * group_size
    maxima = values_NV[:, :whole].reshape(rows, whole // group_size, group_size).amax(dim=-1)
    if whole < vocab:
        maxima = torch.cat([maxima, values_NV[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    return maxima


def grouped_topk(
    values_NV: torch.Tensor, k: int, *, group_size: int = GROUP_SIZE, maxima: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row, sorted descending, like
    `values_NV.topk(k, dim=-1)`. `maxima`: `group_maxima(values_NV, group_size=group_size)`, when the
    caller has it already."""
    if values_NV.dim() != 2:
        raise ValueError(f"grouped_topk takes [rows, vocab], got shape {tuple(values_NV.shape)}")
    rows, vocab = values_NV.shape
    num_groups = -(-vocab // group_size)
    if k > group_size or num_groups <= k:  # nothing to skip
        return values_NV.topk(k, dim=-1)
    if maxima is None:
        maxima = group_maxima(values_NV, group_size=group_size)
    elif maxima.shape != (rows, num_groups):
        raise ValueError(f"maxima {tuple(maxima.shape)} is not [rows, groups] = [{rows}, {num_groups}]")
    best_groups = maxima.topk(k, dim=-1).indices  # [N, k]
    offsets = torch.arange(group_size, device=values_NV.device)
    columns = (best_groups[:, :, None] * group_size + offsets).view(rows, k * group_size)
    kept = values_NV.gather(1, columns.clamp(max=vocab - 1))
    if vocab % group_size:  # the short group's columns past the row's end
        kept = kept.masked_fill(columns >= vocab, float("-inf"))
    top_values, where = kept.topk(k, dim=-1)
    return top_values, columns.gather(1, where)
