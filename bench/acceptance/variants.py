"""The acceptance bench's rows: the fixed budget (Shape), the recipes (Variant) and the named sets of
rows a run takes (suites). A row is the library default with some DrafterSettings / OptimSettings /
TrainConfig fields changed, or one of speculators 0.9's own drafters trained by its own forward."""

from __future__ import annotations

import dataclasses
import re

# The embedded target (SmolLM2-135M) has 30 decoder layers: native tap ids run 0..28 (id 29's
# transformers output is already final-normed); the default's 5 taps are [1, 8, 14, 20, 27] (spread over 1 .. N-3;
# one per drafter layer, [1, 27] on the bench's 2 layers, until 2026-12-05).
EMBEDDED_LAST_TAP = 28


@dataclasses.dataclass(frozen=True)
class Shape:
    """The fixed budget every variant trains under (2 layers, B=8, 128 anchors per 2,048-token row,
    200 steps)."""

    num_layers: int = 2
    block_size: int = 8
    num_anchors: int = 128
    token_budget: int = 2048
    steps: int = 200
    long_multiplier: int = 10
    train_prompts: int = 1024
    eval_prompts: int = 24
    max_prompt_tokens: int = 256
    train_new_tokens: int = 256
    eval_new_tokens: int = 128
    own_prompts: int = 6


FULL = Shape()
TINY = Shape(num_layers=2, block_size=8, num_anchors=16, token_budget=256, steps=4, long_multiplier=0,
             train_prompts=8, eval_prompts=1, max_prompt_tokens=96, train_new_tokens=32, eval_new_tokens=16,
             own_prompts=2)



def row_tokens(result: dict) -> int:
    """The tokens of a result's packed row; rows from before they were recorded trained on FULL's 2,048."""
    return result.get("token_budget", FULL.token_budget)


def steps_text(steps: int, tokens: int) -> str:
    """`2000`, or `500 x 8,192 tokens` for a row other than FULL's 2,048 tokens."""
    return f"{steps}" if tokens == FULL.token_budget else f"{steps} x {tokens:,} tokens"


SPECULATORS_KINDS = {"speculators": "dflash", "speculators-dflash2": "dflash2"}  # kind -> its algorithm
# The schedule speculators rows can share with ours (their loop runs AdamW on our lr_factor schedule).
SPECULATORS_OPTIM = {"lr", "warmup_steps", "warmup_fraction", "min_lr_ratio", "betas", "weight_decay"}
MASK_CHOICES = (None, "eos")
SPECULATORS_TAPS = (1, 14, 26)  # what speculators' trainer taps on the 30-layer SmolLM2 (its rows' target_layer_ids)
# A third drafter layer at the same layer parameters as the default's two on SmolLM2 (7,399,680 against
# 7,421,440; tests/unit/test_bench_acceptance.py checks it): 2 x (attention + conv + 3 x 576 x 1,536) =
# 3 x (attention + conv + 3 x 576 x I), rounded down to a multiple of 16.
NARROW_MLP = 816


@dataclasses.dataclass(frozen=True)
class Variant:
    """One recipe: the library default with some DrafterSettings / OptimSettings fields changed, or
    speculators' own model and loss (kind "speculators": its DFlash, "speculators-dflash2": its
    experimental DFlash 2; `drafter` may then set num_anchors only, and `optim` the AdamW schedule they
    share with ours, SPECULATORS_OPTIM, so a schedule lever runs on every recipe).

    `mask` (speculators rows): None, speculators' own choice (train.utils.resolve_mask_token_id: the
    tokenizer's mask token, else a new <|MASK|> in a spare embedding row) and, where that ends in its
    last-resort pad/EOS fallback (it warns), the unused token a user heeding the warning passes as
    --mask-token-id (the one our trainer picks); "eos": that fallback as it is."""

    name: str
    what: str
    drafter: dict = dataclasses.field(default_factory=dict)
    optim: dict = dataclasses.field(default_factory=dict)
    kind: str = "ours"
    train: dict = dataclasses.field(default_factory=dict)  # TrainConfig fields, e.g. target_fp8
    mask: str | None = None

    def __post_init__(self) -> None:
        if self.kind != "ours" and self.kind not in SPECULATORS_KINDS:
            raise ValueError(f"variant {self.name!r}: kind must be 'ours' or one of {sorted(SPECULATORS_KINDS)}")
        if self.kind != "ours" and (set(self.drafter) - {"num_anchors"} or set(self.optim) - SPECULATORS_OPTIM
                                    or self.train):
            raise ValueError(f"variant {self.name!r}: speculators rows take num_anchors and the AdamW "
                             f"schedule ({', '.join(sorted(SPECULATORS_OPTIM))}) only (its own recipe)")
        if self.mask not in MASK_CHOICES or (self.mask and self.kind == "ours"):
            raise ValueError(f"variant {self.name!r}: mask is for speculators rows, one of {MASK_CHOICES}")


def _default(**changes) -> dict:
    """The default row's DrafterSettings changes plus `changes`."""
    return {"num_anchors": 512, **changes}


def variants() -> dict[str, Variant]:
    items = [
        Variant("default", "the library's default recipe (DFlash 2, D-PACE, 512 anchors per 2,048 tokens)",
                drafter=_default()),
        Variant("dflash", "the DFlash drafter (D-PACE), the default before DFlash 2 measured better",
                drafter={"variant": "dflash"}),
        Variant("dflash2", "DFlash 2 (dynamic conv + candidate selector; published defaults, exp-decay CE)",
                drafter={"variant": "dflash2"}),
        # Training-only levers on top of the default (each off in the library: none beat the default).
        Variant("default+last-tap=N-2", f"the default, its last tap moved from N-3 to N-2 (native [1, 8, 14, 20, "
                f"{EMBEDDED_LAST_TAP}] instead of [1, 8, 14, 20, 27]; drafter.target_layer_ids)",
                drafter=_default(target_layer_ids=[1, 8, 14, 20, EMBEDDED_LAST_TAP])),
        Variant("default+noise=0.2", "the default, feature noise 0.2 x RMS", drafter=_default(feature_noise=0.2)),
        Variant("default+dropout=0.1", "the default, dropout 0.1 on every drafter sublayer's output",
                drafter=_default(dropout=0.1)),
        Variant("default+target_fp8", "the default, trained on the target's FP8 GEMMs (TrainConfig.target_fp8); "
                "evaluated against the full-precision target, as a bf16-served target would be",
                drafter=_default(), train={"target_fp8": True}),
        Variant("default+target_fp8+fast_accum", "the default, trained on the target's FP8 GEMMs with Hopper's "
                "fast accumulation (TrainConfig.target_fp8_fast_accum)", drafter=_default(),
                train={"target_fp8": True, "target_fp8_fast_accum": True}),
        Variant("default+drafter_fp8", "the default, its own linears trained in FP8 through torchao's float8 "
                "training (TrainConfig.drafter_fp8, its default recipe); needs torchao and an sm89+ GPU",
                drafter=_default(), train={"drafter_fp8": True}),
        Variant("default+target_fp8+drafter_fp8", "the default, trained on the target's FP8 GEMMs with its own "
                "linears in FP8 too (TrainConfig.target_fp8 and drafter_fp8); evaluated against the bf16 target",
                drafter=_default(), train={"target_fp8": True, "drafter_fp8": True}),
        Variant("default+muon", "the default, Muon over the drafter's matrices and AdamW over the rest "
                "(optim.optimizer: muon; speculators' default optimizer)", drafter=_default(), optim={"optimizer": "muon"}),
        # Levers against overfitting and for later slots (each off in the library: none beat the default).
        Variant("default+dpace=selector", "the default, D-PACE confidences from the selector's K-way probability "
                "instead of the unary one (drafter.dpace_source)", drafter=_default(dpace_source="selector")),
        Variant("default+codebooks=embedding", "the default, the selector's codebooks starting as the target "
                "embedding's top principal components (drafter.selector_codebook_init)",
                drafter=_default(selector_codebook_init="embedding")),
        Variant("default+selector_rank=64", "the default with a rank-64 selector (4x fewer codebook parameters "
                "than 256)", drafter=_default(selector_rank=64)),
        Variant("default+anchors=stratified", "the default, one anchor per stratum of the eligible positions "
                "(drafter.anchor_sampling)", drafter=_default(anchor_sampling="stratified")),
        Variant("default+prompt_anchors", "the default, anchors in prompts too, learning the target's argmax there "
                "(drafter.prompt_anchors)", drafter=_default(prompt_anchors=True)),
        Variant("default+kl", "the default with a KL unary loss to the target's distribution "
                "(drafter.loss_type; the selector keeps the target's argmax; speculators' DFlash 2 default)",
                drafter=_default(loss_type="kl")),
        Variant("default+dpace=selector+codebooks=embedding", "both selector levers",
                drafter=_default(dpace_source="selector", selector_codebook_init="embedding")),
        Variant("default+dpace=selector+codebooks=embedding+anchors=stratified", "both selector levers and "
                "stratified anchors", drafter=_default(dpace_source="selector", selector_codebook_init="embedding",
                                                        anchor_sampling="stratified")),
        # The ablation: what the default adds over speculators' DFlash 2, one part at a time taken back to
        # speculators' choice, and a structural change at the same draft cost.
        Variant("default+exp_decay", "the default without D-PACE: fixed exp-decay slot weights (speculators' DFlash "
                "2's)", drafter=_default(loss_weighting="exp_decay")),
        Variant("default+anchors=128", "the default at speculators' anchor density (128 per 2,048-token row, its "
                "512 per 8,192)", drafter=_default(num_anchors=128)),
        Variant("default+taps=speculators", f"the default reading speculators' 3 taps on SmolLM2 ({SPECULATORS_TAPS}) "
                "instead of its 5", drafter=_default(target_layer_ids=list(SPECULATORS_TAPS))),
        Variant("default+taps=2", "the default reading one tap per drafter layer ([1, 27]; its setting until "
                "5 taps won this ablation)",
                drafter=_default(num_tapped_layers=2)),
        Variant("default+layers=3+narrow", f"structural: 3 drafter layers with {NARROW_MLP}-wide MLPs instead of 2 "
                f"with the target's 1,536 (the layers' parameters within 0.3%: the same GEMM work per drafted token), "
                "the same 5 taps", drafter=_default(num_layers=3, intermediate_size=NARROW_MLP)),
        Variant("speculators", "speculators 0.9 DFlashDraftModel, its trainer's defaults (D-PACE + CE, its 3 taps, "
                "its 512 anchors per 8,192 tokens); mask: its rule, the EOS fallback replaced", kind="speculators"),
        Variant("speculators+mask=eos", "speculators DFlash with its literal mask fallback (pad = EOS on SmolLM2)",
                kind="speculators", mask="eos"),
        Variant("speculators+anchors=512", "speculators DFlash at our anchor density", kind="speculators",
                drafter={"num_anchors": 512}),
        Variant("speculators-dflash2", "speculators 0.9's experimental DFlash2DraftModel, its trainer's defaults "
                "(KL + exp-decay gamma 4, selector K-way CE x 1.0, its 3 taps, its 512 anchors per 8,192 tokens)",
                kind="speculators-dflash2"),
        Variant("speculators-dflash2+anchors=512", "speculators' DFlash 2 at our anchor density",
                kind="speculators-dflash2", drafter={"num_anchors": 512}),
        # The schedule on every recipe at once (the speculators rows run on our AdamW schedule).
        *[Variant(f"{base}+lr={lr}", f"{what}, peak learning rate {lr} instead of 6e-4", kind=kind,
                  drafter=_default() if kind == "ours" else {}, optim={"lr": float(lr)})
          for lr in ("3e-4", "1.2e-3")
          for base, kind, what in (("default", "ours", "the default"),
                                   ("speculators", "speculators", "speculators DFlash"),
                                   ("speculators-dflash2", "speculators-dflash2", "speculators' DFlash 2"))],
    ]
    return {v.name: v for v in items}


# Named sets of rows. compare: our default against speculators' recipes and the levers that exist as options;
# core: the three recipes; levers: the selector, anchor and prompt levers against both speculators rows; overfit:
# the levers against memorizing, for 2,000 steps.
SUITES = {
    "compare": ["speculators", "speculators-dflash2", "default", "dflash", "speculators+anchors=512",
                "speculators-dflash2+anchors=512", "speculators+mask=eos", "default+last-tap=N-2", "default+muon"],
    "core": ["speculators", "speculators-dflash2", "default"],
    "tiny": ["default", "speculators", "speculators-dflash2"],
    "levers": ["default", "speculators", "speculators-dflash2", "default+dpace=selector", "default+codebooks=embedding",
               "default+selector_rank=64", "default+anchors=stratified", "default+prompt_anchors",
               "default+kl",
               "default+dpace=selector+codebooks=embedding",
               "default+dpace=selector+codebooks=embedding+anchors=stratified"],
    "fp8": ["default", "default+target_fp8", "default+target_fp8+fast_accum"],
    "drafter_fp8": ["default", "default+drafter_fp8", "default+target_fp8+drafter_fp8"],
    # The learning rate on all three recipes at once (the baselines at 6e-4 are the core rows).
    "schedule": [f"{base}+lr={lr}" for lr in ("3e-4", "1.2e-3")
                 for base in ("default", "speculators", "speculators-dflash2")],
    # The curve's points: each recipe at its two learning rates (6e-4, the library's, and 3e-4), 6 rows.
    "scale": ["default", "default+lr=3e-4", "speculators", "speculators+lr=3e-4", "speculators-dflash2",
              "speculators-dflash2+lr=3e-4"],
    # Where the default memorizes (2,000 steps over 1,024 completions: training tau 4.08, held out 1.556):
    # the levers against overfitting, six jobs.
    "overfit": ["default", "default+codebooks=embedding", "default+selector_rank=64", "default+kl",
                "default+dropout=0.1", "default+noise=0.2"],
    # The ablation, at 16,384 completions: each part of the default taken back to speculators' DFlash 2's choice
    # (D-PACE, anchor density, taps, the unary loss, the selector's rank), then a structural change at the same
    # draft cost and the taps' rule before 2026-12-05 (one per drafter layer: 2); with the three recipes at the lr
    # each was best at there (6e-4), so a run at a new seed is also that seed of the curve's point. The measured
    # run (seed 1) was of the 2-tap default; its `default+taps=5` row is today's default.
    "ablate": ["default", "speculators", "speculators-dflash2", "default+exp_decay", "default+anchors=128",
               "default+taps=speculators", "default+kl", "default+selector_rank=64", "default+taps=2",
               "default+layers=3+narrow"],
}
DEFAULT_VARIANTS = list(variants())
LONG_VARIANTS = ["default", "speculators"]


@dataclasses.dataclass(frozen=True)
class Job:
    variant: str
    seed: int
    steps: int

    @property
    def label(self) -> str:
        return f"{self.variant}@{self.steps}s{self.seed}"

    @property
    def run_name(self) -> str:
        """The label as a TrainConfig run name (letters, digits, '.', '_', '-')."""
        return re.sub(r"[^A-Za-z0-9._-]", "-", self.label)
