"""Capacity arithmetic to run before any flow commits to an architecture.

Storage of offline hidden states (all tokens, or anchors only) against online training (0 bytes),
GPU memory for online training per layout, hidden-state transfer time between GPUs, and
generation wall time. Byte counts are exact integers; the tables print binary units (GiB/TiB,
powers of 1024) with decimal terabytes (TB, 10^12) beside them where the field quotes TB.

The activation estimate is a coarse model (bytes per token per layer, constants below); the
training benchmark is the ground truth, and these constants should follow it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_core.defaults import ANCHORS_PER_1024_TOKENS, DEFAULT_BLOCK_SIZE, DEFAULT_NUM_LAYERS
from dflash_core.strict import not_utf8_text, validation_summary

GiB = 1024**3
TB = 10**12

# Bytes kept per token for one drafter layer during backward, in units of hidden/intermediate width
# (bf16 activations: q,k,v,o inputs/outputs, norms, MLP gate/up/act): ~10 H + 4 I values of 2 bytes.
_DRAFTER_SAVED_PER_H = 10
_DRAFTER_SAVED_PER_I = 4
# Transient peak of one target layer under inference mode: residual, qkv, attention out, gate/up/act.
_TARGET_TRANSIENT_PER_H = 6
_TARGET_TRANSIENT_PER_I = 3
# fp32 master weight + fp32 grad + AdamW exp_avg + exp_avg_sq.
_TRAINABLE_BYTES_PER_PARAM = 16
# CUDA context, allocator fragmentation, NCCL buffers.
_RESERVED_BYTES = 4 * GiB
# What FP8 drafter linears (drafter_fp8, torchao's Float8Linear) save per linear parameter: a bf16 linear under
# autocast keeps a bf16 copy of its weight from forward to backward and makes a bf16 weight gradient before the
# fp32 one; a Float8Linear casts the fp32 master straight to FP8 for each GEMM. Measured on one H200
# (2026-12-04, bench/results/2026-12-04_h200_fp8-drafter): -4.2 GiB on the Qwen3-8B DFlash 2 drafter (1.09B linear
# parameters: 4.1 bytes each), -6.4 GiB on the Qwen3.5-27B one (1.90B: 3.6 bytes each); the lower, rounded down.
_DRAFTER_FP8_SAVED_PER_LINEAR_PARAM = 3.5
# Input ranges: many times any model, dataset or cluster of today, and narrow enough that every figure of a
# plan stays finite (`dflash plan --json` must stay JSON: no Infinity, no NaN).
MAX_SIZE = 10**7  # widths, vocabulary, counts (layers, heads, GPUs, instances), GiB of a GPU, GB/s of a link
MAX_TOKENS = 10**8  # tokens in one sample or one micro-batch, anchors per 1,000 tokens, tokens/s
MAX_SAMPLES = 10**12
MAX_PARAMS = 10**15


class ModelShape(BaseModel):
    """What the planner needs of a target: from flags, a preset or a HF config.json."""

    # A preset changed by `model_copy(update=...)` skips validation; PlanInputs validates it again.
    model_config = ConfigDict(revalidate_instances="always", allow_inf_nan=False)

    num_layers: int | None = Field(None, gt=0, le=MAX_SIZE)
    hidden_size: int = Field(gt=0, le=MAX_SIZE)
    intermediate_size: int | None = Field(None, gt=0, le=MAX_SIZE)
    num_attention_heads: int | None = Field(None, gt=0, le=MAX_SIZE)
    num_key_value_heads: int | None = Field(None, gt=0, le=MAX_SIZE)
    head_dim: int | None = Field(None, gt=0, le=MAX_SIZE)
    vocab_size: int | None = Field(None, gt=0, le=MAX_SIZE)
    tie_word_embeddings: bool = False
    num_params: int | None = Field(None, gt=0, le=MAX_PARAMS, description="Overrides the estimate from the shape.")

    def layer_params(self) -> int | None:
        if None in (self.intermediate_size, self.num_attention_heads):
            return None
        heads = self.num_attention_heads
        kv_heads = self.num_key_value_heads or heads
        head_dim = self.head_dim or self.hidden_size // heads
        attention = self.hidden_size * head_dim * (2 * heads + 2 * kv_heads)
        return attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    def params(self) -> int | None:
        if self.num_params is not None:
            return self.num_params
        per_layer = self.layer_params()
        if per_layer is None or self.num_layers is None or self.vocab_size is None:
            return None
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size


PRESETS: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape(num_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "qwen3-8b": ModelShape(num_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-32b": ModelShape(num_layers=64, hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                            num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # Hybrid (Gated DeltaNet + gated attention); parameter count as measured in DESIGN.md.
    "qwen3.5-27b": ModelShape(num_layers=64, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                              num_key_value_heads=4, head_dim=256, vocab_size=248320, num_params=26_900_000_000),
}


def params_from_billions(billions: float) -> int:
    """`--target-params` in billions as a parameter count; refuses what is not in (0, MAX_PARAMS / 1e9]."""
    if not 0 < billions <= MAX_PARAMS / 1e9:  # False for NaN too
        raise ValueError(f"--target-params {billions}: it must be > 0 and <= {MAX_PARAMS // 10**9:,} (billions)")
    return round(billions * 1e9)


def shape_from_config(path: Path) -> ModelShape:
    """Read a HF `config.json` (a composite config's `text_config` is used when present)."""
    try:
        raw = json.loads(Path(path).read_text())
    except UnicodeDecodeError as error:
        raise ValueError(f"--model-config {path}: {not_utf8_text(error)}") from error
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--model-config {path}: cannot read a JSON model config ({error})") from error
    if not isinstance(raw, dict):
        raise ValueError(f"--model-config {path}: a JSON {_json_kind(raw)}, not a transformers config.json (an "
                         "object with hidden_size, num_hidden_layers, ...)")
    config = raw.get("text_config")
    if config is None:
        config = raw
    elif not isinstance(config, dict):
        raise ValueError(f"--model-config {path}: its text_config is a JSON {_json_kind(config)}, not an object "
                         "with the text model's hidden_size, num_hidden_layers, ...")
    if "hidden_size" not in config:
        raise ValueError(f"--model-config {path}: no `hidden_size` in it; is this a transformers config.json?")
    try:
        return ModelShape(
            num_layers=config.get("num_hidden_layers"), hidden_size=config["hidden_size"],
            intermediate_size=config.get("intermediate_size"), num_attention_heads=config.get("num_attention_heads"),
            num_key_value_heads=config.get("num_key_value_heads"), head_dim=config.get("head_dim"),
            vocab_size=config.get("vocab_size"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        )
    except ValidationError as error:
        raise ValueError(f"--model-config {path}: {validation_summary(error)}") from None


def _json_kind(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(value), "null")


class PlanInputs(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    target: ModelShape
    tapped_layers: int = Field(DEFAULT_NUM_LAYERS, gt=0, le=MAX_SIZE, description="Target layers whose hidden states the drafter reads.")
    dtype_bytes: int = Field(2, gt=0, le=8, description="Bytes per hidden-state value (bf16 = 2).")
    target_fp8: bool = Field(False, description="The target's decoder-layer weights in FP8 (1 byte each; the "
                             "embedding and LM head stay at dtype_bytes; the whole target is loaded first, a peak "
                             "of its own): TrainConfig.target_fp8.")
    drafter_fp8: bool = Field(False, description="The drafter's own linears in FP8 (torchao float8 training; "
                              "fp32 masters and optimizer state as before): TrainConfig.drafter_fp8.")
    lm_head_fp8: bool = Field(False, description="The loss's LM-head GEMMs in FP8: two FP8 copies of the head on "
                              "the drafter's GPU, 2 bytes per head parameter: TrainConfig.lm_head_fp8.")
    samples: int = Field(gt=0, le=MAX_SAMPLES)
    mean_tokens: float = Field(gt=0, le=MAX_TOKENS, description="Mean tokens per sample (prompt + completion).")
    mean_completion_tokens: float | None = Field(None, gt=0, le=MAX_TOKENS,
                                                 description="For generation time; defaults to mean_tokens.")
    anchors_per_sample: int = Field(512, gt=0, le=MAX_TOKENS)
    drafter_layers: int = Field(DEFAULT_NUM_LAYERS, gt=0, le=MAX_SIZE)
    block_size: int = Field(DEFAULT_BLOCK_SIZE, gt=1, le=MAX_SIZE)
    token_budget: int = Field(8192, gt=0, le=MAX_TOKENS, description="Tokens per training micro-batch per GPU.")
    anchors_per_1k_tokens: float = Field(ANCHORS_PER_1024_TOKENS * 1000 / 1024, gt=0, le=MAX_TOKENS,
                                         description="Anchors per 1,000 batch tokens; default: a training run's "
                                         "default density (dflash_core.defaults, 512 per 2,048).")
    gpu_memory_gib: float = Field(139.0, gt=0, le=MAX_SIZE, description="Usable memory of one GPU (H200: ~139 GiB).")
    num_gpus: int = Field(1, gt=0, le=MAX_SIZE)
    interconnect_gb_s: float = Field(450.0, ge=0.001, le=MAX_SIZE,
                                     description="GPU-to-GPU bandwidth, GB/s (NVLink ~450, PCIe 5 ~50).")
    generation_tokens_per_s: float = Field(2000.0, ge=0.001, le=MAX_TOKENS,
                                           description="Output tokens/s of one inference instance.")
    inference_instances: int = Field(1, gt=0, le=MAX_SIZE)
    variant: Literal["dflash", "dflash2"] = Field(
        "dflash2", description="Drafter variant (the trainer's default is dflash2): DFlash 2 adds conv pairs and a "
        "candidate selector (two vocab x rank codebooks).")
    conv_kernel_size: int = Field(2, gt=0, le=MAX_SIZE, description="DFlash 2: conv taps.")
    conv_group_size: int = Field(16, gt=0, le=MAX_SIZE, description="DFlash 2: channels per dynamic-kernel group.")
    selector_rank: int = Field(256, gt=0, le=MAX_SIZE, description="DFlash 2: rank of the selector's codebooks.")
    max_steps: int | None = Field(None, gt=0, le=MAX_SAMPLES, description="Optimizer steps of the training run "
                                  "(with tokens_per_step: how many times it goes over the data).")
    tokens_per_step: int | None = Field(None, gt=0, le=MAX_TOKENS, description="Batch tokens per optimizer step, "
                                        "all ranks: token_budget x grad_accum x data-parallel ranks.")

    @model_validator(mode="after")
    def _tapped_fit(self) -> PlanInputs:
        layers = self.target.num_layers  # a run lists at most ids 0..N-2: the last layer's output is final-normed
        if layers is not None and self.tapped_layers > max(1, layers - 1):
            raise ValueError(f"--tapped-layers {self.tapped_layers} exceeds the {max(1, layers - 1)} layers a drafter "
                             f"can read of a {layers}-layer target (ids 0..{max(0, layers - 2)}): training would refuse it")
        return self


class LayoutVerdict(BaseModel):
    layout: Literal["colocated", "pair"]
    gpus_per_replica: int
    replicas: int
    peak_bytes_per_gpu: int
    fits: bool | None = Field(description="None when the target's size is unknown.")
    note: str


class Plan(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)  # the input ranges keep every figure finite

    bytes_per_token: int
    total_tokens: int
    offline_bytes: int
    anchor_only_bytes: int
    online_bytes: int
    target_params: int | None
    drafter_params: int
    target_weight_bytes: int | None
    drafter_state_bytes: int
    target_activation_bytes: int
    drafter_activation_bytes: int
    drafter_fp8_saved_bytes: int = Field(0, description="What drafter_fp8 takes off the peaks: no bf16 working "
                                         "copies of the drafter's linear weights and their gradients.")
    lm_head_fp8_bytes: int = Field(0, description="lm_head_fp8's two FP8 head copies on the drafter's GPU.")
    layouts: list[LayoutVerdict]
    transfer_bytes_per_batch: int
    transfer_ms_per_batch: float
    generation_hours: float
    data_passes: float | None = Field(None, description="max_steps x tokens_per_step / total_tokens: passes "
                                      "over the training data (None without max_steps).")
    data_note: str = ""


def drafter_params(shape: ModelShape, *, drafter_layers: int, tapped_layers: int, variant: str = "dflash",
                   conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 256) -> int:
    """Drafter = `drafter_layers` target-shaped decoder layers + fc(L*H -> H) + norms; no embeddings.
    DFlash 2 adds, per layer, two conv pairs (static kernel 2*k*H, kernel projection H -> 2*k*H/group)
    and one selector (two vocab x rank codebooks, an H -> rank projection)."""
    hidden = shape.hidden_size
    per_layer = shape.layer_params()
    if per_layer is None:  # shape unknown: the common 8/3 MLP ratio and full MHA
        per_layer = 4 * hidden * hidden + 3 * hidden * math.ceil(hidden * 8 / 3) + 2 * hidden
    total = drafter_layers * per_layer + tapped_layers * hidden**2 + 2 * hidden
    if variant == "dflash2":
        conv_pair = 2 * conv_kernel_size * hidden + hidden * 2 * conv_kernel_size * (hidden // conv_group_size)
        vocab = shape.vocab_size or 0  # unknown vocabulary: the selector's codebooks are left out
        total += drafter_layers * 2 * conv_pair + 2 * vocab * selector_rank + hidden * selector_rank
    return total


def drafter_linear_params(shape: ModelShape, **drafter: object) -> int:
    """The drafter's parameters in linears (what drafter_fp8 converts): all but DFlash 2's selector codebooks,
    which are embedding tables. The norms and conv kernels left in are a rounding error."""
    total = drafter_params(shape, **drafter)
    if drafter.get("variant") == "dflash2":
        total -= 2 * (shape.vocab_size or 0) * int(drafter.get("selector_rank", 256))
    return total


def _embedding_params(shape: ModelShape) -> int:
    """Embedding + LM head parameters (0 when the vocabulary is unknown)."""
    if shape.vocab_size is None:
        return 0
    return shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)


def plan(inputs: PlanInputs, *, suggest: bool = True) -> Plan:
    """The plan for `inputs`; with `suggest`, a layout that does not fit says which FP8 option would make it."""
    shape = inputs.target
    hidden = shape.hidden_size
    intermediate = shape.intermediate_size or math.ceil(hidden * 8 / 3)
    bytes_per_token = inputs.tapped_layers * hidden * inputs.dtype_bytes
    total_tokens = round(inputs.samples * inputs.mean_tokens)
    anchored_tokens = inputs.samples * min(inputs.anchors_per_sample, inputs.mean_tokens)

    target_params = shape.params()
    target_weights = target_params * inputs.dtype_bytes if target_params is not None else None
    # FP8 layers are quantized after the target loads whole: the load is a peak of its own. Without a
    # vocabulary size the embedding can't be told apart, so nothing is counted at 1 byte.
    loaded_target_weights = target_weights
    if target_weights is not None and inputs.target_fp8 and shape.vocab_size is not None:
        target_weights -= (target_params - _embedding_params(shape)) * (inputs.dtype_bytes - 1)
    drafter = dict(drafter_layers=inputs.drafter_layers, tapped_layers=inputs.tapped_layers, variant=inputs.variant,
                   conv_kernel_size=inputs.conv_kernel_size, conv_group_size=inputs.conv_group_size,
                   selector_rank=inputs.selector_rank)
    draft_params = drafter_params(shape, **drafter)
    drafter_state = draft_params * _TRAINABLE_BYTES_PER_PARAM

    budget = inputs.token_budget
    # Target: one layer's transient activations + the captured taps + the final hidden state.
    target_activations = budget * 2 * (
        _TARGET_TRANSIENT_PER_H * hidden + _TARGET_TRANSIENT_PER_I * intermediate
        + (inputs.tapped_layers + 1) * hidden
    )
    # Rounded first: a run's anchors reach here as num_anchors * 1000 / token_budget, whose float product can
    # land a hair above the integer it came from (12,345 tokens, 15 anchors -> 15.000000000000002).
    query_tokens = math.ceil(round(budget * inputs.anchors_per_1k_tokens / 1000, 6)) * inputs.block_size
    drafter_activations = 2 * inputs.drafter_layers * (
        query_tokens * (_DRAFTER_SAVED_PER_H * hidden + _DRAFTER_SAVED_PER_I * intermediate)
        + budget * 2 * hidden  # projected K/V of the target context, per layer
    ) + budget * (inputs.tapped_layers + 1) * hidden * 2
    # Capped at the drafter's activations: the constants above were fitted to bf16 runs, where the working copies
    # hid in them; a small batch on a wide drafter must not come out below its activations' floor.
    fp8_saved = min(drafter_activations, math.floor(
        drafter_linear_params(shape, **drafter) * _DRAFTER_FP8_SAVED_PER_LINEAR_PARAM)) if inputs.drafter_fp8 else 0
    lm_head_fp8_bytes = 2 * (shape.vocab_size or 0) * hidden if inputs.lm_head_fp8 else 0

    transfer_bytes = budget * (inputs.tapped_layers + 1) * hidden * inputs.dtype_bytes
    layouts = _layouts(inputs, target_weights, drafter_state, target_activations,
                       drafter_activations - fp8_saved + lm_head_fp8_bytes, transfer_bytes,
                       loaded_target_weights=loaded_target_weights,
                       drafter_weights=draft_params * 4)  # fp32 weights, before any optimizer state
    if suggest and any(v.fits is False and v.replicas > 0 for v in layouts):
        layouts = _suggest_fp8(inputs, layouts)
    completion = inputs.mean_completion_tokens or inputs.mean_tokens
    generation_s = inputs.samples * completion / (inputs.generation_tokens_per_s * inputs.inference_instances)
    return Plan(
        bytes_per_token=bytes_per_token,
        total_tokens=total_tokens,
        offline_bytes=bytes_per_token * total_tokens,
        anchor_only_bytes=round(bytes_per_token * anchored_tokens),
        online_bytes=0,
        target_params=target_params,
        drafter_params=draft_params,
        target_weight_bytes=target_weights,
        drafter_state_bytes=drafter_state,
        target_activation_bytes=target_activations,
        drafter_activation_bytes=drafter_activations,
        drafter_fp8_saved_bytes=fp8_saved,
        lm_head_fp8_bytes=lm_head_fp8_bytes,
        layouts=layouts,
        transfer_bytes_per_batch=transfer_bytes,
        transfer_ms_per_batch=transfer_bytes / (inputs.interconnect_gb_s * 1e9) * 1e3,
        generation_hours=generation_s / 3600,
        **_data_passes(inputs, total_tokens),
    )


MANY_DATA_PASSES = 20  # the acceptance bench: at 28 passes the training tau - 1 was 2x the held-out's, at 11 equal


def _data_passes(inputs: PlanInputs, total_tokens: int) -> dict:
    """How many times the run goes over its data, and a warning when that is enough to memorize it."""
    if inputs.max_steps is None or inputs.tokens_per_step is None:
        return {}
    passes = inputs.max_steps * inputs.tokens_per_step / max(total_tokens, 1)
    note = (f"{inputs.max_steps} steps go over the {inputs.samples:,} samples about {passes:.0f} times: a drafter "
            "memorizes data it sees this often (training tau far above held-out, docs/benchmarks.md 'Acceptance "
            f"against training data'); generate about {max(2, math.ceil(passes / MANY_DATA_PASSES))}x the samples, or train "
            "fewer steps") if passes > MANY_DATA_PASSES else ""
    return {"data_passes": passes, "data_note": note}


_FP8_OPTIONS = {
    "target_fp8": "target_fp8: true (FP8 target GEMMs, compute capability >= 9.0)",
    "drafter_fp8": "drafter_fp8: true (the drafter's linears in FP8 through torchao, compute capability >= 8.9)",
}


def _suggest_fp8(inputs: PlanInputs, layouts: list[LayoutVerdict]) -> list[LayoutVerdict]:
    """Each layout that does not fit as asked but does with FP8 says which option makes it fit: the target's
    FP8 layers first (the larger saving on a large target), then the drafter's, then both."""
    unset = [flag for flag in _FP8_OPTIONS if not getattr(inputs, flag)]
    options = [[flag] for flag in unset] + ([unset] if len(unset) == 2 else [])
    tried = {tuple(flags): {v.layout: v for v in plan(inputs.model_copy(update=dict.fromkeys(flags, True)),
                                                       suggest=False).layouts} for flags in options}
    suggested = []
    for verdict in layouts:
        fitting = next(((flags, by_layout[verdict.layout]) for flags, by_layout in tried.items()
                        if verdict.fits is False and by_layout[verdict.layout].fits), None)
        if fitting is not None:
            flags, with_fp8 = fitting
            options_text = " and ".join(_FP8_OPTIONS[flag] for flag in flags)
            verdict = verdict.model_copy(update={"note": f"{verdict.note}; or set {options_text}, which fits with "
                                                         f"{with_fp8.note}"})
        suggested.append(verdict)
    return suggested


def _layouts(inputs: PlanInputs, target_weights: int | None, drafter_state: int, target_act: int,
             drafter_act: int, transfer_bytes: int, *, loaded_target_weights: int | None,
             drafter_weights: int) -> list[LayoutVerdict]:
    capacity = inputs.gpu_memory_gib * GiB
    if target_weights is None:
        unknown = "target size unknown: pass --preset, --model-config or --target-params for a verdict"
        return [LayoutVerdict(layout=layout, gpus_per_replica=n, replicas=inputs.num_gpus // n, peak_bytes_per_gpu=0, fits=None,
                              note=unknown) for layout, n in (("colocated", 1), ("pair", 2))]
    colocated = target_weights + drafter_state + target_act + drafter_act + _RESERVED_BYTES
    target_gpu = target_weights + target_act + transfer_bytes + _RESERVED_BYTES
    if loaded_target_weights is not None:  # the moment before the layers are quantized (target_fp8)
        colocated = max(colocated, loaded_target_weights + drafter_weights + _RESERVED_BYTES)
        target_gpu = max(target_gpu, loaded_target_weights + _RESERVED_BYTES)
    drafter_gpu = drafter_state + drafter_act + transfer_bytes + _RESERVED_BYTES
    verdicts = []
    for layout, per_replica, peak in (("colocated", 1, colocated), ("pair", 2, max(target_gpu, drafter_gpu))):
        replicas = inputs.num_gpus // per_replica
        fits = peak <= capacity and replicas > 0
        if replicas == 0:
            note = f"needs {per_replica} GPUs, have {inputs.num_gpus}"
        elif fits:
            note = f"{(capacity - peak) / GiB:.1f} GiB headroom per GPU"
        else:
            note = f"short by {(peak - capacity) / GiB:.1f} GiB per GPU: lower --token-budget or use more GPUs"
        verdicts.append(LayoutVerdict(layout=layout, gpus_per_replica=per_replica, replicas=replicas,
                                      peak_bytes_per_gpu=peak, fits=fits, note=note))
    return verdicts
