"""The one run schema: every hyperparameter and path of a training run. The CLI (`dflash train`)
and the Prefect training flow both take it; each run writes it back resolved as `run.yaml`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import Field, ValidationError, model_validator

from dflash_core.defaults import (
    ANCHORS_PER_1024_TOKENS, DEFAULT_BLOCK_SIZE, DEFAULT_MIN_TAPPED_LAYERS, DEFAULT_NUM_LAYERS, default_num_anchors,
    default_tapped_layer_count,
)
from dflash_core.model.config import tapped_layer_ids
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.dflash2_config import DFLASH2_FIELDS, DFlash2Config
from dflash_core.settings import default_runs_dir

CompileMode = Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"]  # torch.compile's modes
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)

from dflash_core.strict import StrictModel, validation_summary

_DFLASH2 = {field.name: field.default for field in dataclasses.fields(DFlash2Config) if field.name in DFLASH2_FIELDS}

class DrafterSettings(StrictModel):
    num_layers: int = Field(DEFAULT_NUM_LAYERS, ge=1, description="Drafter decoder layers.")
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=2, description="Tokens per draft block (anchor + B-1 masks).")
    num_anchors: int | None = Field(
        None, ge=1, description=f"Anchors per packed row. None: {ANCHORS_PER_1024_TOKENS} per 1,024 tokens of "
        "token_budget (512 per 2,048; dflash_core.defaults), so memory and step time follow the "
        "budget.")
    loss_target: Literal["teacher", "data"] = Field(
        "teacher", description="Learn the target's argmax (teacher) or the data tokens.")
    loss_gamma: float | None = Field(None, gt=0, description="Position-weight decay; None: 7 for B=16, 4 for B=8.")
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        None, description="Attention kind of each drafter layer, one entry per layer (e.g. four sliding_attention "
        "then one full_attention, as Qwen3.6-27B's drafter). None: every layer full_attention.")
    sliding_window: int | None = Field(
        None, gt=0, description="Window in tokens of the sliding_attention layers (2048 in released drafters); "
        "required when layer_types has one, ignored otherwise.")
    mask_token_id: int | None = Field(
        None, ge=0, description="None: a row no text uses (past the tokenizer's vocabulary, else an unused special "
        "token); an end-of-turn/EOS token is refused.")
    intermediate_size: int | None = Field(
        None, ge=1, description="Width of each drafter layer's MLP; None: the target's. A narrower MLP pays for "
        "more layers at the same draft cost (bench/acceptance/variants.py: default+layers=3+narrow). Servable as "
        "it is: the exported config carries it. Not with init: target, which copies the target's MLPs.")
    num_tapped_layers: int | None = Field(
        None, ge=1, description="Target layers the drafter reads, spread by the reference formula; None: one per "
        f"drafter layer (the z-lab reference) but at least {DEFAULT_MIN_TAPPED_LAYERS}, a floor cut to the layers "
        "a shallow target has (2 taps on a 2-layer drafter lost to 5 at scale: dflash_core/defaults.py).")
    target_layer_ids: list[int] | None = Field(
        None, description="Explicit native tapped ids (k = output of decoder layer k), ascending; overrides "
        "num_tapped_layers.")
    loss_type: Literal["ce", "kl"] = Field(
        "ce", description="ce: cross-entropy to the target's argmax (or the data tokens); kl: KL to the target's "
        "whole distribution at each slot (needs loss_target=teacher).")
    loss_weighting: Literal["exp_decay", "dpace"] | None = Field(
        None, description="Slot weights: exp(-(k-1)/loss_gamma), or D-PACE (speculators' DFlash default). None: "
        "dpace (measured best for both variants: bench/acceptance/).")
    dpace_alpha: float = Field(
        0.5, gt=0, le=1, description="D-PACE confidence smoothing: a slot's confidence is (1 - alpha) x its "
        "probability of the label + alpha (0.5: speculators' default).")
    dpace_source: Literal["unary", "selector"] = Field(
        "unary", description="D-PACE: whose probability of the label is a slot's confidence. unary (default): the "
        "LM head's softmax over the vocabulary; selector (DFlash 2 only): the candidate selector's K-way softmax, "
        "which is what drafting proposes from (the unary probability under-weights slots 2 and later). Needs "
        "loss_weighting dpace.")
    feature_noise: float = Field(
        0.0, ge=0, description="Training only: Gaussian noise added to each tapped target state, std = this x that "
        "state's RMS (per token and tapped layer); EAGLE-style regularization against overfitting. 0: off (default, "
        "until measured). Never applied when drafting, evaluating or exporting; drawn from the run's seed.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Training only: dropout rate on every drafter sublayer's output (attention and "
        "MLP, before the residual add). 0: off (default, until measured). Never applied when drafting, evaluating "
        "or exporting; drawn from the run's seed.")
    label_smoothing: float = Field(
        0.0, ge=0, lt=1, description="Training only: label smoothing s of the LM-head cross-entropy, loss = (1 - s) "
        "x CE + s x the mean over the vocabulary of -log q (D-PACE still weighs by the label's probability; DFlash "
        "2's selector keeps hard labels). 0: off (default, until measured). Needs loss_type ce.")
    init: Literal["random", "target"] = Field(
        "random", description="random: small normal weights. target: copy the target's last decoder layers (where "
        "name and shape agree) and pass the last tapped layer through fc (measured: lower acceptance than random on "
        "the embedded target, bench/acceptance/).")
    selector_codebook_init: Literal["random", "embedding"] = Field(
        "random", description="DFlash 2: how the candidate selector's predecessor and successor codebooks start. "
        "random (default): normal, std initializer_range. embedding: the frozen target embedding projected on its "
        "top selector_rank principal directions, rescaled to the random init's std (tokens the target embeds alike "
        "start with alike codes). The codebooks stay plain parameters; exports are unchanged.")
    anchor_sampling: Literal["uniform", "stratified"] = Field(
        "uniform", description="How a row's anchors are drawn from its eligible positions. uniform (default): "
        "num_anchors distinct positions uniformly at random. stratified: the eligible positions in row order cut "
        "into num_anchors equal strata, one uniform pick in each, so blocks overlap less, more label positions "
        "are covered and every document gets anchors in proportion to its supervised tokens.")
    prompt_anchors: bool = Field(
        False, description="Anchors may also sit in prompt positions (not only where the loss mask is on), their "
        "slots learning the target's argmax there. Needs loss_target teacher (the data tokens of a prompt are not "
        "the target's predictions).")
    variant: Literal["dflash", "dflash2"] = Field(
        "dflash2", description="dflash2 (default; longest accepted length in bench/acceptance/): DFlash 2, "
        "a dynamic causal conv around every sublayer and a candidate selector that reranks the top-K. dflash: the "
        "DFlash drafter (also DDTree decoding). Which engine serves which: vLLM 0.26 (torch 2.11) serves dflash "
        "only, vLLM 0.34 and later both (method dflash2); DFlash 2 also loads in z-lab's DFlash2DraftModel and in "
        "speculators 0.9's dflash2 when output_multiplier/softcapping are off (dflash_core/export/engines.py). "
        "Block decoding only (no DDTree); with loss_type kl its unary loss is KL, its selector keeps the target's "
        "argmax.")
    # DFlash 2 only; defaults are DFlash2Config's (the published Qwen3.8-27B-DFlash2 drafter's).
    conv_kernel_size: int = Field(
        _DFLASH2["conv_kernel_size"], ge=1,
        description="DFlash 2: taps of each dynamic causal conv (slot t sees slots t-k+1..t of its block); at "
        "most block_size.")
    conv_group_size: int = Field(
        _DFLASH2["conv_group_size"], ge=1,
        description="DFlash 2: hidden channels sharing one content-dependent kernel; must divide the target's "
        "hidden size.")
    selector_rank: int = Field(
        _DFLASH2["selector_rank"], ge=1, description="DFlash 2: rank of the candidate selector's transition score.")
    selector_top_k: int = Field(
        _DFLASH2["selector_top_k"], ge=1,
        description="DFlash 2: unary (LM-head) candidates the selector reranks per drafted slot.")
    selector_loss_weight: float = Field(
        _DFLASH2["selector_loss_weight"], ge=0,
        description="DFlash 2: alpha in loss = unary loss + alpha x selector loss (K-way cross-entropy).")
    output_multiplier: float = Field(
        _DFLASH2["output_multiplier"], gt=0,
        description="DFlash 2: scale of the unary logits (z-lab's contract; the speculators format has none).")
    final_logit_softcapping: float | None = Field(
        _DFLASH2["final_logit_softcapping"], gt=0,
        description="DFlash 2: softcap * tanh(logits / softcap) on the unary logits; None: off (the speculators "
        "format has none).")

    @model_validator(mode="after")
    def _consistent(self) -> DrafterSettings:
        if self.variant == "dflash":
            if self.dpace_source != "unary" or self.selector_codebook_init != "random":
                raise ValueError("dpace_source 'selector' and selector_codebook_init 'embedding' are about DFlash 2's "
                                 "candidate selector, which variant 'dflash' has none of: set variant=dflash2")
            changed = sorted(name for name, value in self.dflash2_fields().items()
                             if value != type(self).model_fields[name].default)
            if changed:
                raise ValueError(f"{changed} are DFlash 2 settings but variant is 'dflash': set variant=dflash2, "
                                 "or leave them at their defaults")
        else:
            if self.conv_kernel_size > self.block_size:
                raise ValueError(f"conv_kernel_size {self.conv_kernel_size} exceeds block_size {self.block_size}: "
                                 "the conv never reaches across a block")
        if self.target_layer_ids is not None:
            if self.num_tapped_layers is not None and self.num_tapped_layers != len(self.target_layer_ids):
                raise ValueError(f"num_tapped_layers {self.num_tapped_layers} disagrees with target_layer_ids "
                                 f"{self.target_layer_ids}: set one of them")
            ids = self.target_layer_ids
            if not ids or ids != sorted(set(ids)) or ids[0] < 0:
                raise ValueError(f"target_layer_ids must be distinct, ascending and >= 0, got {ids}")
        if self.loss_type == "kl" and self.loss_target != "teacher":
            raise ValueError("loss_type=kl learns the target's distribution: it needs loss_target=teacher")
        if self.label_smoothing and self.loss_type != "ce":
            raise ValueError("label_smoothing smooths cross-entropy labels: it needs loss_type=ce")
        if self.dpace_source != "unary" and self.resolved_loss_weighting != "dpace":
            raise ValueError(f"dpace_source {self.dpace_source!r} chooses D-PACE's confidences: it needs "
                             f"loss_weighting=dpace, got {self.loss_weighting!r}")
        if self.prompt_anchors and self.loss_target != "teacher":
            raise ValueError("prompt_anchors learns the target's argmax at prompt positions: it needs "
                             "loss_target=teacher (with loss_target=data a prompt slot would learn the prompt's own "
                             "tokens, which the target never predicts)")
        return self

    @property
    def resolved_loss_weighting(self) -> str:
        """`loss_weighting`, or the variant's default when it is None (the drafter config records it)."""
        return self.loss_weighting or "dpace"

    def loss_spec(self) -> LossSpec:
        """How the drafter trains (loss, slot weights, regularizers): the drafter module holds it, apart from
        its architecture config (`drafter_setup.drafter_config_for`)."""
        return LossSpec(loss_type=self.loss_type, loss_weighting=self.resolved_loss_weighting,
                        loss_gamma=self.loss_gamma, dpace_alpha=self.dpace_alpha, dpace_source=self.dpace_source,
                        feature_noise=self.feature_noise,
                        dropout=self.dropout, label_smoothing=self.label_smoothing)

    def dflash2_fields(self) -> dict[str, Any]:
        """The DFlash 2 settings, as `dflash_core.model.dflash2.drafter_config` takes them."""
        return {name: getattr(self, name) for name in DFLASH2_FIELDS}

    @property
    def tapped_layer_count(self) -> int:
        """How many target layers the drafter reads on a target deep enough (known before the target's depth is;
        a target of fewer than DEFAULT_MIN_TAPPED_LAYERS + 3 layers may give the default fewer)."""
        if self.target_layer_ids is not None:
            return len(self.target_layer_ids)
        return self.num_tapped_layers or default_tapped_layer_count(num_layers=self.num_layers)

    def tap_count(self, *, num_target_layers: int | None) -> int:
        """How many target layers the drafter reads on a target of `num_target_layers` (its ids checked), or,
        the depth unknown, on a deep one."""
        if num_target_layers is None:
            return self.tapped_layer_count
        return len(self.tapped_layer_ids(num_target_layers=num_target_layers))

    def tapped_layer_ids(self, *, num_target_layers: int) -> list[int]:
        """Native ids of the tapped target layers, checked against a target of `num_target_layers`."""
        last = num_target_layers - 2  # the last layer's transformers output is already final-normed
        if self.target_layer_ids is not None:
            bad = [k for k in self.target_layer_ids if k > last]
            if bad:
                raise ValueError(f"target_layer_ids {bad} out of range: a {num_target_layers}-layer target can be "
                                 f"tapped at native ids 0..{last} (id k is the output of decoder layer k)")
            return list(self.target_layer_ids)
        count = self.num_tapped_layers or default_tapped_layer_count(num_layers=self.num_layers,
                                                                     num_target_layers=num_target_layers)
        return tapped_layer_ids(num_target_layers=num_target_layers, num_tapped_layers=count)


class OptimSettings(StrictModel):
    lr: float = Field(6e-4, gt=0, description="Peak AdamW learning rate, reached after warmup_steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decays to lr * this by max_steps.")
    warmup_steps: int = Field(100, ge=0, description="Optimizer steps of linear warmup from 0 to lr.")
    warmup_fraction: float | None = Field(
        None, gt=0, lt=1, description="Warmup as this share of max_steps instead of warmup_steps (at least one "
        "step); None: warmup_steps.")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw: AdamW over every drafter parameter. muon: torch's Muon over the drafter's "
        "weight matrices (its update RMS matched to AdamW's) and AdamW over the rest (norms, biases, DFlash 2's "
        "codebooks), as speculators splits them; a run resumes with the optimizer it started with.")
    muon_lr: float | None = Field(None, gt=0, description="optimizer muon: the Muon group's peak learning rate; "
                                  "None: lr.")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="optimizer muon: Muon's momentum.")
    muon_weight_decay: float = Field(0.1, ge=0, description="optimizer muon: the Muon group's weight decay.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay (0: none).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW beta1 and beta2.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the drafter's global gradient norm to this before each "
                             "optimizer step.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step, per rank.")

    def resolved_warmup_steps(self, max_steps: int) -> int:
        """Warmup steps of a run of `max_steps`: warmup_fraction of it when set, else warmup_steps."""
        if self.warmup_fraction is None:
            return self.warmup_steps
        return max(1, round(self.warmup_fraction * max_steps))


class TrainConfig(StrictModel):
    run_name: str = Field("drafter", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                          description="Name of the run: its folder under output_dir and its S3 checkpoint prefix (letters, "
                          "digits, '.', '_', '-').")
    target: str = Field(description="Target model dir, or `embedded` (SmolLM2-135M), or `tiny:FAMILY` "
                        "(a tiny random model for tests).")
    data: list[str] = Field(default_factory=list, description=(
        "Tokenized Arrow shards: local paths or S3 URIs/keys/prefixes (a prefix leaves out held-out shards). The "
        "train flow fills it from its dataset input; a run needs at least one."))
    allow_failed_quality_gate: bool = Field(
        False, description="Train on shards whose quality gate failed or is unknown (refused by default); "
        "recorded here, so in run.yaml and every checkpoint manifest.")
    output_dir: Path = Field(default_factory=default_runs_dir, description="Local checkpoints and logs go to "
                             "output_dir/run_name; default: `runs` under the work dir (DFLASH_WORK_DIR).")
    token_budget: int = Field(8192, ge=16, description="Tokens per packed micro-batch per rank.")
    max_samples_per_batch: int | None = Field(
        None, ge=1, description="1 disables packing (hybrid GDN targets pack exactly: their recurrence and conv restart per document).")
    packing: Literal["best_fit", "greedy"] = Field(
        "best_fit", description="How samples fill a row: best-fit decreasing within windows of 1,024 shuffled "
        "samples (rows ~99% real on ShareGPT-like lengths) or greedy next-fit in the shuffled order (~83%; the "
        "only packing before, so resume older checkpoints with it).")
    max_steps: int = Field(1000, ge=1, description="Optimizer steps of the run (the cosine schedule ends here).")
    seed: int = Field(0, description="Seeds the drafter's init, batch order, anchors and training noise; a rerun "
                      "with the same seed repeats the run.")
    placement: Literal["colocated", "pair"] = Field(
        "colocated", description="Target and drafter on one device, or the target on its own device.")
    target_device: str | None = Field(None, description="None: cuda:LOCAL_RANK if available, else cpu.")
    drafter_device: str | None = Field(None, description="With placement=pair: the drafter's device.")
    pair_overlap: bool = Field(
        False, description="With placement=pair: queue the next batch's target forward and transfer before the "
        "drafter trains on this one (same losses; bench/training/multi_gpu.py: 27.4K vs 23.5K tokens/s).")
    attention_backend: Literal["auto", "flex", "sdpa"] = Field(
        "auto", description="Drafter attention in training: flex (flex_attention block mask, GPU), sdpa (dense "
        "mask, CPU or debugging); auto: flex on GPU, sdpa on CPU.")
    compile: bool = Field(False, description="torch.compile the drafter layers and the target's decoder layers (GPU).")
    compile_mode: CompileMode = Field(
        "default", description="With compile: torch.compile's mode. reduce-overhead replays each compiled layer as a "
        "CUDA graph (for a fixed-shape step whose host dispatch, not the GPU, sets its time: a small target such as "
        "the acceptance bench's; docs/benchmarks.md, 'Figures behind choices'); on an H200 "
        "(2026-12-05) it ran but lost, 82.2 against 37.3 ms, as 4 of the drafter's graphs recorded again every "
        "step. Graphing the target's layers only lost too (84.8 against 35.6 ms on an H100, 2026-12-05) and "
        "was taken out. On CPU the mode changes nothing.")
    target_fp8: bool = Field(
        False, description="Run the target's decoder-layer GEMMs in FP8 (row-wise scales, dflash_core.fp8.target; H100/H200 "
        "or newer, or CPU): faster and half the target's weight memory, but the drafter then learns from an FP8 "
        "target's states, close to but not equal to the bf16 target's. For targets served in FP8.")
    target_fp8_fast_accum: bool = Field(
        True, description="With target_fp8: the FP8 GEMMs accumulate in Hopper's fast, reduced-precision mode "
        "(torch._scaled_mm use_fast_accum): 3.5% faster 8B steps at the same acceptance (docs/benchmarks.md); "
        "false for the exact accumulation.")
    drafter_fp8: bool = Field(
        False, description="Run the drafter's own linears (its layers' projections and MLPs, fc) in FP8 in training, "
        "forward and backward, through torchao's float8 training (dflash_core.fp8.drafter; needs torchao, the gpu "
        "extra, and a CUDA GPU of compute capability 8.9 or newer, 9.0 or newer for rowwise); fp32 master weights and optimizer "
        "as without it; the LM-head loss and attention stay bf16.")
    drafter_fp8_recipe: Literal["rowwise", "tensorwise"] = Field(
        "tensorwise", description="With drafter_fp8: torchao's scaling recipe, one dynamic scale per tensor "
        "(tensorwise) or per row/column (rowwise); docs/benchmarks.md has both measured.")
    lm_head_fp8: bool = Field(
        False, description="Run the drafter loss's two GEMMs against the target's LM head (the logits and their input "
        "gradient, a chunk of rows at a time) in FP8 with row-wise scales (dflash_core.model.lm_head_fp8.Fp8LMHead; H100/H200 or "
        "newer, or CPU), and the teacher's labels from FP8 logits whose top 16 are re-scored on the bf16 head (the "
        "same labels). The head's FP8 copies cost 2 bytes per LM-head parameter; the selector's candidates (re-scored "
        "the same way) and drafting keep the bf16 head. Opt-in until acceptance rows say it is harmless.")
    checkpoint_every: int = Field(200, ge=1, description="Save a checkpoint every this many steps (and at the "
                                  "end).")
    keep_last: int = Field(3, ge=1, description="Local checkpoints kept; older ones are deleted.")
    upload_checkpoints: bool = Field(
        True, description="Copy each checkpoint to S3 with manifests, and the run's run.yaml, provenance.json and "
        "metrics.jsonl at its start and at each checkpoint (dflash_core.layout.train_report_key).")
    prefetch_batches: int = Field(2, ge=0, description="Micro-batches packed and pinned ahead on a background "
                                  "thread (0: packed on the main thread when needed; the same batches either way).")
    stop_check_every: int = Field(10, ge=1, description="With several ranks: steps between their agreements on a "
                                  "stop request (each one is a collective and a host sync).")
    log_every: int = Field(10, ge=1, description="Steps per metrics record (means over the window since the "
                           "last one).")
    validate_capture_batches: int = Field(2, ge=0, description="Batches whose capture is checked before training.")
    drafter: DrafterSettings = Field(default_factory=DrafterSettings,
                                     description="The drafter's shape, loss and training recipe.")
    optim: OptimSettings = Field(default_factory=OptimSettings,
                                 description="AdamW, learning-rate schedule and gradient settings.")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.pair_overlap and self.placement != "pair":
            raise ValueError("pair_overlap overlaps the transfer between the target's and the drafter's GPUs: "
                             "it needs placement=pair")
        if self.placement == "pair" and self.drafter_device is None and self.target_device is not None:
            raise ValueError("placement=pair needs drafter_device (e.g. cuda:1) when target_device is set")
        return self

    @property
    def resolved_num_anchors(self) -> int:
        """`drafter.num_anchors`, or the budget's default (`default_num_anchors(token_budget)`) when it is None:
        what the trainer samples per row and the fit check plans for."""
        if self.drafter.num_anchors is not None:
            return self.drafter.num_anchors
        return default_num_anchors(self.token_budget)

    def resolved(self) -> TrainConfig:
        """This config with its derived defaults filled in (drafter.num_anchors): what run.yaml, the
        checkpoints' manifests and their meta record, so a reader never sees a None the run resolved."""
        return self.model_copy(update={"drafter": self.drafter.model_copy(
            update={"num_anchors": self.resolved_num_anchors})})

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.run_name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def from_yaml(cls, path: Path, *, overrides: list[str] = ()) -> TrainConfig:
        """The run config in `path` (YAML or JSON) with `--set` overrides applied; a ValueError on one line
        naming every bad key (an unknown one with its nearest valid field)."""
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"{path}: cannot read a run config ({error})") from error
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a run config is a mapping of field: value (target: ..., data: [...]), "
                             f"not a YAML {type(raw).__name__}")
        for item in overrides:
            apply_override(raw, item)
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            raise ValueError(f"{path}: {validation_summary(error)}") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`optim.lr=1e-4` -> raw["optim"]["lr"] = 1e-4 (the value parsed as YAML)."""
    dotted, equals, value = item.partition("=")
    parts = dotted.split(".")
    if not equals or not all(part.strip() for part in parts):
        raise ValueError(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-4")
    *parents, leaf = parts
    node = raw
    for depth, part in enumerate(parents, start=1):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            section = ".".join(parents[:depth])
            raise ValueError(f"--set {item!r}: {section} is {node!r}, not a section with fields (an earlier "
                             f"--set or the config gave it that value)")
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError as error:
        raise ValueError(f"--set {item!r}: the value is not YAML ({error})") from None
