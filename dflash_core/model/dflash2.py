"""DFlash 2: our drafter plus a grouped dynamic causal convolution around every sublayer and a
low-rank candidate selector over the unary (LM-head) top-K.

    config = DFlash2Config.from_target(target_config, num_layers=5, block_size=8, conv_kernel_size=2)
    drafter = build_drafter(config)   # dflash_core.model.build: a DFlash2DraftModel, a DFlashDraftModel subclass
    _, loss, metrics = drafter(input_ids=..., target_hidden=..., plan=..., teacher_hidden=...)
    tokens = drafter.draft_tokens(cache, last_token_ids=..., position_ids=...)   # the selector path

Convolution (per layer, around attention and around the MLP): output slot t is
sum_j (base[j] + delta_t[j, group]) * x[t - j], j < kernel_size. `base` is a static per-channel
kernel; `delta_t` is one value per channel group, projected from the sublayer's (normed) input at
slot t. One projection feeds both taps: the pre-sublayer conv and the post-sublayer conv of the
sublayer's output. Taps never reach across a block boundary: in training many blocks sit back to
back in one sequence, and slot 0 (the anchor) sees no previous slot. Identity init (base[0] = 1,
other taps 0, projection 0) makes a fresh DFlash 2 compute exactly what DFlash computes.

Selector: per drafted slot the K best unary logits are candidates; a transition from predecessor
token a to candidate c at hidden state h scores `unary[c] + <A[a] * P(h), B[c]>`; drafting walks
greedily from the verified anchor token. Parameter names are z-lab's (`dflash/model.py`,
`DFlash2DraftModel`) and speculators 0.9's: the codebooks are bare parameters
(`candidate_selector.predecessor_codebook`), which z-lab's `from_pretrained` maps onto its
`nn.Embedding`s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.model.anchors import BlockPlan
from dflash_core.model.attention import DFlashDecoderLayer, drop
from dflash_core.model.context_cache import ContextCache
from dflash_core.model.dflash2_loss import dflash2_objective, selector_metrics, transform_logits
from dflash_core.model.drafter import DFlashDraftModel, DraftOutput, TargetHeads
from dflash_core.model.dynamic_conv import GroupedDynamicCausalConv
from dflash_core.model.loss import default_chunk_size
from dflash_core.model.dflash2_config import (  # noqa: F401 - re-exported
    DFLASH2_FIELDS, VARIANTS, DFlash2Config, config_from_dict, drafter_config, variant_of,
)
from dflash_core.model.loss_spec import LossSpec


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """DFlash's pre-norm layer with a conv pair around attention and one around the MLP."""

    def __init__(self, config: DFlash2Config, *, layer_type: str, device=None) -> None:
        super().__init__(config, layer_type=layer_type, device=device)
        conv = dict(
            hidden_size=config.hidden_size,
            kernel_size=config.conv_kernel_size,
            group_size=config.conv_group_size,
            block_size=config.block_size,
            device=device,
        )
        self.attention_conv = GroupedDynamicCausalConv(**conv)
        self.mlp_conv = GroupedDynamicCausalConv(**conv)

    def forward(self, block_BQH: torch.Tensor, *, branch_masks: tuple[torch.Tensor, torch.Tensor] | None = None,
                **attention_kwargs: Any) -> torch.Tensor:
        # Block K/V come from the convolved input, as in the reference (k_proj of the conv output).
        attn_in, attn_delta = self.attention_conv.prepare(self.input_layernorm(block_BQH))
        attn_out = self.self_attn(attn_in, **attention_kwargs)
        hidden = block_BQH + drop(self.attention_conv.finish(attn_out, attn_delta), branch_masks, 0)
        mlp_in, mlp_delta = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + drop(self.mlp_conv.finish(self.mlp(mlp_in), mlp_delta), branch_masks, 1)


# -- the selector ------------------------------------------------------------------------------


class CandidateSelector(nn.Module):
    """score(a -> c | h) = unary[c] + <A[a] * P(h), B[c]>, over the unary top-K candidates c."""

    def __init__(self, *, vocab_size: int, hidden_size: int, rank: int, top_k: int, device=None) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank, device=device))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank, device=device))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False, device=device)

    def reset_parameters(self, *, std: float) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, mean=0.0, std=std)

    # The codebook rows are read with F.embedding, not `codebook[ids]`: the same values, but indexing's
    # backward sums each id's rows one after another, and candidates repeat frequent ids (4.0 ms a step
    # in the 8B bench); embedding's backward sums long runs of one id in parallel pieces.
    # docs/benchmarks.md, "Figures behind choices" (codebooks through F.embedding).
    def context(self, hidden_NH: torch.Tensor, predecessor_ids_N: torch.Tensor) -> torch.Tensor:
        """A[a] * P(h): [..., rank]."""
        projected = self.hidden_projection(hidden_NH)
        codes = F.embedding(predecessor_ids_N, self.predecessor_codebook)
        return codes * projected.to(self.predecessor_codebook.dtype)

    def transition_scores(self, context_NR: torch.Tensor, candidate_ids_NK: torch.Tensor) -> torch.Tensor:
        """<context, B[c]> for each candidate: [..., K]."""
        successors = F.embedding(candidate_ids_NK, self.successor_codebook)
        return (context_NR.unsqueeze(-2) * successors).sum(-1)

    @torch.no_grad()
    def greedy_path(
        self, hidden_BSH: torch.Tensor, unary_BSV: torch.Tensor, anchor_ids_B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(path [B, S], candidates [B, S, K]): slot by slot, the best-scoring candidate given the
        previous slot's pick, starting from the verified anchor token."""
        unary, candidates = unary_BSV.topk(self.top_k, dim=-1)
        projected = self.hidden_projection(hidden_BSH).to(self.predecessor_codebook.dtype)
        predecessor = anchor_ids_B
        path = []
        for slot in range(hidden_BSH.shape[1]):
            context = F.embedding(predecessor, self.predecessor_codebook) * projected[:, slot]
            scores = unary[:, slot].float() + self.transition_scores(context, candidates[:, slot]).float()
            predecessor = candidates[:, slot].gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
            path.append(predecessor)
        return torch.stack(path, dim=1), candidates


# -- the model ---------------------------------------------------------------------------------


class DFlash2DraftModel(DFlashDraftModel):
    """DFlashDraftModel with DFlash 2 layers and a candidate selector (same training and drafting
    API; `draft_tokens` gives the selector's greedy path)."""

    layer_class = DFlash2DecoderLayer
    has_selector = True

    def __init__(self, config: DFlash2Config, *, device=None, loss: LossSpec | None = None) -> None:
        if not isinstance(config, DFlash2Config):
            raise ValueError(f"DFlash2DraftModel needs a DFlash2Config, got {type(config).__name__}")
        super().__init__(config, device=device, loss=loss)
        self.candidate_selector = CandidateSelector(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            rank=config.selector_rank,
            top_k=config.selector_top_k,
            device=device,
        )
        if device is None or torch.device(device).type != "meta":
            self.init_weights()

    def init_weights(self) -> None:
        """DFlash's init, then identity convolutions and N(0, initializer_range) selector tables
        (speculators 0.9's init; z-lab's reference leaves `base_kernel` to the checkpoint)."""
        super().init_weights()
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_parameters()
            elif isinstance(module, CandidateSelector):
                module.reset_parameters(std=self.config.initializer_range)

    def unary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on drafter states, with output_multiplier and softcapping."""
        cfg = self.config
        logits = self.target_heads.lm_head(hidden)
        return transform_logits(logits, multiplier=cfg.output_multiplier, softcap=cfg.final_logit_softcapping)

    # -- training ---------------------------------------------------------------------------
    @staticmethod
    def _predecessor_ids(
        *, input_ids: torch.Tensor, plan: BlockPlan, labels_BAK: torch.Tensor
    ) -> torch.Tensor:
        """[B, A, block_size-1] the token before each drafted slot on a path that is still accepted:
        the anchor token for slot 1, slot k-1's label after it (the data token where that label
        carries no loss)."""
        batch, seq_len = input_ids.shape
        offsets = torch.arange(plan.block_size - 1, device=input_ids.device)
        positions = (plan.anchors[..., None] + offsets).clamp(max=seq_len - 1)
        data = input_ids[torch.arange(batch, device=input_ids.device)[:, None, None], positions]
        previous_labels = torch.where(plan.label_valid[..., :-1], labels_BAK[..., :-1], data[..., 1:])
        return torch.cat((data[..., :1], previous_labels), dim=-1)

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
        """One training pass: DFlash's loss on the unary logits (CE, or with loss_type "kl" KL to the
        target's distribution) plus alpha x the selector's K-way cross-entropy of the hard labels
        (teacher-forced predecessors, the label injected when the top-K lacks it). Same inputs as
        `DFlashDraftModel.forward`; metrics add the selector's."""
        cfg = self.config
        hidden = self._block_states(
            input_ids=input_ids, target_hidden=target_hidden, plan=plan, attention_backend=attention_backend,
            generator=generator,
        )
        drafted = hidden[:, :, 1:]
        kl = self._loss_is_kl(teacher_hidden)
        labels = self._labels(input_ids_BT=input_ids, plan=plan, teacher_hidden_BTH=teacher_hidden)
        predecessors = self._predecessor_ids(input_ids=input_ids, plan=plan, labels_BAK=labels)
        dpace = self.loss.loss_weighting == "dpace"
        weights = plan.label_valid.float() if dpace else self.exp_decay_weights() * plan.label_valid
        lm_head_weight = self.target_heads.lm_head.weight
        objective = dflash2_objective(
            drafted.reshape(-1, drafted.shape[-1]),
            lm_head_weight=lm_head_weight,
            selector=self.candidate_selector,
            labels_N=labels.flatten(),
            predecessor_ids_N=predecessors.flatten(),
            token_weights_N=weights.flatten(),
            output_multiplier=cfg.output_multiplier,
            softcap=cfg.final_logit_softcapping,
            selector_loss_weight=cfg.selector_loss_weight,
            chunk_size=loss_chunk_size or default_chunk_size(vocab_size=lm_head_weight.shape[0]),
            dpace_alpha=self.loss.dpace_alpha if dpace else None,
            num_slots=cfg.block_size - 1,
            label_smoothing=self.loss.label_smoothing,
            compiled=self._layers_compiled,
            dpace_source=self.loss.dpace_source,
            teacher_hidden_NH=self._teacher_rows(teacher_hidden_BTH=teacher_hidden, plan=plan) if kl else None,
            fp8_head=self.fp8_lm_head(),
        )
        metrics = selector_metrics(objective, valid_BAK=plan.label_valid, anchor_valid_BA=plan.anchor_valid)
        return DraftOutput(hidden_BAKH=drafted, labels_BAK=labels), objective.loss, metrics

    # -- drafting ---------------------------------------------------------------------------
    @contextmanager
    def _states_instead_of_logits(self) -> Iterator[None]:
        """While active, the LM head is the identity: the base class's drafting pass (its masks,
        windows and cache handling, kept in one place) then returns the drafter states."""
        heads = self.target_heads
        self.attach_target(
            TargetHeads(embed_tokens=heads.embed_tokens, final_norm=heads.final_norm, lm_head=nn.Identity())
        )
        try:
            yield
        finally:
            self.attach_target(heads)

    @torch.no_grad()
    def draft_hidden(
        self, cache: ContextCache, *, last_token_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Drafter states [B, block_size-1, H] of the slots after `last_token_ids` (see `draft_block`)."""
        with self._states_instead_of_logits():
            return super().draft_block(cache, last_token_ids=last_token_ids, position_ids=position_ids)

    @torch.no_grad()
    def draft_block(
        self, cache: ContextCache, *, last_token_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Unary logits [B, block_size-1, V] (multiplier and softcap applied). Their argmax is NOT
        what DFlash 2 proposes: use `draft_tokens` for the selector's path."""
        hidden = self.draft_hidden(cache, last_token_ids=last_token_ids, position_ids=position_ids)
        return self.unary_logits(hidden)

    @torch.no_grad()
    def draft_tokens(
        self, cache: ContextCache, *, last_token_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """The selector's greedy path [B, block_size-1] after `last_token_ids` [B] at `position_ids` [B]."""
        hidden = self.draft_hidden(cache, last_token_ids=last_token_ids, position_ids=position_ids)
        path, _ = self.candidate_selector.greedy_path(hidden, self.unary_logits(hidden), last_token_ids)
        return path


@torch.no_grad()
def draft_tokens(
    drafter: DFlashDraftModel,
    cache: ContextCache,
    *,
    last_token_ids: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Greedy block proposal [B, block_size-1] of either variant: DFlash's argmax, DFlash 2's
    selector path. The one call an evaluator needs for block (non-tree) rounds."""
    if isinstance(drafter, DFlash2DraftModel):
        return drafter.draft_tokens(cache, last_token_ids=last_token_ids, position_ids=position_ids)
    return drafter.draft_block(cache, last_token_ids=last_token_ids, position_ids=position_ids).argmax(-1)
