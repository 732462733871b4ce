"""Start a drafter from the target's own weights instead of noise.

DFlash 2's candidate selector can also start from the target (`init_selector_codebooks`): its
codebooks take the target embedding's top principal directions, so tokens the target embeds alike
start with alike transition codes instead of independent noise.

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
SELECTOR_CODEBOOK_INITS = ("random", "embedding")


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


@torch.no_grad()
def embedding_principal_codes(embedding_VH: torch.Tensor, *, rank: int, chunk_rows: int = 16384) -> torch.Tensor:
    """[V, rank] fp32: the centered embedding projected on its top `rank` principal directions (the
    eigenvectors of its H x H covariance, largest first: exact, and draws no random numbers), columns past
    the embedding's width left at zero. Walks the rows in chunks, so no fp32 copy of the embedding is made."""
    vocab, width = embedding_VH.shape
    mean = embedding_VH.float().mean(dim=0)
    gram = mean.new_zeros(width, width)
    for start in range(0, vocab, chunk_rows):
        rows = embedding_VH[start:start + chunk_rows].float() - mean
        gram += rows.T @ rows
    _, vectors = torch.linalg.eigh(gram)  # ascending eigenvalues
    kept = min(rank, width)
    directions = vectors.flip(-1)[:, :kept]
    codes = mean.new_zeros(vocab, rank)
    for start in range(0, vocab, chunk_rows):
        codes[start:start + chunk_rows, :kept] = (embedding_VH[start:start + chunk_rows].float() - mean) @ directions
    return codes


@torch.no_grad()
def init_selector_codebooks(selector: nn.Module, embedding_VH: torch.Tensor, *, std: float) -> None:
    """Predecessor and successor codebooks = the embedding's principal codes (`embedding_principal_codes`),
    scaled to standard deviation `std` (the random init's). Where the rank exceeds the embedding's width,
    the columns past it keep their random init."""
    codebooks = (selector.predecessor_codebook, selector.successor_codebook)
    vocab, rank = codebooks[0].shape
    if embedding_VH.shape[0] != vocab:
        raise ValueError(f"selector_codebook_init 'embedding': the target embedding has {embedding_VH.shape[0]} rows, "
                         f"the selector's codebooks {vocab}")
    kept = min(rank, embedding_VH.shape[1])
    codes = embedding_principal_codes(embedding_VH.to(codebooks[0].device), rank=kept)
    codes *= std / codes.std().clamp_min(1e-12)
    for codebook in codebooks:
        codebook[:, :kept] = codes.to(codebook.dtype)
