"""How the frozen target runs in training: its decoder layers compiled (static shapes), their GEMMs
in FP8 (dflash_core.fp8.target), and flex_attention, which skips the cross-document blocks of a packed row.
The assembly (dflash_core.train.assemble, .parallelize) applies them; dflash_core.target builds and
captures the target."""

from __future__ import annotations

import functools

import torch
from torch import nn

from dflash_core.target import language_model


def compile_decoder_layers(model: nn.Module, *, mode: str = "default") -> None:
    """torch.compile each decoder layer's forward with static shapes; capture hooks stay eager, outside
    it. A Gated DeltaNet layer's own forward stays eager: it takes each batch's document segments
    (dflash_core.target.gdn_packing), which a static-shape graph would recompile for, and its fla kernels are
    Triton already. Its norms, its gated output norm and its MLP (eager elementwise work over every
    token) compile on their own. In the reduce-overhead mode each compiled forward's outputs are
    copied out of its CUDA graph's memory (graph_outputs_owned)."""
    def compiled(forward):
        forward = torch.compile(forward, dynamic=False, mode=mode)
        return graph_outputs_owned(forward) if mode == "reduce-overhead" else forward

    for layer in language_model(model).layers:
        linear_attn = getattr(layer, "linear_attn", None)
        if linear_attn is None:
            layer.forward = compiled(layer.forward)
            continue
        fp8_projections = [m for m in linear_attn.children() if type(m).__name__ == "Fp8Linear"]
        for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp,
                       getattr(linear_attn, "norm", None), *fp8_projections):
            if module is not None:  # an FP8 projection: its input's per-row quantization fuses into one kernel
                module.forward = compiled(module.forward)


def graph_outputs_owned(forward):
    """`forward` whose tensor outputs are copies that belong to the caller. The target runs without grad,
    and until the first cudagraph_mark_step_begin (the loop's; validate_capture runs before it) inductor's
    CUDA-graph trees start a new iteration at every call of a compiled function when no backward is pending,
    which frees the last iteration's outputs for the next graph to overwrite: layer
    k's replay would take as input layer k-1's output, already given up (on an H200, 2026-12-05: `accessing
    tensor output of CUDAGraphs that has been overwritten by a subsequent run`, in the 30-layer target's
    first forward), and a tapped layer's state would be overwritten before the drafter reads it. One copy
    of the hidden states per layer keeps each output alive as an ordinary tensor (whether the loop's steps,
    after a mark, need it is for the GPU to say: timing without it is the step-modes call's next question)."""
    @functools.wraps(forward)
    def owned(*args, **kwargs):
        return _copied(forward(*args, **kwargs))

    return owned


def _copied(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_copied(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    return value


def quantize_decoder_layers_fp8(model: nn.Module, *, fast_accum: bool = False) -> tuple[int, int]:
    """The decoder layers' linears to FP8 GEMMs (dflash_core.fp8.target), in place; the embedding, the final
    norm and the LM head stay as loaded. Returns (quantized, kept) linear counts."""
    from dflash_core.fp8.target import quantize_linears

    return quantize_linears(language_model(model).layers, fast_accum=fast_accum)


def use_flex_attention(model: nn.Module) -> str | None:
    """Switch the target's attention to flex_attention, which skips the cross-document blocks of a
    packed row (transformers builds the BlockMask from the position ids). Returns None when it runs,
    else why not. Some hybrid classes (Qwen3.5) only lack transformers' `_supports_flex_attn` flag
    while their attention layers call the shared attention interface like every other model: those
    are opted in on the instance; the capture validator still checks every document against itself
    run alone."""
    try:
        model.set_attn_implementation("flex_attention")
        return None
    except (ValueError, ImportError) as error:
        first_error = error
    if not isinstance(first_error, ValueError) or not _calls_attention_interface(model):
        return str(first_error)
    model._supports_flex_attn = True
    try:
        model.set_attn_implementation("flex_attention")
        return None
    except (ValueError, ImportError) as error:
        model._supports_flex_attn = False
        return f"{first_error}; opting in failed too: {error}"


def _calls_attention_interface(model: nn.Module) -> bool:
    """True when every softmax-attention layer of the model dispatches through
    transformers' ALL_ATTENTION_FUNCTIONS (so flex_attention is a drop-in)."""
    import inspect

    found = False
    for layer in language_model(model).layers:
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            continue
        try:
            source = inspect.getsource(type(attention).forward)
        except (OSError, TypeError):
            return False
        if "ALL_ATTENTION_FUNCTIONS" not in source:
            return False
        found = True
    return found
