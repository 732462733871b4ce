"""Training metrics per block position, as tensors (no host sync inside a step).

Acceptance-length convention: tau counts the bonus token. A round that accepts n drafted tokens
yields n + 1 tokens (the target always adds one), so a drafter that is always wrong has tau = 1
and a perfect drafter with block size B has tau = B.
"""

from __future__ import annotations

import torch


def accuracy_per_position(*, correct_BAK: torch.Tensor, valid_BAK: torch.Tensor) -> torch.Tensor:
    """[K] fraction correct at drafted slot k = 1..K among valid slots (0 where none is valid)."""
    hits = (correct_BAK & valid_BAK).flatten(0, -2).sum(dim=0).float()
    counts = valid_BAK.flatten(0, -2).sum(dim=0).float()
    return hits / counts.clamp_min(1.0)


def acceptance_length_from_accuracy(accuracy_K: torch.Tensor) -> torch.Tensor:
    """tau = 1 + sum_k prod_{i<=k} acc_i: expected accepted prefix + the bonus token, treating the
    per-position accuracies as independent acceptance probabilities."""
    return 1.0 + torch.cumprod(accuracy_K, dim=0).sum()


def acceptance_length_empirical(
    *, correct_BAK: torch.Tensor, valid_BAK: torch.Tensor, anchor_valid_BA: torch.Tensor
) -> torch.Tensor:
    """1 + mean over valid blocks of the run of correct slots from slot 1 (stops at the first wrong
    or loss-free slot): what greedy verification would accept on these blocks."""
    run = torch.cumprod((correct_BAK & valid_BAK).long(), dim=-1).sum(dim=-1).float()
    num_blocks = anchor_valid_BA.sum().float().clamp_min(1.0)
    return 1.0 + (run * anchor_valid_BA).sum() / num_blocks


def block_metrics(
    *, correct_BAK: torch.Tensor, valid_BAK: torch.Tensor, anchor_valid_BA: torch.Tensor
) -> dict[str, torch.Tensor]:
    """accuracy_per_position [K], acceptance_length (product formula), acceptance_length_empirical,
    num_valid_blocks; all detached tensors on the batch's device."""
    correct_BAK, valid_BAK = correct_BAK.detach(), valid_BAK.detach()
    accuracy = accuracy_per_position(correct_BAK=correct_BAK, valid_BAK=valid_BAK)
    return {
        "accuracy_per_position": accuracy,
        "acceptance_length": acceptance_length_from_accuracy(accuracy),
        "acceptance_length_empirical": acceptance_length_empirical(
            correct_BAK=correct_BAK, valid_BAK=valid_BAK, anchor_valid_BA=anchor_valid_BA
        ),
        "num_valid_blocks": anchor_valid_BA.sum(),
    }
