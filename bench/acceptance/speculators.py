"""The acceptance bench's speculators side: speculators 0.9's DFlashDraftModel, or its experimental
DFlash2DraftModel, built as its trainer builds them (from_training_args, with the defaults its
TrainConfig resolves for that algorithm), trained in a loop of the same shape as our Trainer (same
packed batches, captured target states, AdamW, clipping and schedule) through its own forward and
its own loss (get_trainer_kwargs), then copied into our drafter class (logits, and for DFlash 2 the
selector's scores, checked equal) for the same evaluator."""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .variants import SPECULATORS_KINDS
from .worker import (
    WORKER, checkpoint_every, corpus_for_worker, eval_target, evaluate_drafter, steady_rate, sync_device, train_config,
    training_attention,
)

if TYPE_CHECKING:
    from .variants import Job, Variant

_BODY = ("fc", "hidden_norm", "layers", "norm", "candidate_selector")  # its weights our drafter holds


def speculators_classes(algorithm: str):
    """speculators' (model class, its TrainConfig schema) for 'dflash' or 'dflash2'."""
    from speculators.train.config.schema import TrainConfig as SpeculatorsTrainConfig

    if algorithm == "dflash":
        from speculators.models.dflash import DFlashDraftModel as model_class
    else:
        from speculators.models.dflash2 import DFlash2DraftModel as model_class
    return model_class, SpeculatorsTrainConfig


def speculators_recipe(algorithm: str) -> dict:
    """The flat arguments its trainer hands the model (`TrainConfig(speculator_type=...).flatten()`):
    dflash: CE + D-PACE; dflash2: KL + fixed exp-decay (gamma 4), selector CE x 1.0."""
    _, schema = speculators_classes(algorithm)
    return schema(speculator_type=algorithm).flatten()


# Its draft-layer attention implementations by the name our rows record.
SPECULATORS_ATTENTION = {"flex": "simple_flex_attention", "sdpa": "sdpa"}


def speculators_attention() -> str:
    """Its draft layers' attention: on a GPU its default, flex (its dense sdpa is "for hardware that doesn't support
    flex attention"), where our rows train with flex and its forward is compiled; its dense path otherwise (on the
    CPU, and uncompiled: flex without torch.compile is torch's slow reference, which builds the whole score grid)."""
    return "flex" if training_attention() == "flex" and WORKER.get("speculators_compile", True) else "sdpa"


def speculators_model(algorithm: str, recipe: dict, mask_token_id: int):
    """Its drafter as its trainer builds it (from_training_args with the flat arguments), our shape."""
    import transformers

    model_class, _ = speculators_classes(algorithm)
    model_dir = str(WORKER["model_dir"])
    verifier = transformers.AutoConfig.from_pretrained(model_dir)
    shape = WORKER["shape"]
    layer_config = transformers.Qwen3Config(  # what speculators' create_transformer_layer_config writes
        vocab_size=verifier.vocab_size, hidden_size=verifier.hidden_size, intermediate_size=verifier.intermediate_size,
        num_hidden_layers=shape["num_layers"], num_attention_heads=verifier.num_attention_heads,
        num_key_value_heads=verifier.num_key_value_heads, hidden_act=verifier.hidden_act,
        max_position_embeddings=verifier.max_position_embeddings, initializer_range=verifier.initializer_range,
        rms_norm_eps=verifier.rms_norm_eps, head_dim=getattr(verifier, "head_dim", None), tie_word_embeddings=False,
        # Full attention, non-causal in the block: what our drafter computes (its default sliding window of
        # 2,048 covers these 2,048-token rows; for DFlash it would also make blocks causal).
        layer_types=["full_attention"] * shape["num_layers"],
    )
    layer_config.rope_parameters = dict(verifier.rope_parameters)
    arguments = {**recipe, "verifier_name_or_path": model_dir, "draft_vocab_size": verifier.vocab_size,
                 "block_size": shape["block_size"], "num_layers": shape["num_layers"], "mask_token_id": mask_token_id,
                 "draft_attn_impl": SPECULATORS_ATTENTION[speculators_attention()]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_class.from_training_args(verifier_config=layer_config, **arguments)


def speculators_mask_token(tokenizer, vocab_size: int) -> tuple[int, str]:
    """speculators.train.utils.resolve_mask_token_id's choice and its rule (its module needs
    `datasets`, absent on the GPU image): the tokenizer's mask token; else, with a spare embedding row
    (`len(tokenizer) < vocab_size`), the <|MASK|> token it adds there; else pad/eos/unk, with a warning."""
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id, "tokenizer"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), "added"
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return getattr(tokenizer, name), f"fallback:{name}"
    raise ValueError("no mask token")


def stand_in_for_missing(names: tuple[str, ...] = ("openai", "datasets")) -> list[str]:
    """speculators' package __init__ imports its training-data modules, which import openai and datasets
    at module level; the DFlash model and loss used here never call them. Where they are missing (the
    GPU image), register empty stand-ins so `import speculators` works; returns the names stood in."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import types

    missing = [name for name in names if name not in sys.modules and importlib.util.find_spec(name) is None]
    if not missing:
        return []

    class Anything:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, *args, **kwargs):
            return Anything()

        def __getattr__(self, name):
            return Anything()

        def __class_getitem__(cls, item):
            return cls

    class StandIn(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in missing:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            return StandIn(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    sys.meta_path.append(Finder())
    return missing


def _mask_for(variant: Variant, config, *, target, corpus, tokenizer) -> tuple[int, str]:
    """The row's mask token and the rule that chose it (see Variant.mask)."""
    from dflash_core.train.drafter_setup import drafter_config_for

    mask, rule = speculators_mask_token(tokenizer, target.config.vocab_size)
    if rule.startswith("fallback") and variant.mask != "eos":
        ours = drafter_config_for(config, target_config=target.config, corpus=corpus, tokenizer=tokenizer)
        return ours.mask_token_id, f"{rule}->unused"
    return mask, rule


def run_speculators(job: Job, variant: Variant) -> dict:
    algorithm = SPECULATORS_KINDS[variant.kind]
    stood_in = stand_in_for_missing()
    if stood_in:
        print(f"speculators: stand-ins for its unused data-module imports {stood_in}", flush=True)
    from dflash_core.target import HiddenStateCapture
    from dflash_core.train.data import PackedBatchSampler, collate, samples_with_loss
    from dflash_core.train.drafter_setup import load_target_tokenizer
    from dflash_core.train.inputs import load_target_model
    from dflash_core.train.step import batch_tensors, capture_batch

    config = train_config(job, variant, Path(WORKER["work"]) / "runs")
    device = torch.device(WORKER["device"])
    corpus = corpus_for_worker(getattr(job, "data_multiplier", None))
    torch.manual_seed(job.seed)
    target = load_target_model("embedded", device=device, models_dir=Path(WORKER["models_dir"]), seed=job.seed)
    if device.type == "cuda":  # as the Trainer: packed documents masked from position ids
        target.set_attn_implementation("flex_attention")
    tokenizer = load_target_tokenizer("embedded", models_dir=Path(WORKER["models_dir"]))
    mask, mask_rule = _mask_for(variant, config, target=target, corpus=corpus, tokenizer=tokenizer)
    recipe = speculators_recipe(algorithm)
    torch.manual_seed(job.seed)
    attention = speculators_attention()
    model = speculators_model(algorithm, recipe, mask).to(device)
    model_class = type(model)
    # Its own loss and slot weights; the eager loss implementation (its fused Triton loss crashes under
    # torch.compile on torch 2.11) and the row's anchor count.
    step_kwargs, _ = model_class.get_trainer_kwargs(
        **{**recipe, "loss_implementation": "eager", "max_anchors": config.resolved_num_anchors})
    native_ids = [k - 1 for k in model.target_layer_ids]  # its aux id k = input of layer k = our k-1
    capture = HiddenStateCapture(target, layer_ids=native_ids, capture_final=True)
    params = [p for p in model.parameters() if p.requires_grad]
    o = config.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                  fused=device.type == "cuda")
    from dflash_core.train.optimizer import lr_factor

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup=o.resolved_warmup_steps(job.steps), total=job.steps,
                             min_ratio=o.min_lr_ratio))
    teaches = samples_with_loss(corpus, within=config.token_budget)  # the rule our trainer keeps samples by
    sampler = PackedBatchSampler(corpus.lengths, token_budget=config.token_budget, seed=job.seed,
                                 drop_samples_without_loss=~teaches, packing=config.packing)
    batches = iter(sampler)
    state_path = Path(WORKER["work"]) / "runs" / f"{config.run_name}.speculators.pt"
    first_step, trained = _resume(state_path, model=model, optimizer=optimizer, scheduler=scheduler, batches=batches)
    every = checkpoint_every(job)
    eager_forward = getattr(model_class.forward, "_torchdynamo_orig_callable", model_class.forward)
    forward = model_class.forward if WORKER["speculators_compile"] else eager_forward
    compiled = forward is not eager_forward
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, eals, marks = [], [], []
    log_every = max(1, min(25, job.steps // 4))
    sync_device()
    start = time.perf_counter()
    for step in range(first_step, job.steps):
        tensors = batch_tensors(collate(corpus, next(batches), token_budget=config.token_budget), device)
        captured = capture_batch(capture, tensors)
        torch.manual_seed(hash((job.seed, step)) & 0x7FFF_FFFF)  # its anchors come from the global RNG
        kwargs = dict(hidden_states=captured.tapped_hidden, input_ids=tensors["input_ids"],
                      loss_mask=tensors["loss_mask"].long(), verifier_last_hidden_states=captured.final_hidden,
                      document_ids=tensors["document_ids"], position_ids=tensors["position_ids"], **step_kwargs)
        with autocast:
            try:
                _, loss, metrics = forward(model, **kwargs)
            except Exception as error:  # its compiled forward on this torch: fall back to eager, say so
                if not compiled:
                    raise
                print(f"speculators: compiled forward failed ({type(error).__name__}: {error}); eager", flush=True)
                forward, compiled = eager_forward, False
                _, loss, metrics = forward(model, **kwargs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= job.steps - log_every:
            losses.append(loss.detach())
            eals.append(metrics["eal_sum"].detach() / metrics["eal_total"].clamp_min(1))
        if (step + 1) % log_every == 0 or step + 1 == job.steps:
            sync_device()
            marks.append((step + 1, time.perf_counter()))
        if (step + 1) % every == 0 and step + 1 < job.steps:
            _save(state_path, model=model, optimizer=optimizer, scheduler=scheduler, step=step + 1)
    sync_device()
    if trained is None:  # trained in this run (else a run stopped after training: its figures)
        train_s = time.perf_counter() - start
        trained = {"train_s": train_s, "steps_per_s": steady_rate(marks, job.steps - first_step, train_s),
                   "compiled": compiled, "resumed_from_step": first_step,
                   # a compiled forward that failed falls back to eager: flex then ran as torch's reference
                   "train_attention": "flex, uncompiled" if attention == "flex" and not compiled else attention,
                   "train_loss": float(torch.stack(losses).mean()), "train_tau": float(torch.stack(eals).mean())}
        if WORKER.get("checkpoint_every"):  # kept until the row is written: a run stopped in evaluation resumes here
            _save(state_path, model=model, optimizer=optimizer, scheduler=scheduler, step=job.steps, trained=trained)
    capture.close()
    drafter = ours_from_speculators(model, target_config=target.config, native_ids=native_ids, mask=mask,
                                    config=config, device=device)
    del target
    check_conversion(model, drafter, native_ids, device)
    if WORKER.get("save_drafters"):  # its own format, as speculators' users hand it to vLLM
        model.save_pretrained(Path(WORKER["save_drafters"]) / config.run_name)
    del model
    row = {**trained, "mask_token_id": mask, "mask_rule": mask_rule, "target_layer_ids": native_ids,
           **evaluate_drafter(drafter)}
    state_path.unlink(missing_ok=True)
    return row


def _save(path: Path, *, model, optimizer, scheduler, step: int, trained: dict | None = None) -> None:
    """The loop's state after `step` steps (the batches and anchors follow from the seed and the step); at the
    last step also the training's figures (`trained`), which a resumed run reports instead of training again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "trained": trained}, tmp)
    tmp.replace(path)  # a job killed mid-write keeps its previous state


def _resume(path: Path, *, model, optimizer, scheduler, batches) -> tuple[int, dict | None]:
    """With `--resume` and a saved state: load it, move the batches past the steps it covers, and return its
    step (the loop's next) and, for a state saved after the last step, the training's figures; else (0, None)."""
    if not WORKER.get("resume") or not path.is_file():
        return 0, None
    state = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for _ in range(state["step"]):
        next(batches)
    return state["step"], state.get("trained")


def ours_from_speculators(model, *, target_config, native_ids, mask, config, device):
    """Its weights in our drafter class (DFlash 2 with its conv and selector settings)."""
    from dflash_core.model import DFlashConfig, DFlashDraftModel
    from dflash_core.model.build import build_drafter
    from dflash_core.model.dflash2_config import DFLASH2_FIELDS, DFlash2Config

    ours = DFlashConfig.from_target(target_config, num_layers=config.drafter.num_layers,
                                    block_size=config.drafter.block_size, num_tapped_layers=len(native_ids),
                                    mask_token_id=mask)
    ours = dataclasses.replace(ours, target_layer_ids=native_ids)
    if hasattr(model, "candidate_selector"):
        theirs = {name: getattr(model.config, name) for name in DFLASH2_FIELDS if hasattr(model.config, name)}
        drafter = build_drafter(DFlash2Config.from_dflash(ours, **theirs), device=device)
    else:
        drafter = DFlashDraftModel(ours, device=device)
    body = {k: v for k, v in model.state_dict().items() if k.split(".")[0] in _BODY}
    drafter.load_state_dict(body, strict=True)
    return drafter


@torch.no_grad()
def check_conversion(model, drafter, native_ids, device) -> None:
    """speculators' logits on fixed anchors equal ours after the weight copy (as the parity tests), and
    for DFlash 2 its selector's candidate scores; both in fp32 on the fp32 evaluation target."""
    from dflash_core.model.anchors import BlockPlan
    from dflash_core.target import HiddenStateCapture, target_heads

    target = eval_target()
    if target.lm_head.weight.dtype != torch.float32:
        return
    model, drafter = model.float(), drafter.float()
    sample = torch.tensor(corpus_for_worker().sample(0)[0][:64].astype(np.int64), device=device)[None]
    length, block = sample.shape[1], drafter.config.block_size
    anchors = [4, 20, 36]
    captured = HiddenStateCapture(target, layer_ids=native_ids, capture_final=True)(sample)
    mask = torch.zeros(1, length, dtype=torch.long, device=device)
    mask[0, anchors] = 1  # exactly as many valid positions as anchors: no random choice
    model_eager = getattr(type(model)._backbone_forward, "_torchdynamo_orig_callable", type(model)._backbone_forward)
    hidden, theirs, _, _, block_index = model_eager(
        model, captured.tapped_hidden, sample, mask, captured.final_hidden,
        torch.zeros(1, length, dtype=torch.long, device=device), max_anchors=len(anchors))
    drafter.attach_target(target_heads(target))
    plan = BlockPlan.at_anchors(anchors, seq_len=length, block_size=block, device=device)
    output, _, _ = drafter(input_ids=sample, target_hidden=captured.tapped_hidden, plan=plan, attention_backend="sdpa")
    unary = getattr(drafter, "unary_logits", drafter.target_heads.lm_head)
    pairs = [("logits", theirs.view(len(anchors), block, -1)[:, 1:], unary(output.hidden_BAKH[0]))]
    if hasattr(model, "candidate_selector"):
        predecessors = model._predecessor_ids(sample, block_index).reshape(1, -1)
        candidates = theirs.topk(drafter.config.selector_top_k, dim=-1).indices
        selector = drafter.candidate_selector
        ours_scores = theirs.gather(-1, candidates) + selector.transition_scores(
            selector.context(hidden, predecessors), candidates)
        pairs.append(("selector scores", model.candidate_selector.score_candidates(
            theirs, hidden, predecessors, candidates), ours_scores))
    for what, a, b in pairs:
        error = (a.float() - b.float()).abs().max().item()
        if error > 1e-3 * max(b.abs().max().item(), 1.0):
            raise AssertionError(f"speculators -> ours weight copy changed the {what}: max error {error:.3g}")
