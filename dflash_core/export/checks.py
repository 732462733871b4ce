"""Checks run before any export is written: the drafter must fit its target, and the two formats
must say the same thing.

A layer-id offset, a mask id outside the target's embedding, or a dropped window / RoPE setting
all produce a drafter that loads fine and accepts nothing when served, so they are refused here
with a ValueError that names the field.
"""

from __future__ import annotations

from typing import Any

from dflash_core.export.native import num_speculative_tokens
from dflash_core.model.build import build_drafter
from dflash_core.model.config import SLIDING_ATTENTION, DFlashConfig, _rope_settings, _text_config
from dflash_core.model.dflash2 import DFlash2Config

# Weight names a drafter checkpoint may hold (candidate_selector: DFlash 2); anything else
# (embed_tokens, lm_head, a target layer) must never be written.
DRAFTER_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.", "candidate_selector.")


def check_against_target(config: DFlashConfig, *, target_config: Any) -> None:
    """Raise ValueError unless `config` is a drafter for `target_config` (a transformers config)."""
    text = _text_config(target_config)
    num_target_layers = text.num_hidden_layers
    ids = config.target_layer_ids
    if not ids:
        raise ValueError("target_layer_ids is empty")
    if sorted(set(ids)) != list(ids):
        raise ValueError(f"target_layer_ids must be distinct and ascending, got {ids}")
    if ids[0] < 0 or ids[-1] >= num_target_layers:
        raise ValueError(f"target_layer_ids {ids} out of range for a {num_target_layers}-layer target")
    if config.target_num_layers is not None and config.target_num_layers != num_target_layers:
        raise ValueError(
            f"drafter was built for a {config.target_num_layers}-layer target, this target has {num_target_layers}"
        )
    if config.hidden_size != text.hidden_size:
        raise ValueError(f"hidden_size {config.hidden_size} != target hidden_size {text.hidden_size}")
    if config.vocab_size != text.vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} != target vocab_size {text.vocab_size}")
    if not 0 <= config.mask_token_id < text.vocab_size:
        raise ValueError(
            f"mask_token_id {config.mask_token_id} is not a row of the target's {text.vocab_size}-row embedding"
        )
    theta, _, _ = _rope_settings(text)
    if config.rope_theta != theta:
        raise ValueError(f"rope_theta {config.rope_theta} != target rope_theta {theta}")
    if SLIDING_ATTENTION in config.layer_types and not config.sliding_window:
        raise ValueError("sliding_attention layers need a sliding_window to export")


def check_runtime_conventions(config: DFlashConfig) -> None:
    """What every runtime builds, whatever the config says: z-lab's reference, vLLM and SGLang make
    each drafter layer plain Qwen3 attention (q/k RMSNorm always, whole-head rotary, SGLang with
    rotary_dim = head_dim hard-coded; no bias on o_proj in vLLM/SGLang). A drafter trained otherwise
    would load and draft something else, so it is refused here (drafters built by `from_target`
    always conform; only a checkpoint whose config sets these fields otherwise trips this)."""
    if not config.qk_norm:
        raise ValueError(
            "this drafter was trained without q/k RMSNorm; every runtime (z-lab, vLLM, SGLang, speculators) "
            "builds q_norm/k_norm and would run it with untrained norms. Retrain it with the current code "
            "(q/k norm is always on)."
        )
    if config.partial_rotary_factor != 1.0:
        raise ValueError(
            f"this drafter rotates {config.partial_rotary_factor:g} of each head (copied from a partial-rotary "
            "target); SGLang hard-codes rotary_dim = head_dim and z-lab's reference rotates whole heads. "
            "Retrain it with the current code (full-head rotary)."
        )
    if config.attention_bias:
        raise ValueError("attention_bias=True drafters cannot be served as trained (runtimes build o_proj "
                         "without bias and q/k/v bias layouts differ); retrain without attention bias")


def check_state_dict(config: DFlashConfig, state: dict[str, Any]) -> None:
    """Raise ValueError if `state` holds target weights or does not match the drafter's shapes."""
    foreign = sorted(k for k in state if not k.startswith(DRAFTER_PREFIXES))
    if foreign:
        raise ValueError(f"refusing to export non-drafter weights (target weights?): {foreign[:5]}")
    expected = build_drafter(config, device="meta").state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"drafter weights do not match its config: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, config says {tuple(expected[name].shape)}")


def check_speculators_compatible(config: DFlashConfig, *, num_target_layers: int) -> None:
    """What speculators 0.9's DFlash (and DFlash 2) layer can represent beyond the runtime conventions."""
    if isinstance(config, DFlash2Config) and (
        config.output_multiplier != 1.0 or config.final_logit_softcapping is not None
    ):
        raise ValueError(
            "speculators 0.9's DFlash2 applies neither output_multiplier nor final_logit_softcapping to the "
            f"unary logits (this drafter: {config.output_multiplier:g}, {config.final_logit_softcapping}); "
            "served from that format it would propose other tokens. Export it in the native format only."
        )
    last_aux = config.target_layer_ids[-1] + 1
    if last_aux >= num_target_layers:
        raise ValueError(
            f"native id {config.target_layer_ids[-1]} is the target's last layer; speculators treats aux id "
            f"{last_aux} as the verifier's last hidden state and drops it"
        )


def check_formats_agree(native: dict[str, Any], speculators: dict[str, Any]) -> None:
    """The two config.json dicts must describe the same drafter (ids offset by one)."""
    dflash = native["dflash_config"]
    layer = speculators["transformer_layer_config"]
    aux = speculators["aux_hidden_state_layer_ids"]
    if aux != [k + 1 for k in dflash["target_layer_ids"]]:
        raise ValueError(f"aux_hidden_state_layer_ids {aux} != native target_layer_ids + 1 {dflash['target_layer_ids']}")
    pairs = {
        "mask_token_id": (dflash["mask_token_id"], speculators["mask_token_id"]),
        "block_size": (native["block_size"], speculators["block_size"]),
        "layer_types": (native["layer_types"], layer["layer_types"]),
        "sliding_window": (native["sliding_window"], layer["sliding_window"]),
        "rope_parameters": (native["rope_parameters"], layer["rope_parameters"]),
        "num_hidden_layers": (native["num_hidden_layers"], layer["num_hidden_layers"]),
        "vocab_size": (native["vocab_size"], speculators["draft_vocab_size"]),
    }
    for name, (a, b) in pairs.items():
        if a != b:
            raise ValueError(f"{name} differs between formats: native {a!r}, speculators {b!r}")


def draft_lengths(data: dict[str, Any]) -> dict[str, int]:
    """The draft lengths a config.json states where vLLM reads them (absent ones left out): `n_predict`
    (its default num_speculative_tokens; speculators format: inside transformer_layer_config) and, for the
    speculators format, the proposal method's `speculative_tokens` (used when the directory is served as
    the model)."""
    if "speculators_model_type" not in data:
        found = {"n_predict": data.get("n_predict")}
    else:
        methods = (data.get("speculators_config") or {}).get("proposal_methods") or [{}]
        found = {
            "transformer_layer_config.n_predict": (data.get("transformer_layer_config") or {}).get("n_predict"),
            "speculators_config.proposal_methods[0].speculative_tokens": methods[0].get("speculative_tokens"),
        }
    return {name: value for name, value in found.items() if value is not None}


def check_draft_lengths(data: dict[str, Any], *, block_size: int, source: str) -> None:
    """Raise ValueError if `data` (read from `source`) states a draft length other than block_size - 1:
    vLLM would start with that many mask slots and every drafted token would change. Configs that state
    none (older exports, z-lab's) pass: the server is then started with an explicit value."""
    want = num_speculative_tokens(block_size)
    for name, value in draft_lengths(data).items():
        if value != want:
            raise ValueError(
                f"{source}: {name} is {value}, but block_size {block_size} drafts block_size - 1 = {want} "
                f"tokens; vLLM would run {value} mask slots per round and draft other tokens than this drafter "
                f"was trained to. Re-export it, or set {name} to {want}."
            )
