"""The target side of speculative decoding: prefill, verify, and rolling its cache back.

Uses transformers' own KV cache (`DynamicCache`). Attention layers are cropped to the accepted
length (`crop(-n)` in transformers 5.24). Hybrid Qwen3.5-family targets also hold Gated DeltaNet
recurrent state, which cannot be cropped: before each verify the runner snapshots those (fixed
size, cheap) layers; after a partial acceptance it restores them, crops the attention layers back
to before the block, and re-runs the target on the accepted tokens (one extra forward per
partially accepted round). Tree verification needs a 4D mask through every layer, which a
recurrent layer cannot take, so tree mode refuses hybrid targets.
"""

from __future__ import annotations

import copy
import inspect
import dataclasses
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dflash_core.model.config import _text_config


@dataclasses.dataclass
class TargetStep:
    """logits [n, V] and tapped features [n, L*H] of the n tokens just fed (batch of one)."""

    logits: torch.Tensor
    tapped: torch.Tensor | None


class TargetRunner:
    """Wraps a frozen transformers CausalLM (batch size one) for draft/verify rounds."""

    def __init__(self, target: torch.nn.Module, *, layer_ids: list[int]) -> None:
        text = _text_config(target.config)
        self.target = target
        self.num_layers = text.num_hidden_layers
        if not layer_ids or layer_ids[0] < 0 or layer_ids[-1] >= self.num_layers - 1:
            # hidden_states[N] is already final-normed in transformers: never tap the last layer here.
            raise ValueError(f"layer_ids {layer_ids} must lie in 0..{self.num_layers - 2} for this target")
        self.layer_ids = list(layer_ids)
        self.is_hybrid = any(t != "full_attention" and t != "sliding_attention"
                             for t in (getattr(text, "layer_types", None) or []))
        if any(t == "sliding_attention" for t in (getattr(text, "layer_types", None) or [])):
            raise ValueError("targets with sliding-window attention layers are not supported by the evaluator yet")
        self.cache: Any = None
        self.length = 0
        # transformers 5.2x renamed `past_key_values` to `cache`; older 5.x only knows the old name.
        params = inspect.signature(target.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @torch.no_grad()
    def _forward(self, ids: list[int], *, position_ids=None, attention_mask=None, hidden: bool,
                 all_logits: bool) -> TargetStep:
        self._last_fed = list(ids)
        input_ids = torch.tensor([ids], device=self.device)
        out = self.target(
            input_ids=input_ids, **{self._cache_kwarg: self.cache}, position_ids=position_ids, attention_mask=attention_mask,
            use_cache=True, output_hidden_states=hidden, logits_to_keep=0 if all_logits else 1,
        )
        self.cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        tapped = None
        if hidden:
            tapped = torch.cat([out.hidden_states[k + 1][0] for k in self.layer_ids], dim=-1)
        self.length += len(ids)
        return TargetStep(logits=out.logits[0], tapped=tapped)

    def prefill(self, prompt: list[int], *, hidden: bool = True) -> TargetStep:
        """Fresh cache; logits of the last prompt token only, features of every prompt token."""
        if not prompt:
            raise ValueError("prompt is empty")
        self.cache = DynamicCache(config=self.target.config)
        self.length = 0
        return self._forward(prompt, hidden=hidden, all_logits=False)

    def step(self, token: int) -> torch.Tensor:
        """Plain greedy decoding: feed one token, return its logits [V]."""
        return self._forward([token], hidden=False, all_logits=False).logits[-1]

    def verify_block(self, tokens: list[int]) -> TargetStep:
        """Feed the block [last accepted, drafts...] after the cache; causal, one forward."""
        self._snapshot = self._snapshot_recurrent() if self.is_hybrid else None
        return self._forward(tokens, hidden=True, all_logits=True)

    def verify_tree(self, tokens: list[int], *, ancestor_mask: torch.Tensor, depths: list[int]) -> TargetStep:
        """Feed tree nodes (topological order) with an ancestor-only 4D mask and depth positions."""
        if self.is_hybrid:
            raise ValueError("tree verification needs attention-only targets; this target has recurrent (GDN) layers")
        past = self.length
        size = len(tokens)
        mask = torch.cat((torch.ones(size, past, dtype=torch.bool), ancestor_mask), dim=1)
        position_ids = torch.tensor([[past + d for d in depths]], device=self.device)
        return self._forward(tokens, position_ids=position_ids, attention_mask=mask[None, None].to(self.device),
                             hidden=True, all_logits=True)

    def keep_block_prefix(self, *, num_fed: int, num_kept: int) -> None:
        """After `verify_block` of `num_fed` tokens, keep only the first `num_kept` in the cache."""
        if num_kept == num_fed:
            return
        if not self.is_hybrid:
            self.cache.crop(-(num_fed - num_kept))
            self.length -= num_fed - num_kept
            return
        # Recurrent layers cannot drop tokens: restore them and re-run the kept tokens.
        for index, layer in self._snapshot.items():
            self.cache.layers[index] = layer
        for layer in self.cache.layers:
            if isinstance(layer, DynamicLayer):
                layer.crop(-num_fed)
        self.length -= num_fed
        self._forward(self._last_fed[:num_kept], hidden=False, all_logits=False)

    def keep_tree_nodes(self, *, num_fed: int, keep_nodes: list[int]) -> None:
        """After `verify_tree` of `num_fed` nodes, keep the listed nodes (root and accepted path)."""
        past = self.length - num_fed
        index = torch.tensor(list(range(past)) + [past + n for n in keep_nodes], device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(2, index)
            layer.values = layer.values.index_select(2, index)
        self.length = past + len(keep_nodes)

    def _snapshot_recurrent(self) -> dict[int, Any]:
        return {i: copy.deepcopy(layer) for i, layer in enumerate(self.cache.layers)
                if not isinstance(layer, DynamicLayer)}
