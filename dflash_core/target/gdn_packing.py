"""Packed rows for hybrid (Gated DeltaNet) targets: every document restarts the recurrence and its
short causal conv, so a packed row gives each document the states it gets alone.

transformers' GDN layers (Qwen3.5/3.6, Qwen3-Next) call two module-level functions of their
modeling module, `causal_conv1d_fn` and `torch_chunk_gated_delta_rule`. `install_packed_gdn`
wraps those two names (once per modeling module); the wrappers act only inside
`packed_documents(position_ids)` (the capture's forward) and otherwise call the original unchanged.
The segments travel in a context variable, not as a keyword of the decoder's call, so the target's
compiled attention layers never see (and never recompile for) a per-batch object. Inside it:
- the recurrence runs in flash-linear-attention with `cu_seqlens` over the flattened batch when
  transformers bound fla's kernel, else transformers' torch function once per document;
- the conv runs in fla's Triton kernel with `cu_seqlens` when fla imports and the tensors are on a
  GPU; otherwise transformers' own conv (torch, or the `causal_conv1d` package) runs over a copy of
  the row with kernel_width - 1 zeros in front of every document, which is exactly the left padding
  the conv gives a document alone.

Why transformers logs "falling back to its reference PyTorch implementation" with fla installed:
it looks for the conv in a separate package, `causal_conv1d` (Dao-AILab's CUDA build), which fla
does not provide under that name; the delta rule does bind to fla. With fla on a GPU our wrapper
calls fla's own conv instead, and `GDNKernels` says which kernels ran. transformers also binds the
torch path for the delta rule, silently, when `import fla` fails or fla is not importable yet at the
moment it first imports the model's module (the choice is made once, at that import);
`install_packed_gdn` warns with the reason when that happens on a GPU.

Documents: a new one starts where the position ids do not step by 1 (as
`dflash_core.model.anchors.document_ids_from_positions`), except that a position-0 token right after
another one joins its segment unless a longer document starts there: the padding at the end of a
row (and one-token documents, which carry no anchors) is one segment, so an unpacked row costs one
call per document, not one per padding token.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_MARK = "_dflash_packed_original"
_SEGMENTS: contextvars.ContextVar[PackedSegments | None] = contextvars.ContextVar("dflash_gdn_segments",
                                                                                  default=None)


@dataclasses.dataclass(frozen=True)
class GDNKernels:
    """What runs a hybrid target's GDN layers: `recurrence` is "fla" or "torch", `conv` is "fla",
    "causal-conv1d" or "torch"; `transformers_bound` is what transformers itself chose."""

    recurrence: str
    conv: str
    transformers_bound: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        bound = ", ".join(f"{name}={kind}" for name, kind in self.transformers_bound.items())
        return f"GDN recurrence: {self.recurrence}, conv: {self.conv} (transformers bound {bound})"


@dataclasses.dataclass(frozen=True)
class PackedSegments:
    """The documents of a [B, T] batch: `bounds[b]` lists (start, end) per row; `cu_seqlens` indexes
    the flattened B*T tokens (on the batch's device, and a host copy for fla's planner)."""

    bounds: tuple[tuple[tuple[int, int], ...], ...]
    starts_flat: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    _gapped: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def gapped_index(self, gap: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """Where each flattened token goes when `gap` zeros precede every segment, and the new length
        (computed once per batch, not once per layer)."""
        key = (gap, str(device))
        if key not in self._gapped:
            segment = self.starts_flat.long().cumsum(0)
            index = torch.arange(segment.numel()) + gap * segment
            length = segment.numel() + gap * int(segment[-1])
            self._gapped[key] = (index.to(device, non_blocking=True), length)
        return self._gapped[key]


def segment_starts(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: a segment (document) starts here."""
    starts = torch.ones_like(position_ids_BT, dtype=torch.bool)
    previous, current = position_ids_BT[:, :-1], position_ids_BT[:, 1:]
    following = torch.cat([position_ids_BT[:, 2:], torch.zeros_like(position_ids_BT[:, :1])], dim=1)
    in_zero_run = (current == 0) & (previous == 0) & (following != 1)  # padding, or a one-token document
    starts[:, 1:] = (current != previous + 1) & ~in_zero_run
    return starts


def packed_segments(position_ids_BT: torch.Tensor, *, device: torch.device | None = None) -> PackedSegments:
    """Segments from position ids (pass the host copy where there is one: this reads them on the host)."""
    starts = segment_starts(position_ids_BT.cpu())
    batch, seq_len = starts.shape
    bounds = []
    for row in starts:
        cuts = torch.nonzero(row).flatten().tolist() + [seq_len]
        bounds.append(tuple(zip(cuts[:-1], cuts[1:])))
    cu = [0] + [b * seq_len + end for b, row in enumerate(bounds) for _, end in row]
    cu_cpu = torch.tensor(cu, dtype=torch.long)
    device = torch.device(device) if device is not None else position_ids_BT.device
    staged = cu_cpu.pin_memory() if device.type == "cuda" else cu_cpu  # a pageable source may make the copy wait
    return PackedSegments(tuple(bounds), starts.flatten(), staged.to(device, non_blocking=True), cu_cpu)


@contextlib.contextmanager
def packed_documents(position_ids_BT: torch.Tensor | None, *,
                     device: torch.device | None = None) -> Iterator[None]:
    """Within it, wrapped GDN layers restart at every document of these rows (no-op for None)."""
    segments = None if position_ids_BT is None else packed_segments(position_ids_BT, device=device)
    token = _SEGMENTS.set(segments)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def _bound_kind(function: Any) -> str:
    """"fla", "causal-conv1d" or "torch": the implementation transformers' fallback decorator chose
    when the modeling module was imported (read from the decorator's closure)."""
    try:
        implementation = inspect.getclosurevars(function).nonlocals.get("implementation")
    except (TypeError, ValueError):
        implementation = None
    module = getattr(implementation, "__module__", "") or ""
    if module.startswith("fla"):
        return "fla"
    if module.startswith("causal_conv1d"):
        return "causal-conv1d"
    return "torch"


@functools.cache
def _fla_conv() -> Any:
    try:
        return importlib.import_module("fla.modules.causal_conv1d").causal_conv1d
    except Exception:  # fla absent, or no Triton / GPU to import it with
        return None


def _fla_conv_applies(hidden_states: torch.Tensor) -> bool:
    return hidden_states.is_cuda  # fla's Triton kernels need a GPU


def _why_not_fla() -> str:
    """Why transformers' GDN recurrence is on its torch path although this is a GPU run."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as error:  # transformers swallows the same error when it imports the model module
        return f"`import fla.ops.gated_delta_rule` fails here ({type(error).__name__}: {error})"
    return ("fla imports now, but did not when transformers first imported the model's module: make fla "
            "importable (PYTHONPATH / install) before the process loads the target")


def _gdn_modules(model: nn.Module) -> list[Any]:
    """The modeling modules of the model's GDN layers (those with both seams)."""
    found = {}
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            source = sys.modules[type(module).__module__]
            found[source.__name__] = source
    for source in found.values():
        if not all(hasattr(source, name) for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")):
            return []
    return list(found.values())


def _original(function: Any) -> Any:
    return getattr(function, _MARK, function)


def _packed_rule(original: Any, *, varlen: bool) -> Any:
    def rule(query, key, value, **kwargs):
        segments = _SEGMENTS.get()
        if segments is None:
            return original(query, key, value, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError("packed GDN rows are for a cache-free forward (training capture)")
        kwargs.pop("cu_seqlens", None)
        per_token = {name: kwargs.pop(name) for name in ("g", "beta")}
        batch, seq_len = query.shape[:2]
        if varlen:
            flat = [t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (query, key, value)]
            flat_kw = {name: t.reshape(1, batch * seq_len, *t.shape[2:]) for name, t in per_token.items()}
            out, _ = original(*flat, **flat_kw, **kwargs, cu_seqlens=segments.cu_seqlens,
                              cu_seqlens_cpu=segments.cu_seqlens_cpu)
            return out.reshape(batch, seq_len, *out.shape[2:]), None
        rows = []
        for b, bounds in enumerate(segments.bounds):
            pieces = []
            for start, end in bounds:
                span = (slice(b, b + 1), slice(start, end))
                out, _ = original(query[span], key[span], value[span],
                                  **{name: t[span] for name, t in per_token.items()}, **kwargs)
                pieces.append(out)
            rows.append(torch.cat(pieces, dim=1))
        return torch.cat(rows, dim=0), None

    setattr(rule, _MARK, original)
    return rule


def _packed_conv(original: Any) -> Any:
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        segments = _SEGMENTS.get()
        if segments is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        batch, channels, seq_len = hidden_states.shape  # [B, C, T]
        fla_conv = _fla_conv() if _fla_conv_applies(hidden_states) else None
        if fla_conv is not None:
            # transformers hands over [B, T, C] transposed: this is a view, no copy
            x_1NC = hidden_states.transpose(1, 2).reshape(1, batch * seq_len, channels).contiguous()
            y_1NC, _ = fla_conv(x_1NC, weight, bias, activation=activation, cu_seqlens=segments.cu_seqlens,
                                cu_seqlens_cpu=segments.cu_seqlens_cpu)
            return y_1NC.reshape(batch, seq_len, channels).transpose(1, 2)
        index, length = segments.gapped_index(weight.shape[-1] - 1, hidden_states.device)
        flat_1CN = hidden_states.permute(1, 0, 2).reshape(1, channels, batch * seq_len)
        gapped = flat_1CN.new_zeros(1, channels, length).index_copy_(2, index, flat_1CN)
        out = original(gapped, weight, bias, activation=activation, **kwargs).index_select(2, index)
        return out.reshape(channels, batch, seq_len).permute(1, 0, 2)

    setattr(conv, _MARK, original)
    return conv


def install_packed_gdn(model: nn.Module) -> GDNKernels | None:
    """Make `model`'s GDN layers exact on packed rows (idempotent); None when it has no GDN layers
    this module knows how to wrap. Returns which kernels run them on `model`'s device."""
    sources = _gdn_modules(model)
    if not sources:
        return None
    bound = {}
    for source in sources:
        rule, conv = _original(source.torch_chunk_gated_delta_rule), _original(source.causal_conv1d_fn)
        bound = {"chunk_gated_delta_rule": _bound_kind(rule), "causal_conv1d_fn": _bound_kind(conv)}
        source.torch_chunk_gated_delta_rule = _packed_rule(rule, varlen=bound["chunk_gated_delta_rule"] == "fla")
        source.causal_conv1d_fn = _packed_conv(conv)
    parameter = next(model.parameters(), None)
    on_gpu = parameter is not None and parameter.is_cuda
    if on_gpu and bound["chunk_gated_delta_rule"] != "fla":
        warnings.warn(f"GDN layers run transformers' torch path on a GPU (slow): {_why_not_fla()}",
                      stacklevel=1)  # reported here, so once, though the trainer and the capture both install
    conv_kind = "fla" if on_gpu and _fla_conv() is not None else bound["causal_conv1d_fn"]
    return GDNKernels(recurrence=bound["chunk_gated_delta_rule"], conv=conv_kind, transformers_bound=bound)
