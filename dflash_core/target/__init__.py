"""The frozen target and one-pass capture of its tapped hidden states.

Layer ids are native DFlash ids: id k is the OUTPUT of decoder layer k, which transformers
returns as `hidden_states[k+1]` (speculators' "aux" ids are k+1). Forward hooks copy the tapped
outputs into one [B, T, L*H] buffer during a single forward of the base model (never the
CausalLM head, so no full-vocabulary logits). When no teacher is needed the forward stops right
after the last tapped layer; with a teacher it also keeps the last layer's output BEFORE the
final norm (transformers' `hidden_states[-1]` is already normed).

Beside it in this package: what the training assembly applies to the loaded target (`runtime`: compiled
decoder layers, FP8 GEMMs, flex_attention), a hybrid target's GDN layers over packed rows (`gdn_packing`), and
transformers' packed-sequence check answered from the batch's host copy of the position ids (`packed_mask`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dflash_core.target.gdn_packing import GDNKernels, install_packed_gdn, packed_documents
from dflash_core.model.drafter import TargetHeads
from dflash_core.target.packed_mask import host_position_ids as packed_mask_from_host

TINY_FAMILIES = ("llama", "qwen3", "qwen3_5")


def tiny_target_config(
    family: str,
    *,
    num_layers: int = 6,
    hidden_size: int = 64,
    vocab_size: int = 256,
    initializer_range: float = 0.1,
) -> Any:
    """A small random-init config of a target family, for tests and smoke runs. The init range is
    larger than the usual 0.02 so the random model's logits are peaked enough to learn from."""
    import transformers

    common = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        pad_token_id=0,
        initializer_range=initializer_range,
    )
    if family == "llama":  # SmolLM2's shape: tied embeddings, no q/k norm
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=hidden_size // 4)
    if family == "qwen3_5":  # Gated DeltaNet x3 + gated full attention, partial rotary 0.25
        return transformers.Qwen3_5TextConfig(
            **common,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    raise ValueError(f"unknown family {family!r}; use one of {TINY_FAMILIES}")


def has_recurrent_layers(config: Any) -> bool:
    """True for hybrid targets (Gated DeltaNet / linear-attention layers beside attention)."""
    text = getattr(config, "text_config", None) or config
    return any(kind == "linear_attention" for kind in getattr(text, "layer_types", None) or ())


def real_shape_config(name: str) -> Any:
    """The config of a real target family member, for random-weight benchmarks at true shapes."""
    import transformers

    if name == "qwen3-8b":
        return transformers.Qwen3Config(
            hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if name == "qwen3.5-27b":  # text model: Gated DeltaNet x3 + gated attention, repeated; 26.9B params
        return transformers.Qwen3_5TextConfig(
            hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
            num_key_value_heads=4, head_dim=256, vocab_size=248320, linear_num_key_heads=16,
            linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
        )
    if name == "smollm2-135m":  # the embedded target's shape (Llama): the acceptance bench's step, timed alone
        return transformers.LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
            rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100_000.0},
        )
    raise ValueError(f"unknown real shape {name!r}; use qwen3-8b, qwen3.5-27b or smollm2-135m")


def freeze(model: nn.Module) -> nn.Module:
    """eval mode, no gradients: the target is never trained."""
    model.eval()
    model.requires_grad_(False)
    return model


def build_target(config: Any, *, device: Any = None, dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen random-weight CausalLM for `config` (tests, benchmarks)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    return freeze(model.to(device) if device is not None else model)


def build_target_on_device(config: Any, *, device: Any, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Real-shape random target in seconds: built on the meta device, `to_empty`, then initialized
    in place with transformers' own per-module init (RoPE buffers rebuilt, they are not parameters)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            model._init_weights(module)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if hasattr(child, "inv_freq") and hasattr(child, "config"):
                    setattr(parent, name, type(child)(config=child.config).to(device))
    return freeze(model)


def load_target(path: str, *, device: Any, dtype: torch.dtype | None = None) -> nn.Module:
    """A frozen target from a local directory; bf16 on GPU and fp32 on CPU unless `dtype` says otherwise."""
    import transformers

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return freeze(model.to(device))


def language_model(model: nn.Module) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm) inside a CausalLM or composite model."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "language_model", inner)
    for attribute in ("embed_tokens", "layers", "norm"):
        if not hasattr(inner, attribute):
            raise ValueError(f"{type(model).__name__} has no decoder stack with .{attribute}")
    return inner


def target_heads(model: nn.Module) -> TargetHeads:
    """The frozen modules a drafter borrows from its target."""
    lm = language_model(model)
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise ValueError(f"{type(model).__name__} has no LM head")
    return TargetHeads(embed_tokens=lm.embed_tokens, final_norm=lm.norm, lm_head=lm_head)


@dataclasses.dataclass
class CapturedStates:
    """tapped_hidden [B, T, L*H] in `layer_ids` order; final_hidden [B, T, H] pre-norm, or None.
    gdn_document_means: {decoder layer index: [documents, H]} mean output of each GDN (linear
    attention) layer per document of length >= 2, padding left out (only when asked for)."""

    input_ids: torch.Tensor
    tapped_hidden: torch.Tensor
    layer_ids: list[int]
    final_hidden: torch.Tensor | None = None
    gdn_document_means: dict[int, torch.Tensor] | None = None

    def layer(self, layer_id: int) -> torch.Tensor:
        """[B, T, H] output of decoder layer `layer_id`."""
        index = self.layer_ids.index(layer_id)
        hidden = self.tapped_hidden.shape[-1] // len(self.layer_ids)
        return self.tapped_hidden[..., index * hidden : (index + 1) * hidden]


class _StopForward(Exception):
    """Raised by the last needed hook: nothing after that layer is used."""


class HiddenStateCapture:
    """Captures tapped layer outputs (and optionally the pre-norm final state) in one forward.

    Hooks stay registered for the life of the object and act only inside `__call__`; call
    `close()` to remove them. On hybrid targets the GDN layers restart at every document of a packed
    row (dflash_core.target.gdn_packing); `gdn_kernels` says which kernels run them (None: no GDN layers, or
    recurrent layers dflash_core.target.gdn_packing does not know: pack those one document per row).
    """

    def __init__(self, model: nn.Module, *, layer_ids: list[int], capture_final: bool) -> None:
        self.model = model
        self.decoder = language_model(model)
        num_layers = len(self.decoder.layers)
        if not layer_ids or sorted(set(layer_ids)) != list(layer_ids):
            raise ValueError(f"layer_ids must be distinct and ascending, got {layer_ids}")
        if layer_ids[0] < 0 or layer_ids[-1] >= num_layers:
            raise ValueError(f"layer_ids {layer_ids} out of range for a {num_layers}-layer target")
        self.layer_ids = list(layer_ids)
        self.capture_final = capture_final
        self.gdn_kernels: GDNKernels | None = install_packed_gdn(model) if has_recurrent_layers(model.config) else None
        self.hidden_size = self.decoder.embed_tokens.weight.shape[1]
        self._buffer: torch.Tensor | None = None
        self._final: torch.Tensor | None = None
        self._active = False
        last_needed = num_layers - 1 if capture_final else self.layer_ids[-1]
        self._handles = []
        for slot, layer_id in enumerate(self.layer_ids):
            hook = self._tap_hook(slot, stop=(layer_id == last_needed and not capture_final))
            self._handles.append(self.decoder.layers[layer_id].register_forward_hook(hook))
        if capture_final:
            self._handles.append(self.decoder.layers[num_layers - 1].register_forward_hook(self._final_hook))

    @staticmethod
    def _output_tensor(output: Any) -> torch.Tensor:
        return output[0] if isinstance(output, tuple) else output  # older transformers return tuples

    def _tap_hook(self, slot: int, *, stop: bool):
        def hook(module, args, output):
            if not self._active:
                return None
            hidden = self._output_tensor(output)
            width = self.hidden_size
            self._buffer[..., slot * width : (slot + 1) * width].copy_(hidden)
            if stop:
                raise _StopForward
            return None

        return hook

    def _final_hook(self, module, args, output):
        if self._active:
            self._final = self._output_tensor(output)

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        host_position_ids: torch.Tensor | None = None,
        gdn_summary: bool = False,
    ) -> CapturedStates:
        """`host_position_ids`: a host copy of `position_ids`; the document boundaries are read from it
        (hybrid targets' GDN segments, transformers' packed-sequence mask: dflash_core.target.packed_mask)
        rather than from `position_ids`, which waits for the device. `gdn_summary`:
        also record each GDN layer's mean output per document (for `validate_capture`)."""
        batch, seq_len = input_ids.shape
        positions = host_position_ids if host_position_ids is not None else position_ids
        documents = packed_documents(positions if self.gdn_kernels is not None else None, device=input_ids.device)
        summary_handles, gdn_means = [], {}
        if gdn_summary:
            summary_handles = self._summarize_gdn(positions, (batch, seq_len), gdn_means)
        dtype = self.decoder.embed_tokens.weight.dtype
        self._buffer = torch.empty(
            batch, seq_len, len(self.layer_ids) * self.hidden_size, dtype=dtype, device=input_ids.device
        )
        self._final = None
        self._active = True
        try:
            with documents, packed_mask_from_host(host_position_ids):
                self.decoder(
                    input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
                )
        except _StopForward:
            pass
        finally:
            self._active = False
            for handle in summary_handles:
                handle.remove()
        captured = CapturedStates(
            input_ids=input_ids, tapped_hidden=self._buffer, layer_ids=self.layer_ids, final_hidden=self._final,
            gdn_document_means=gdn_means if gdn_summary else None,
        )
        self._buffer = self._final = None
        return captured

    def _summarize_gdn(self, position_ids: torch.Tensor | None, shape: tuple[int, int], out: dict) -> list:
        """Temporary hooks that store each GDN layer's mean output per real document (>= 2 tokens)."""
        from dflash_core.model.anchors import document_ids_from_positions

        if position_ids is None:
            position_ids = torch.arange(shape[1]).expand(shape)
        positions = position_ids.cpu()
        documents = document_ids_from_positions(positions)
        spans = []
        for row, (row_docs, row_pos) in enumerate(zip(documents, positions)):
            for doc in torch.unique(row_docs).tolist():
                index = torch.nonzero(row_docs == doc).flatten()
                real = bool((row_pos[index] == torch.arange(index.numel())).all())  # padding restarts at 0 each token
                if index.numel() >= 2 and real:
                    spans.append((row, int(index[0]), int(index[-1]) + 1))
        handles = []
        for index, layer in enumerate(self.decoder.layers):
            mixer = getattr(layer, "linear_attn", None)
            if mixer is None:
                continue

            def hook(module, args, output, index=index):
                output = self._output_tensor(output).float()
                out[index] = torch.stack([output[row, start:end].mean(dim=0) for row, start, end in spans]) if spans \
                    else output.new_zeros(0, output.shape[-1])

            handles.append(mixer.register_forward_hook(hook))
        return handles

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def validate_capture(
    captured: CapturedStates, *, input_ids: torch.Tensor, hidden_size: int, min_variance: float = 1e-12
) -> None:
    """Raise ValueError, naming the layer, if a capture is misshapen, non-finite, constant, or was
    taken for other tokens. Syncs with the device: run it before long runs, not every step."""
    if not torch.equal(captured.input_ids.to(input_ids.device), input_ids):
        raise ValueError("captured hidden states were computed for different token ids than the batch's")
    batch, seq_len = input_ids.shape
    expected = (batch, seq_len, len(captured.layer_ids) * hidden_size)
    if tuple(captured.tapped_hidden.shape) != expected:
        raise ValueError(f"tapped_hidden has shape {tuple(captured.tapped_hidden.shape)}, expected {expected}")
    named = [(f"target layer {k} (hidden_states[{k + 1}])", captured.layer(k)) for k in captured.layer_ids]
    if captured.final_hidden is not None:
        if tuple(captured.final_hidden.shape) != (batch, seq_len, hidden_size):
            raise ValueError(f"final_hidden has shape {tuple(captured.final_hidden.shape)}")
        named.append(("final layer (pre-norm)", captured.final_hidden))
    for name, states in named:
        states = states.float()
        if not torch.isfinite(states).all():
            raise ValueError(f"{name}: captured states contain NaN or Inf")
        variance = states.var().item()
        if not variance > min_variance:
            raise ValueError(f"{name}: captured states are constant (variance {variance:.3g}); all-zero capture?")
    for layer, means in (captured.gdn_document_means or {}).items():
        _check_gdn_layer(layer, means.float(), min_variance=min_variance)


def _check_gdn_layer(layer: int, means: torch.Tensor, *, min_variance: float) -> None:
    """A GDN layer's per-document mean outputs [documents, H]: finite, not all zero, and different
    between the documents of a packed row (the field's all-zero-states failure on hybrid targets)."""
    name = f"GDN (linear attention) layer {layer}"
    if not torch.isfinite(means).all():
        raise ValueError(f"{name}: output contains NaN or Inf")
    if means.numel() and not means.abs().max().item() > 0:
        raise ValueError(f"{name}: output is all zero; the GDN kernels returned nothing")
    if means.shape[0] >= 2:
        spread = means.var(dim=0).max().item()
        if not spread > min_variance:
            raise ValueError(f"{name}: output is the same for every document of the row (spread {spread:.3g})")
