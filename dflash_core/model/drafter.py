"""The DFlash drafter: fused target features -> decoder layers with KV injection -> target LM head.

It owns no embedding and no LM head: `attach_target(TargetHeads(...))` lends it the target's
frozen embed_tokens, final norm and lm_head. They are held outside the module tree, so they are
neither parameters of the drafter nor part of its state_dict.

Training: `forward(input_ids=, target_hidden=, plan=, teacher_hidden=)` -> (output, loss, metrics).
Drafting: `new_cache()` (or `new_static_cache(capacity=)` for CUDA graphs), `extend_context(...)`,
`draft_block(...)`, `cache.crop(n)`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dflash_core.model.anchors import BlockPlan
from dflash_core.model.attention import AttendFn, DFlashDecoderLayer, RMSNorm, RotaryEmbedding
from dflash_core.model.config import SLIDING_ATTENTION, DFlashConfig
from dflash_core.model.context_cache import ContextCache, StaticContextCache
from dflash_core.model.lm_head_fp8 import Fp8LMHead
from dflash_core.model.loss import chunked_lm_head_loss, default_chunk_size
from dflash_core.model.loss import position_weights
from dflash_core.model.loss import teacher_token_ids
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.masks import (
    create_flex_block_mask, dense_mask, flex_attend, resolve_attention_backend, sdpa_attend, tuned_flex_options,
)
from dflash_core.model.regularize import dropout_masks, noisy_features
from dflash_core.model.metrics import block_metrics


@dataclasses.dataclass
class TargetHeads:
    """The target's frozen modules the drafter borrows."""

    embed_tokens: nn.Module
    final_norm: nn.Module
    lm_head: nn.Module


@dataclasses.dataclass
class DraftOutput:
    """hidden_BAKH: drafter states of slots 1..B-1 (after its final norm); labels_BAK: their targets."""

    hidden_BAKH: torch.Tensor
    labels_BAK: torch.Tensor


class DFlashDraftModel(nn.Module):
    layer_class = DFlashDecoderLayer  # a variant (DFlash 2) swaps in its own layer
    has_selector = False  # DFlash 2 reranks the LM head's top-K with a candidate selector

    def __init__(self, config: DFlashConfig, *, device=None, loss: LossSpec | None = None) -> None:
        super().__init__()
        self.config = config
        self.loss = loss or LossSpec()  # how it trains; `config` is what it is
        if self.loss.dpace_source == "selector" and not self.has_selector:
            raise ValueError("dpace_source 'selector' weighs slots by the candidate selector's probability: DFlash 2 "
                             "only (variant dflash2); DFlash has no selector, use dpace_source 'unary'")
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_tapped_layers * hidden, hidden, bias=False, device=device)
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps, device=device)
        self.layers = nn.ModuleList(
            self.layer_class(config, layer_type=layer_type, device=device) for layer_type in config.layer_types
        )
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps, device=device)
        self.rotary_emb = RotaryEmbedding(rotary_dim=config.rotary_dim, theta=config.rope_theta, device=device)
        self.register_buffer("slot_weights", self._position_weights(device), persistent=False)
        self._target: tuple[TargetHeads] | None = None  # a tuple keeps nn.Module from registering it
        self._layers_compiled = False
        if device is None or torch.device(device).type != "meta":
            self.init_weights()

    # -- setup ------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """Initialize in place (also after `to_empty` from the meta device)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.rotary_emb.reset_buffers()
        self.slot_weights = self._position_weights(self.slot_weights.device)

    def _position_weights(self, device) -> torch.Tensor:
        """The exp-decay slot weights of the loss; empty when the block size has no default gamma and the
        loss spec names none (a drafter that only drafts needs none; training with them says so)."""
        block = self.config.block_size
        gamma = self.loss.gamma_or_none(block)
        if gamma is None:
            return torch.empty(0, device=device)
        return position_weights(block_size=block, gamma=gamma, device=device)

    def exp_decay_weights(self) -> torch.Tensor:
        """[block_size - 1] weights of the drafted slots (slot 0, the anchor, is given)."""
        if not self.slot_weights.numel():
            self.loss.gamma(self.config.block_size)  # raises: no default gamma for this block size
        return self.slot_weights[1:]

    def attach_target(self, heads: TargetHeads) -> None:
        """Borrow the target's embedding, final norm and LM head, frozen."""
        for module in (heads.embed_tokens, heads.final_norm, heads.lm_head):
            module.requires_grad_(False)
        rows = heads.embed_tokens.weight.shape[0]
        if rows <= self.config.mask_token_id:
            raise ValueError(f"mask_token_id {self.config.mask_token_id} is not a row of the {rows}-row embedding")
        self._target = (heads,)

    def use_fp8_lm_head(self) -> None:
        """From now on the loss's two GEMMs against the LM head run in FP8 (`TrainConfig.lm_head_fp8`;
        `dflash_core.model.lm_head_fp8.Fp8LMHead`). Everything else that reads the head keeps its bf16 weight."""
        heads = self.target_heads
        if isinstance(heads.lm_head, Fp8LMHead):
            return
        if getattr(heads.lm_head, "bias", None) is not None:
            raise ValueError("lm_head_fp8: the target's LM head has a bias, which the FP8 head does not carry; set "
                             "lm_head_fp8: false")
        self.attach_target(dataclasses.replace(heads, lm_head=Fp8LMHead(heads.lm_head.weight)))

    def fp8_lm_head(self) -> Fp8LMHead | None:
        head = self.target_heads.lm_head
        return head if isinstance(head, Fp8LMHead) else None

    @property
    def target_heads(self) -> TargetHeads:
        if self._target is None:
            raise ValueError("attach_target(TargetHeads(...)) first: the drafter borrows the target's heads")
        return self._target[0]

    def compile_layers(self, **compile_kwargs) -> None:
        """torch.compile each decoder layer (flex_attention then compiles inside the layer), the
        context K/V projection and the per-chunk loss kernels (DFlash's and DFlash 2's). Training shapes are static, so the
        default is dynamic=False: automatic dynamic shapes (after a second shape) gave a 2x slower
        flex_attention backward on an H200."""
        compile_kwargs.setdefault("dynamic", False)
        for layer in self.layers:
            layer.compile(**compile_kwargs)
            layer.self_attn.key_value = torch.compile(layer.self_attn.key_value, **compile_kwargs)
        self._layers_compiled = True  # the loss then calls its compiled per-chunk kernels

    def uncompile_layers(self) -> None:
        """Back to eager after training with compile_layers: decoding's varying shapes (and an evaluator that
        captures its own CUDA graphs) must not go through the training step's fixed-shape compiled layers."""
        for layer in self.layers:
            layer._compiled_call_impl = None  # what nn.Module.compile set
            layer.self_attn.__dict__.pop("key_value", None)  # the method again
        self._layers_compiled = False

    # -- shared pieces ----------------------------------------------------------------------
    def fuse_target_features(self, target_hidden_BTX: torch.Tensor) -> torch.Tensor:
        """[B, T, L*H] concatenated tapped states -> [B, T, H] context features."""
        expected = self.fc.in_features
        if target_hidden_BTX.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has {target_hidden_BTX.shape[-1]} features, expected "
                f"{self.config.num_tapped_layers} layers x {self.config.hidden_size} = {expected}"
            )
        return self.hidden_norm(self.fc(target_hidden_BTX))

    def _embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.target_heads.embed_tokens(block_ids)

    def _run_layers(self, block_BQH, *, block_rope, context_kv_per_layer, attend_by_type,
                    branch_masks_per_layer=None) -> torch.Tensor:
        hidden = block_BQH
        for index, (layer, context_kv) in enumerate(zip(self.layers, context_kv_per_layer)):
            extra = {} if branch_masks_per_layer is None else {"branch_masks": branch_masks_per_layer[index]}
            hidden = layer(
                hidden, block_rope=block_rope, context_kv=context_kv, attend=attend_by_type[layer.layer_type], **extra
            )
        return self.norm(hidden)

    # -- training ---------------------------------------------------------------------------
    def _training_attend_fns(self, plan: BlockPlan, backend: str) -> dict[str, AttendFn]:
        backend = resolve_attention_backend(backend, cuda=plan.anchors.is_cuda)
        windows = {layer_type: None for layer_type in self.config.layer_types}
        if SLIDING_ATTENTION in windows:
            windows[SLIDING_ATTENTION] = self.config.sliding_window
        attend = {}
        for layer_type, window in windows.items():
            if backend == "sdpa":
                attend[layer_type] = sdpa_attend(dense_mask(plan, sliding_window=window))
            else:
                block_mask = create_flex_block_mask(plan, sliding_window=window, compile_mask=plan.anchors.is_cuda)
                compiled = plan.anchors.is_cuda and not self._layers_compiled
                options = tuned_flex_options(self.config.head_dim, plan.anchors.device)
                attend[layer_type] = flex_attend(block_mask, compiled=compiled, kernel_options=options)
        return attend

    def _labels(self, *, input_ids_BT, plan, teacher_hidden_BTH) -> torch.Tensor:
        batch, seq_len = input_ids_BT.shape
        label_pos = plan.label_positions()
        rows = torch.arange(batch, device=input_ids_BT.device)[:, None, None]
        if teacher_hidden_BTH is None:
            labels = input_ids_BT[rows, label_pos]
        else:
            heads = self.target_heads
            # The target's prediction of token p+k is its argmax at p+k-1.
            source_flat = (rows * seq_len + label_pos - 1).flatten()
            if plan.teacher_index is None:  # per slot: repeats positions that blocks share
                ids = teacher_token_ids(
                    teacher_hidden_BTH, index_flat=source_flat, final_norm=heads.final_norm, lm_head=heads.lm_head
                )
                labels = ids.view_as(label_pos)
            else:  # each needed position once, then spread to the slots
                ids = teacher_token_ids(
                    teacher_hidden_BTH, index_flat=plan.teacher_index, final_norm=heads.final_norm,
                    lm_head=heads.lm_head,
                )
                by_position = torch.zeros(batch * seq_len, dtype=torch.long, device=ids.device)
                by_position[plan.teacher_index] = ids
                labels = by_position[source_flat].view_as(label_pos)
        return torch.where(plan.label_valid, labels, torch.zeros_like(labels))

    def _block_states(
        self, *, input_ids: torch.Tensor, target_hidden: torch.Tensor, plan: BlockPlan, attention_backend: str,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Drafter states of every slot of every planned block: [B, A, block_size, H] (after the final norm).
        In training mode the loss spec's feature noise and dropout apply, drawn from `generator`."""
        cfg = self.config
        batch, seq_len = input_ids.shape
        block = cfg.block_size
        if plan.block_size != block:
            raise ValueError(f"plan block_size {plan.block_size} != drafter block_size {block}")
        if target_hidden.shape[:2] != (batch, seq_len):
            raise ValueError(f"target_hidden {tuple(target_hidden.shape)} does not match input_ids {tuple(input_ids.shape)}")
        num_anchors = plan.num_anchors
        regularize = self.training
        if regularize and self.loss.feature_noise > 0:
            target_hidden = noisy_features(target_hidden, num_layers=cfg.num_tapped_layers, scale=self.loss.feature_noise,
                                           generator=generator)
        context = self.fuse_target_features(target_hidden)

        block_ids = torch.full((batch, num_anchors, block), cfg.mask_token_id, device=input_ids.device)
        block_ids[..., 0] = input_ids.gather(1, plan.anchors)
        block_hidden = self._embed_block(block_ids).view(batch, num_anchors * block, -1)
        anchor_pos = plan.position_ids.gather(1, plan.anchors)
        block_pos = (anchor_pos[..., None] + torch.arange(block, device=input_ids.device)).view(batch, -1)
        context_rope = self.rotary_emb(plan.position_ids)
        context_kv = [layer.self_attn.key_value(context, context_rope) for layer in self.layers]
        masks = None
        if regularize and self.loss.dropout > 0:
            masks = dropout_masks(shape=tuple(block_hidden.shape), rate=self.loss.dropout, num_layers=len(self.layers),
                                  generator=generator, device=block_hidden.device)
        hidden = self._run_layers(
            block_hidden,
            block_rope=self.rotary_emb(block_pos),
            context_kv_per_layer=context_kv,
            attend_by_type=self._training_attend_fns(plan, attention_backend),
            branch_masks_per_layer=masks,
        )
        return hidden.view(batch, num_anchors, block, -1)

    def forward(
        self,
        *,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        plan: BlockPlan,
        teacher_hidden: torch.Tensor | None = None,
        attention_backend: str = "auto",
        loss_chunk_size: int | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[DraftOutput, torch.Tensor, dict[str, torch.Tensor]]:
        """One training pass over the plan's blocks.

        input_ids [B, T]; target_hidden [B, T, L*H] (tapped layers, concatenated in
        target_layer_ids order); teacher_hidden [B, T, H]: the target's last layer output before
        its final norm, to learn the target's argmax (loss_type "ce") or distribution ("kl");
        None learns the data tokens. `generator` (on the drafter's device; None: torch's default)
        draws the feature noise and dropout, which apply only in training mode.
        """
        cfg = self.config
        block = cfg.block_size
        drafted = self._block_states(
            input_ids=input_ids, target_hidden=target_hidden, plan=plan, attention_backend=attention_backend,
            generator=generator,
        )[:, :, 1:]

        valid = plan.label_valid
        kl = self._loss_is_kl(teacher_hidden)
        dpace = self.loss.loss_weighting == "dpace"
        lm_head_weight = self.target_heads.lm_head.weight
        out = chunked_lm_head_loss(
            drafted.reshape(-1, drafted.shape[-1]),
            lm_head_weight=lm_head_weight,
            valid_N=valid.flatten(),
            labels_N=None if kl else self._labels(input_ids_BT=input_ids, plan=plan,
                                                  teacher_hidden_BTH=teacher_hidden).flatten(),
            teacher_hidden_NH=self._teacher_rows(teacher_hidden_BTH=teacher_hidden, plan=plan) if kl else None,
            token_weights_N=None if dpace else self.exp_decay_weights().expand_as(valid).flatten(),
            dpace_alpha=self.loss.dpace_alpha if dpace else None,
            num_slots=block - 1,
            chunk_size=loss_chunk_size or default_chunk_size(vocab_size=lm_head_weight.shape[0]),
            label_smoothing=self.loss.label_smoothing,
            compiled=self._layers_compiled,
            fp8_head=self.fp8_lm_head(),
        )
        labels = torch.where(valid, out.labels.view_as(valid), torch.zeros_like(valid, dtype=torch.long))
        metrics = block_metrics(
            correct_BAK=out.correct.view_as(valid), valid_BAK=valid, anchor_valid_BA=plan.anchor_valid
        )
        metrics["loss"] = out.loss.detach()
        return DraftOutput(hidden_BAKH=drafted, labels_BAK=labels), out.loss, metrics

    def _loss_is_kl(self, teacher_hidden: torch.Tensor | None) -> bool:
        if self.loss.loss_type == "kl" and teacher_hidden is None:
            raise ValueError("loss_type 'kl' learns the target's distribution: it needs teacher_hidden "
                             "(loss_target 'teacher'), not the data tokens")
        return self.loss.loss_type == "kl"

    def _teacher_rows(self, *, teacher_hidden_BTH: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
        """[B*A*K, H]: per drafted slot, the target's final-normed state at the position before its label
        (whose logits predict it), in the target's dtype; the loss turns them into logits a chunk at a time."""
        batch, seq_len = teacher_hidden_BTH.shape[:2]
        label_pos = plan.label_positions()
        rows = torch.arange(batch, device=label_pos.device)[:, None, None]
        flat = teacher_hidden_BTH.reshape(-1, teacher_hidden_BTH.shape[-1])
        with torch.no_grad(), torch.autocast(flat.device.type, enabled=False):
            return self.target_heads.final_norm(flat.index_select(0, (rows * seq_len + label_pos - 1).flatten()))

    # -- drafting ---------------------------------------------------------------------------
    def new_cache(self) -> ContextCache:
        return ContextCache(keys=[], values=[])

    def new_static_cache(self, *, capacity: int, dtype=None) -> StaticContextCache:
        """A fixed-shape context cache for CUDA-graph decoding (see StaticContextCache)."""
        cfg = self.config
        weight = self.fc.weight
        return StaticContextCache(num_layers=len(self.layers), num_kv_heads=cfg.num_key_value_heads,
                                  head_dim=cfg.head_dim, capacity=capacity, dtype=dtype or weight.dtype,
                                  device=weight.device)

    @torch.no_grad()
    def extend_context(
        self, cache: ContextCache | StaticContextCache, *, target_hidden: torch.Tensor, position_ids: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Append target features [B, n, L*H] at positions [B, n] (verified tokens) to the cache; a
        static cache may `keep` only the first rows (a device tensor), the rest are overwritten later."""
        context = self.fuse_target_features(target_hidden)
        rope = self.rotary_emb(position_ids)
        cache.append([layer.self_attn.key_value(context, rope) for layer in self.layers], keep=keep)

    @torch.no_grad()
    def draft_block(
        self, cache: ContextCache, *, last_token_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Logits [B, block_size-1, V] for the tokens after `last_token_ids` [B] (the last accepted
        token, at positions `position_ids` [B]), in one forward pass over the cached context.

        Each row's context must be the target features of every position before its last token;
        greedy drafts are `.argmax(-1)`.
        """
        if cache.is_empty:
            raise ValueError("the context cache is empty: extend_context with the prompt's target features first")
        cfg = self.config
        block = cfg.block_size
        block_ids = torch.full((last_token_ids.shape[0], block), cfg.mask_token_id, device=last_token_ids.device)
        block_ids[:, 0] = last_token_ids
        block_pos = position_ids[:, None] + torch.arange(block, device=last_token_ids.device)
        attend_by_type = {}
        for layer_type in set(cfg.layer_types):
            window = cfg.sliding_window if layer_type == SLIDING_ATTENTION else None
            attend_by_type[layer_type] = sdpa_attend(cache.drafting_mask(block_size=block, sliding_window=window))
        hidden = self._run_layers(
            self._embed_block(block_ids),
            block_rope=self.rotary_emb(block_pos),
            context_kv_per_layer=list(zip(cache.keys, cache.values)),
            attend_by_type=attend_by_type,
        )
        return self.target_heads.lm_head(hidden[:, 1:])
