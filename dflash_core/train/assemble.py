"""A training run assembled from its config, in the order torchtitan's trainers take: build the parts
(`build_training`), then parallelize them (`dflash_core.train.parallelize`), then loop
(`dflash_core.train.loop.Trainer`). `build_trainer` does all three; tests and benchmarks call it
with a ready corpus."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_core.target.gdn_packing import GDNKernels, install_packed_gdn
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.model.init_from_target import init_from_target_layers, init_selector_codebooks
from dflash_core.target import HiddenStateCapture, has_recurrent_layers, language_model, target_heads
from dflash_core.target.runtime import use_flex_attention
from dflash_core.train.config import TrainConfig
from dflash_core.train.data import (
    PackedBatchSampler, TokenizedCorpus, ids_beyond_vocab, load_corpus, read_shard_table, usable_samples,
)
from dflash_core.train.devices import Distributed, TrainDevices, resolve_devices
from dflash_core.train.drafter_setup import drafter_config_for, load_target_tokenizer
from dflash_core.train.inputs import fetch_shards, load_target_model
from dflash_core.train.optimizer import build_optimizer
from dflash_core.train.parts import TrainingParts

if TYPE_CHECKING:
    from dflash_core.lineage import InputRef
    from dflash_core.lineage_refs import DigestCache
    from dflash_core.storage import ObjectStore
    from dflash_core.train.loop import Trainer


def build_training(config: TrainConfig, *, devices: TrainDevices, dist_info: Distributed,
                   store: ObjectStore | None = None, models_dir: Path = Path(".dflash/models"),
                   corpus: TokenizedCorpus | None = None,
                   digests: DigestCache | None = None) -> TrainingParts:
    """The run's parts. `corpus` given (benchmarks, tests) replaces reading `config.data`. The inputs the
    checkpoints' manifests name (rank 0, uploading to `store`): the shards read, then the target (its
    files by sha256, `digests` caching their hashes, or its spec and seed when it is built in code)."""
    torch.manual_seed(config.seed)
    inputs: list[InputRef] = []
    if corpus is None:
        shards = fetch_shards(config.data, store=store, cache_dir=config.run_dir.parent / ".cache",
                              allow_failed_quality_gate=config.allow_failed_quality_gate)
        inputs = [ref for _, ref in shards if ref is not None]
        corpus = load_corpus([(str(path), read_shard_table(path)) for path, _ in shards])
    usable = _usable_samples(corpus, token_budget=config.token_budget, log=dist_info.is_main)
    target = load_target_model(config.target, device=devices.target, models_dir=models_dir, seed=config.seed)
    _refuse_ids_beyond_vocab(corpus, target, spec=config.target)
    if store is not None and config.upload_checkpoints and dist_info.is_main:
        from dflash_core.lineage_refs import target_refs  # boto3 only where S3 is used

        inputs += target_refs(config.target, seed=config.seed, models_dir=models_dir, digests=digests)
    if devices.target.type == "cuda":
        # Packed documents: a BlockMask built from position ids skips the cross-document blocks.
        reason = use_flex_attention(target)
        if reason is not None:
            warnings.warn(f"target keeps its attention implementation ({reason}); packed rows cost more",
                          stacklevel=2)
    target_kernels, samples_per_batch = _packing_kernels(target, config, log=dist_info.is_main)
    sampler = PackedBatchSampler(corpus.lengths, token_budget=config.token_budget, seed=config.seed,
                                 rank=dist_info.rank, world_size=dist_info.world_size,
                                 drop_samples_without_loss=~usable,
                                 max_samples_per_batch=samples_per_batch, packing=config.packing)
    drafter_config = drafter_config_for(config, target_config=target.config, corpus=corpus,
                                        tokenizer=load_target_tokenizer(config.target, models_dir=models_dir))
    drafter = _build_drafter(drafter_config, target, config=config, devices=devices)
    if config.drafter_fp8:  # before compiling (parallelize) and before the optimizer takes its parameters
        convert_drafter(drafter, recipe=config.drafter_fp8_recipe, log=dist_info.is_main)
    if config.target_fp8:  # after the drafter copied what it needs (heads, init layers) from the target
        quantize_target(target, device=devices.target, log=dist_info.is_main,
                        fast_accum=config.target_fp8_fast_accum)
    if config.lm_head_fp8:  # after target_fp8 freed the target's bf16 layers: the head's copies are made here
        use_fp8_lm_head(drafter, device=devices.drafter, log=dist_info.is_main)
    capture = HiddenStateCapture(target, layer_ids=drafter_config.target_layer_ids,
                                 capture_final=config.drafter.loss_target == "teacher")
    optimizer, scheduler = build_optimizer(drafter, config, device=devices.drafter)
    return TrainingParts(config=config, devices=devices, corpus=corpus, sampler=sampler, target=target,
                         target_kernels=target_kernels, capture=capture, drafter_config=drafter_config,
                         drafter=drafter, optimizer=optimizer, scheduler=scheduler, inputs=inputs)


def build_trainer(config: TrainConfig, *, store: ObjectStore | None = None, models_dir: Path = Path(".dflash/models"),
                  dist_info: Distributed | None = None, devices: TrainDevices | None = None,
                  corpus: TokenizedCorpus | None = None, digests: DigestCache | None = None,
                  **loop_options: Any) -> Trainer:
    """Build, parallelize, and return the loop over them. `loop_options` are `Trainer`'s (checkpoint
    prefix, flow run id, S3 outage limit, lease, the bucket's prefixes)."""
    from dflash_core.train.loop import Trainer
    from dflash_core.train.parallelize import parallelize

    config = config.resolved()
    dist_info = dist_info or Distributed.from_env()
    devices = devices or resolve_devices(config, dist_info)
    parts = build_training(config, devices=devices, dist_info=dist_info, store=store, models_dir=models_dir,
                           corpus=corpus, digests=digests)
    model = parallelize(parts, world_size=dist_info.world_size)
    return Trainer(parts, model, store=store, dist_info=dist_info, **loop_options)


def _usable_samples(corpus: TokenizedCorpus, *, token_budget: int, log: bool):
    """Which samples teach anything within a packed row; rank 0 says which it leaves out and why, and data with
    none left is refused (`UnusableData`, which the flow does not retry) before the target loads."""
    from dflash_core.data.verdict import UnusableData

    usable, left_out = usable_samples(corpus, token_budget=token_budget)
    message = left_out.message()
    if not left_out.kept:
        raise UnusableData(message or "the training data holds no samples")
    if message and log:
        print(f"warning: {message}", file=sys.stderr, flush=True)
    return usable


def _refuse_ids_beyond_vocab(corpus: TokenizedCorpus, target: torch.nn.Module, *, spec: str) -> None:
    """Shards tokenized for another target (ids its embedding lacks) are refused by name before the first step
    (`UnusableData`, which the flow does not retry), rather than failing it with the embedding's IndexError."""
    from dflash_core.data.verdict import UnusableData

    vocab_size = language_model(target).embed_tokens.num_embeddings
    beyond = ids_beyond_vocab(corpus, vocab_size=vocab_size)
    if beyond:
        shards = "; ".join(f"{name}: token ids up to {largest}" for name, largest in beyond)
        raise UnusableData(f"training data refused: {shards}, but the target {spec} has a vocabulary of {vocab_size} "
                           f"(ids 0..{vocab_size - 1}): tokenize it with the target's tokenizer (the tokenize stage "
                           f"with this target) and train on that")


def quantize_target(target: torch.nn.Module, *, device: torch.device, log: bool,
                    fast_accum: bool = False) -> None:
    """The target's decoder-layer GEMMs to FP8, or a ValueError saying why this device cannot."""
    from dflash_core.fp8.target import supports_fp8
    from dflash_core.target.runtime import quantize_decoder_layers_fp8

    why = supports_fp8(device)
    if why is not None:
        raise ValueError(f"target_fp8: {why}; set target_fp8: false to keep the target in its own dtype")
    quantized, kept = quantize_decoder_layers_fp8(target, fast_accum=fast_accum)
    if log:
        print(f"target GEMMs: fp8 ({quantized} linears; {kept} kept in their dtype: unaligned or narrow)",
              file=sys.stderr, flush=True)


def use_fp8_lm_head(drafter: torch.nn.Module, *, device: torch.device, log: bool) -> None:
    """The drafter loss's LM-head GEMMs to FP8 (dflash_core.model.lm_head_fp8.Fp8LMHead), or a ValueError saying why this
    device cannot."""
    from dflash_core.fp8.target import supports_fp8

    why = supports_fp8(device)
    if why is not None:
        raise ValueError(f"lm_head_fp8: {why}; set lm_head_fp8: false to keep the loss's LM-head GEMMs in bf16")
    drafter.use_fp8_lm_head()
    if log:
        vocab, width = drafter.target_heads.lm_head.weight.shape
        print(f"loss LM-head GEMMs: fp8 ([{vocab}, {width}] head, copies {2 * vocab * width / 2**30:.2f} GiB)",
              file=sys.stderr, flush=True)


def convert_drafter(drafter: torch.nn.Module, *, recipe: str, log: bool) -> None:
    """The drafter's own linears to torchao float8 training (dflash_core.fp8.drafter), or a ValueError
    saying why this device or installation cannot."""
    from dflash_core.fp8.drafter import convert_drafter_linears

    converted, kept = convert_drafter_linears(drafter, recipe=recipe)
    if log:
        print(f"drafter GEMMs: fp8 {recipe} ({converted} linears; {kept} kept in bf16: unaligned or narrow)",
              file=sys.stderr, flush=True)


def _packing_kernels(target: torch.nn.Module, config: TrainConfig, *, log: bool) -> tuple[GDNKernels | None, int | None]:
    """(the packed GDN kernels, samples per row): a hybrid target packs exactly when dflash_core.target.gdn_packing
    can restart its GDN layers per document, else packing is off."""
    samples_per_batch = config.max_samples_per_batch
    if not has_recurrent_layers(target.config):
        return None, samples_per_batch
    kernels = install_packed_gdn(target)
    if kernels is None and samples_per_batch != 1:
        warnings.warn("the target has recurrent (linear-attention) layers this trainer cannot restart per "
                      "document: packing is off (max_samples_per_batch=1)", stacklevel=3)
        samples_per_batch = 1
    if kernels is not None and log:
        print(f"target kernels: {kernels}", file=sys.stderr, flush=True)
    return kernels, samples_per_batch


def _build_drafter(drafter_config: DFlashConfig, target: torch.nn.Module, *, config: TrainConfig,
                   devices: TrainDevices) -> torch.nn.Module:
    """The drafter, initialized from the run's seed (and the target's last layers with init=target, the
    selector's codebooks from the target embedding with selector_codebook_init=embedding), with the target's
    embedding, final norm and LM head attached (own frozen copies in the pair layout)."""
    torch.manual_seed(config.seed)
    drafter = build_drafter(drafter_config, device=devices.drafter, loss=config.drafter.loss_spec())
    drafter.init_weights()
    if config.drafter.init == "target":
        init_from_target_layers(drafter, language_model(target).layers)
    heads = target_heads(target)
    if devices.drafter != devices.target:
        heads = type(heads)(**{name: copy.deepcopy(module).to(devices.drafter) for name, module in vars(heads).items()})
    drafter.attach_target(heads)
    if config.drafter.selector_codebook_init == "embedding":
        init_selector_codebooks(drafter.candidate_selector, heads.embed_tokens.weight,
                                std=drafter_config.initializer_range)
    return drafter
