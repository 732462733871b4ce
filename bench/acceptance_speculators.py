"""bench_acceptance's speculators side: speculators 0.9's DFlashDraftModel built as its trainer builds
it, trained in a loop of the same shape as our Trainer (same packed batches, captured target states,
AdamW, clipping and schedule) through its own forward, then copied into our drafter class (logits
checked equal) for the same evaluator."""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from acceptance_worker import (
    WORKER, corpus_for_worker, eval_target, evaluate_drafter, steady_rate, sync_device, train_config,
)

if TYPE_CHECKING:
    from bench_acceptance import Job, Variant

def speculators_model(variant: Variant, mask_token_id: int):
    """speculators' DFlashDraftModel built as its trainer builds it (from_training_args)."""
    import transformers
    from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash

    model_dir = str(WORKER["model_dir"])
    verifier = transformers.AutoConfig.from_pretrained(model_dir)
    shape = WORKER["shape"]
    layer_config = transformers.Qwen3Config(  # what speculators' create_transformer_layer_config writes
        vocab_size=verifier.vocab_size, hidden_size=verifier.hidden_size, intermediate_size=verifier.intermediate_size,
        num_hidden_layers=shape["num_layers"], num_attention_heads=verifier.num_attention_heads,
        num_key_value_heads=verifier.num_key_value_heads, hidden_act=verifier.hidden_act,
        max_position_embeddings=verifier.max_position_embeddings, initializer_range=verifier.initializer_range,
        rms_norm_eps=verifier.rms_norm_eps, head_dim=getattr(verifier, "head_dim", None), tie_word_embeddings=False,
        layer_types=["full_attention"] * shape["num_layers"],
    )
    layer_config.rope_parameters = dict(verifier.rope_parameters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SpeculatorsDFlash.from_training_args(
            verifier_config=layer_config, draft_vocab_size=verifier.vocab_size, block_size=shape["block_size"],
            verifier_name_or_path=model_dir, mask_token_id=mask_token_id, draft_attn_impl="sdpa")
    return model


def speculators_default_mask(tokenizer, vocab_size: int) -> int:
    """speculators.train.utils.resolve_mask_token_id's order (its module needs `datasets`, absent on
    the GPU image): the tokenizer's mask token, a new token in a spare row, else pad/eos/unk."""
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return getattr(tokenizer, name)
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


def run_speculators(job: Job, variant: Variant) -> dict:
    if variant.train:  # this loop builds its own target and batches: it would silently ignore them
        raise ValueError(f"variant {variant.name!r}: speculators rows take no TrainConfig changes ({variant.train})")
    stood_in = stand_in_for_missing()
    if stood_in:
        print(f"speculators: stand-ins for its unused data-module imports {stood_in}", flush=True)
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash

    from dflash_core.model import DFlashConfig, DFlashDraftModel
    from dflash_core.target import HiddenStateCapture
    from dflash_core.train.data import PackedBatchSampler, collate, samples_with_loss
    from dflash_core.train.inputs import load_target_model
    from dflash_core.train.drafter_setup import drafter_config_for, load_target_tokenizer
    from dflash_core.train.loop import lr_factor
    from dflash_core.train.step import batch_tensors, capture_batch

    config = train_config(job, variant, Path(WORKER["work"]) / "runs")
    device = torch.device(WORKER["device"])
    corpus = corpus_for_worker()
    torch.manual_seed(job.seed)
    target = load_target_model("embedded", device=device, models_dir=Path(WORKER["models_dir"]), seed=job.seed)
    if device.type == "cuda":  # as the Trainer: packed documents masked from position ids
        target.set_attn_implementation("flex_attention")
    tokenizer = load_target_tokenizer("embedded", models_dir=Path(WORKER["models_dir"]))
    if variant.drafter.get("mask_token_id") == "ours":
        mask = drafter_config_for(config, target_config=target.config, corpus=corpus,
                                  tokenizer=tokenizer).mask_token_id
    else:
        mask = speculators_default_mask(tokenizer, target.config.vocab_size)
    torch.manual_seed(job.seed)
    model = speculators_model(variant, mask).to(device)
    native_ids = [k - 1 for k in model.target_layer_ids]  # its aux id k = input of layer k = our k-1
    capture = HiddenStateCapture(target, layer_ids=native_ids, capture_final=True)
    params = [p for p in model.parameters() if p.requires_grad]
    o = config.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup=o.warmup_steps, total=job.steps, min_ratio=o.min_lr_ratio))
    sampler = PackedBatchSampler(corpus.lengths, token_budget=config.token_budget, seed=job.seed,
                                 drop_samples_without_loss=~samples_with_loss(corpus), packing=config.packing)
    batches = iter(sampler)
    loss_config = resolve_loss_config("ce", "eager")  # its fused Triton loss crashes under torch.compile (2.11)
    eager_forward = getattr(SpeculatorsDFlash.forward, "_torchdynamo_orig_callable", SpeculatorsDFlash.forward)
    forward = SpeculatorsDFlash.forward if WORKER["speculators_compile"] else eager_forward
    compiled = forward is not eager_forward
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, eals, marks = [], [], []
    log_every = max(1, min(25, job.steps // 4))
    sync_device()
    start = time.perf_counter()
    for step in range(job.steps):
        tensors = batch_tensors(collate(corpus, next(batches), token_budget=config.token_budget), device)
        captured = capture_batch(capture, tensors)
        torch.manual_seed(hash((job.seed, step)) & 0x7FFF_FFFF)  # its anchors come from the global RNG
        kwargs = dict(hidden_states=captured.tapped_hidden, input_ids=tensors["input_ids"],
                      loss_mask=tensors["loss_mask"].long(), verifier_last_hidden_states=captured.final_hidden,
                      document_ids=tensors["document_ids"], position_ids=tensors["position_ids"],
                      loss_config=loss_config, max_anchors=config.resolved_num_anchors,
                      per_position_loss_weight="dpace", dpace_alpha=0.5)
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
    sync_device()
    train_s = time.perf_counter() - start
    capture.close()

    # Its weights in our drafter class, for the same evaluator; the logits must agree.
    ours_config = DFlashConfig.from_target(target.config, num_layers=config.drafter.num_layers,
                                           block_size=config.drafter.block_size, num_tapped_layers=len(native_ids),
                                           mask_token_id=mask)
    ours_config = dataclasses.replace(ours_config, target_layer_ids=native_ids)
    drafter = DFlashDraftModel(ours_config, device=device)
    body = {k: v for k, v in model.state_dict().items() if k.split(".")[0] in ("fc", "hidden_norm", "layers", "norm")}
    drafter.load_state_dict(body, strict=True)
    del target
    check_conversion(model, drafter, native_ids, device)
    del model
    return {"train_s": train_s, "steps_per_s": steady_rate(marks, job.steps, train_s), "compiled": compiled,
            "train_loss": float(torch.stack(losses).mean()), "train_tau": float(torch.stack(eals).mean()),
            "mask_token_id": mask, "target_layer_ids": native_ids, **evaluate_drafter(drafter)}


@torch.no_grad()
def check_conversion(model, drafter, native_ids, device) -> None:
    """speculators' logits on fixed anchors equal ours after the weight copy (as the parity test),
    both in fp32 on the fp32 evaluation target."""
    from dflash_core.model.anchors import BlockPlan
    from dflash_core.target import HiddenStateCapture, target_heads

    target = eval_target()
    if target.lm_head.weight.dtype != torch.float32:
        return
    sample = torch.tensor(corpus_for_worker().sample(0)[0][:64].astype(np.int64), device=device)[None]
    length, block = sample.shape[1], drafter.config.block_size
    anchors = [4, 20, 36]
    captured = HiddenStateCapture(target, layer_ids=native_ids, capture_final=True)(sample)
    mask = torch.zeros(1, length, dtype=torch.long, device=device)
    mask[0, anchors] = 1
    model_eager = getattr(type(model)._backbone_forward, "_torchdynamo_orig_callable", type(model)._backbone_forward)
    _, theirs, *_ = model_eager(model, captured.tapped_hidden, sample, mask, captured.final_hidden,
                                torch.zeros(1, length, dtype=torch.long, device=device), max_anchors=len(anchors))
    theirs = theirs.view(len(anchors), block, -1)[:, 1:]
    drafter.attach_target(target_heads(target))
    plan = BlockPlan.at_anchors(anchors, seq_len=length, block_size=block, device=device)
    output, _, _ = drafter(input_ids=sample, target_hidden=captured.tapped_hidden, plan=plan, attention_backend="sdpa")
    ours = drafter.target_heads.lm_head(output.hidden_BAKH[0])
    error = (theirs.float() - ours.float()).abs().max().item()
    if error > 1e-3 * max(ours.abs().max().item(), 1.0):
        raise AssertionError(f"speculators -> ours weight copy changed the logits: max error {error:.3g}")
