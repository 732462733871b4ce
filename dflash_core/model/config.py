"""The drafter's configuration: one dataclass, derived from the target's config.

`DFlashConfig.from_target` reads the shapes a drafter must share with its target (hidden size,
heads, head_dim, rope_theta) and picks the tapped target layers; `build()` makes the model.
Only torch and transformers-free Python here, so it imports anywhere.

The drafter's attention is its own, whatever the target's family: plain Qwen3 layers with q/k
RMSNorm, full-head rotary and no attention bias, as released drafters and every runtime (z-lab's
reference, vLLM, SGLang) build them. A Llama target's drafter still gets q/k norm; a Qwen3.5
target's partial rotary (0.25) and attention gate stay with the target.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_core.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_LAYERS, default_tapped_layer_count

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def tapped_layer_ids(*, num_target_layers: int, num_tapped_layers: int) -> list[int]:
    """Native ids (id k = OUTPUT of decoder layer k = transformers `hidden_states[k+1]`),
    spread evenly from 1 to N-3: 36 -> [1, 9, 17, 25, 33], 64 -> [1, 16, 31, 46, 61].

    Same formula as the z-lab reference (Python round(), half to even), so ids agree with released
    drafters: 30 layers -> [1, 8, 14, 20, 27].
    """
    if num_tapped_layers < 1:
        raise ValueError(f"num_tapped_layers must be >= 1, got {num_tapped_layers}")
    if num_target_layers < 4:
        raise ValueError(f"a target needs >= 4 layers to tap, got {num_target_layers}")
    if num_tapped_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if num_tapped_layers > end - start + 1:
        raise ValueError(
            f"cannot tap {num_tapped_layers} distinct layers among ids {start}..{end} "
            f"of a {num_target_layers}-layer target"
        )
    span = end - start
    return [int(round(start + i * span / (num_tapped_layers - 1))) for i in range(num_tapped_layers)]


def _rope_settings(target_config: Any) -> tuple[float, float, str]:
    """(rope_theta, partial_rotary_factor, rope_type) from a transformers 5.x config.

    5.x keeps them in `rope_parameters`; older configs keep attributes. Hybrid Qwen3.5 sets
    partial_rotary_factor 0.25 there: it belongs to the target's attention, not the drafter's.
    """
    params = dict(getattr(target_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(target_config, "partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", "default")
    return float(theta), float(partial if partial is not None else 1.0), str(rope_type)


def _text_config(target_config: Any) -> Any:
    """The language-model part of a composite config (Qwen3.5 wraps it in `text_config`)."""
    return getattr(target_config, "text_config", None) or target_config


@dataclasses.dataclass
class DFlashConfig:
    """Shapes and settings of a DFlash drafter. Field names follow transformers where they can."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_layers: int = DEFAULT_NUM_LAYERS
    block_size: int = DEFAULT_BLOCK_SIZE
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Kept so drafters trained before the runtime conventions were enforced still load; new
    # drafters are always 1.0 / True / False, and exports refuse anything else (export/checks.py).
    partial_rotary_factor: float = 1.0
    qk_norm: bool = True
    attention_bias: bool = False
    target_model_type: str = "qwen3"
    target_num_layers: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [FULL_ATTENTION] * self.num_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = list(self.target_layer_ids)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; use {_LAYER_TYPES}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a row of a {self.vocab_size}-row embedding")

    @property
    def num_tapped_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        num_layers: int = DEFAULT_NUM_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_tapped_layers: int | None = None,
        mask_token_id: int | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
    ) -> DFlashConfig:
        """Derive a drafter for `target_config` (a transformers config, composite or text)."""
        text = _text_config(target_config)
        theta, _, rope_type = _rope_settings(text)
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported by the drafter yet (only 'default')")
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        model_type = str(getattr(text, "model_type", "")).removesuffix("_text")
        if mask_token_id is None:
            mask_token_id = _default_mask_token_id(text)
        num_target_layers = text.num_hidden_layers
        return cls(
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            target_layer_ids=tapped_layer_ids(
                num_target_layers=num_target_layers, num_tapped_layers=num_tapped_layers
                or default_tapped_layer_count(num_layers=num_layers, num_target_layers=num_target_layers)
            ),
            mask_token_id=mask_token_id,
            num_layers=num_layers,
            block_size=block_size,
            layer_types=layer_types,
            sliding_window=sliding_window,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            partial_rotary_factor=1.0,
            qk_norm=True,
            attention_bias=False,
            target_model_type=model_type,
            target_num_layers=num_target_layers,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _default_mask_token_id(text_config: Any) -> int:
    """The mask row when only the config is known: the last row that is no end, BOS or pad token.
    The trainer passes a better one (it knows the tokenizer and the corpus): see `mask_token`."""
    from dflash_core.model.mask_token import choose_mask_token_id

    return choose_mask_token_id(text_config)
