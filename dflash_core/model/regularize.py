"""Training-only regularizers of the drafter, drawn from an explicit generator (a step's seed fixes
them, so resume replays them): Gaussian noise on the tapped target states and dropout keep-masks
for the decoder sublayers. Drafting and evaluation never call these."""

from __future__ import annotations

import torch


def noisy_features(target_hidden_BTX: torch.Tensor, *, num_layers: int, scale: float,
                   generator: torch.Generator | None) -> torch.Tensor:
    """[B, T, L*H] tapped states plus N(0, (scale * rms)^2) noise, rms taken per token and tapped
    layer (EAGLE-style feature noise; relative, so a layer's or a token's magnitude sets its own noise)."""
    batch, seq_len, features = target_hidden_BTX.shape
    states = target_hidden_BTX.float().view(batch, seq_len, num_layers, features // num_layers)
    rms = states.square().mean(dim=-1, keepdim=True).sqrt()
    noise = torch.randn(states.shape, generator=generator, device=states.device, dtype=torch.float32)
    return (states + noise * (scale * rms)).view_as(target_hidden_BTX).to(target_hidden_BTX.dtype)


def dropout_masks(*, shape: tuple[int, ...], rate: float, num_layers: int, generator: torch.Generator | None,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer, keep-masks [shape] for its attention and MLP outputs: 0 with probability
    `rate`, else 1 / (1 - rate) (inverted dropout, so evaluation needs no rescaling)."""
    keep = 1.0 - rate
    masks = []
    for _ in range(num_layers):
        pair = tuple((torch.rand(shape, generator=generator, device=device) < keep).float() / keep for _ in range(2))
        masks.append(pair)
    return masks
