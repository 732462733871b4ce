"""DFlash 2's training objective: DFlash's weighted unary loss (cross-entropy to the labels, or KL to the
target's distribution) plus alpha x a K-way cross-entropy of the candidate selector, without
[tokens, vocab] logits for all tokens at once.

One chunked pass over the LM head gives, per drafted slot, the unary loss and its input gradient
(as `loss.chunked_lm_head_loss` does; under KL the teacher's logits of the chunk are made there
too, from its final-normed states) and the slot's training candidates: the unary top-K,
with the label put in place of the weakest candidate when the top-K lacks it (so every slot has a
K-way label; serving would not have it, and the metrics say so). The candidates' unary logits leave
the pass as a differentiable [N, K] tensor whose backward gathers K LM-head rows per slot, so the
selector loss trains the drafter's states through both the unary and the transition terms.

Metrics keep serving apart from teacher forcing: `unary_topk_recall` (the label is among the
serving candidates), `selector_accuracy` (teacher-forced predecessor, serving candidates) and
`selector_acceptance_length`: the accepted run of the selector's own greedy path, exact because a
path that is still accepted has exactly the teacher-forced predecessors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from dflash_core.model.loss import (
    check_fp8_head, cross_entropy_logit_grad, cross_entropy_terms, dpace_weights, even_chunk_size, head_grad_input,
    head_logits,
)
from dflash_core.model.topk import group_maxima, grouped_topk
from dflash_core.model.loss_spec import DPACE_SOURCES
from dflash_core.model.metrics import block_metrics

if TYPE_CHECKING:
    from dflash_core.model.lm_head_fp8 import Fp8LMHead


def transform_logits(logits: torch.Tensor, *, multiplier: float, softcap: float | None) -> torch.Tensor:
    """multiplier * logits, then softcap * tanh(. / softcap) when softcap is set (z-lab's order)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _transform_slope(
    logits: torch.Tensor, *, multiplier: float, softcap: float | None
) -> torch.Tensor | float:
    """d(transformed)/d(raw), written in terms of the transformed logits."""
    if softcap is None:
        return multiplier
    return multiplier * (1.0 - (logits / softcap).square())


def _unary_rows(raw, labels, *, multiplier: float, softcap: float | None, smoothing: float, with_grad: bool):
    """Per row of one chunk of raw LM-head logits: the unary loss, the label's NLL, its (transformed)
    logit, correctness, d(loss)/d(raw) in raw's dtype and the raw row's group maxima for the top-K
    (`topk.group_maxima`). One function, so torch.compile fuses the upcast, transform, logsumexp,
    argmax and gradient into a few passes over the [chunk, vocab] logits (`compiled_unary_kernel`) and
    the maxima into a Triton reduction instead of a separate eager one; eager it is the same math.
    The transformed fp32 logits stay inside: the top-K reads the raw chunk instead (see
    `_candidates`), which saves writing and reading a [chunk, vocab] fp32 tensor per chunk (2 GiB at
    Qwen3.5's vocabulary and 2,048 rows)."""
    logits = transform_logits(raw.float(), multiplier=multiplier, softcap=softcap)
    loss, nll, label_logit, log_norm, correct = cross_entropy_terms(logits, labels, smoothing=smoothing)
    maxima = group_maxima(raw)
    if not with_grad:
        return loss, nll, label_logit, correct, None, maxima
    grad = cross_entropy_logit_grad(logits, log_norm, labels, smoothing=smoothing)
    if multiplier != 1.0 or softcap is not None:  # d(transformed)/d(raw); skipped when it is 1
        grad = grad * _transform_slope(logits, multiplier=multiplier, softcap=softcap)
    return loss, nll, label_logit, correct, grad.to(raw.dtype), maxima


def _unary_kl_rows(raw, labels, teacher_raw, *, multiplier: float, softcap: float | None, with_grad: bool):
    """`_unary_rows` with KL(teacher || drafter) as the loss: both raw chunks get the same transform (the
    unary head mirrors the target's, so a drafter whose states are the teacher's has KL 0). The label
    (the teacher's argmax) still gives the NLL D-PACE reads, the logit the candidates inject and
    correctness; d(kl)/d(transformed) = softmax(drafter) - softmax(teacher)."""
    logits = transform_logits(raw.float(), multiplier=multiplier, softcap=softcap)
    _, nll, label_logit, log_norm, correct = cross_entropy_terms(logits, labels)
    teacher = transform_logits(teacher_raw.float(), multiplier=multiplier, softcap=softcap)
    log_p = torch.log_softmax(teacher, dim=-1)
    p = torch.exp(log_p)
    log_q = logits - log_norm[:, None]
    kl = (p * (log_p - log_q)).sum(dim=-1)
    maxima = group_maxima(raw)
    if not with_grad:
        return kl, nll, label_logit, correct, None, maxima
    grad = torch.exp(log_q) - p
    if multiplier != 1.0 or softcap is not None:
        grad = grad * _transform_slope(logits, multiplier=multiplier, softcap=softcap)
    return kl, nll, label_logit, correct, grad.to(raw.dtype), maxima


def _candidates(raw, labels, label_logit, top_k: int, *, multiplier: float, softcap: float | None, maxima):
    """Training candidates of one chunk: the top-K of the raw logits with their transformed values,
    the label in place of the weakest when missing, and whether it was there. The transform
    (multiplier > 0, then tanh) is increasing, so the raw top-K is the transformed top-K; only the K
    values per row are transformed, in fp32, exactly as the full row would have been."""
    raw_values, ids = grouped_topk(raw, top_k, maxima=maxima)  # sorted: the last is the weakest
    values = transform_logits(raw_values.float(), multiplier=multiplier, softcap=softcap)
    has_label = (ids == labels[:, None]).any(dim=-1)
    ids[:, -1] = torch.where(has_label, ids[:, -1], labels)
    values[:, -1] = torch.where(has_label, values[:, -1], label_logit)
    return ids, values, has_label


def _reranked_candidates(hidden_NH, weight_VH, raw, labels, top_k: int, *, multiplier: float, softcap: float | None,
                         maxima):
    """`_candidates` when `raw` came from FP8 GEMMs (`lm_head_fp8`): their top-2K, re-scored with the exact
    head rows, keep the best K, so the selector sees the candidates and values bf16 logits give it unless a
    top-K entry fell out of FP8's top-2K. The label's logit is exact too."""
    _, wide = grouped_topk(raw, 2 * top_k, maxima=maxima)
    exact = torch.einsum("nh,nkh->nk", hidden_NH, weight_VH[wide])
    raw_values, order = exact.topk(top_k, dim=-1)  # sorted: the last is the weakest
    ids = wide.gather(1, order)
    values = transform_logits(raw_values.float(), multiplier=multiplier, softcap=softcap)
    label_raw = torch.einsum("nh,nh->n", hidden_NH, weight_VH[labels])
    label_logit = transform_logits(label_raw.float(), multiplier=multiplier, softcap=softcap)
    has_label = (ids == labels[:, None]).any(dim=-1)
    ids[:, -1] = torch.where(has_label, ids[:, -1], labels)
    values[:, -1] = torch.where(has_label, values[:, -1], label_logit)
    return ids, values, has_label


@functools.cache
def compiled_unary_kernel():
    """`_unary_rows` torch.compile'd (GPU; shapes are static per chunk size), made once per process."""
    return torch.compile(_unary_rows, dynamic=False)


@functools.cache
def compiled_unary_kl_kernel():
    """`_unary_kl_rows` torch.compile'd, as `compiled_unary_kernel`."""
    return torch.compile(_unary_kl_rows, dynamic=False)


class _UnaryLossAndCandidates(torch.autograd.Function):
    """Chunked: per-row CE (or, given the teacher's rows, KL) of transformed logits, the label's NLL,
    correctness, training candidates and their (differentiable) logits. The unary loss's input gradient
    is computed in the forward pass, chunk by chunk, unscaled: backward applies the per-row gradient of
    the loss rows (the slot scale, known only once the selector has scored the candidates when D-PACE
    reads the selector). The candidate logits' gradient gathers K LM-head rows per slot in backward."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, teacher_NH, top_k, multiplier, softcap, chunk_size,
                label_smoothing, unary_kernel, fp8_head):
        num_rows = hidden_NH.shape[0]
        device = hidden_NH.device
        compute_dtype = weight_VH.dtype
        nll_rows = torch.empty(num_rows, dtype=torch.float32, device=device)
        # With label smoothing or KL the loss differs from the label's NLL, which D-PACE still reads.
        separate = label_smoothing > 0 or teacher_NH is not None
        loss_rows = torch.empty(num_rows, dtype=torch.float32, device=device) if separate else nll_rows
        correct = torch.empty(num_rows, dtype=torch.bool, device=device)
        contains = torch.empty(num_rows, dtype=torch.bool, device=device)
        candidate_ids = torch.empty(num_rows, top_k, dtype=torch.long, device=device)
        candidate_logits = torch.empty(num_rows, top_k, dtype=torch.float32, device=device)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden_NH) if needs_grad else hidden_NH.new_empty(0)
        chunk_size = even_chunk_size(num_rows, chunk_size)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            raw = head_logits(hidden_NH[rows], weight_VH, fp8_head)
            labels = labels_N[rows]
            if teacher_NH is None:
                loss_rows[rows], nll_rows[rows], label_logit, correct[rows], grad, maxima = unary_kernel(
                    raw, labels, multiplier=multiplier, softcap=softcap, smoothing=label_smoothing,
                    with_grad=needs_grad)
            else:
                with torch.autocast(device.type, enabled=False):  # the teacher's logits in the target's dtype
                    teacher_raw = teacher_NH[rows].to(compute_dtype) @ weight_VH.T
                loss_rows[rows], nll_rows[rows], label_logit, correct[rows], grad, maxima = unary_kernel(
                    raw, labels, teacher_raw, multiplier=multiplier, softcap=softcap, with_grad=needs_grad)
            if fp8_head is None:
                candidate_ids[rows], candidate_logits[rows], contains[rows] = _candidates(
                    raw, labels, label_logit, top_k, multiplier=multiplier, softcap=softcap, maxima=maxima)
            else:
                candidate_ids[rows], candidate_logits[rows], contains[rows] = _reranked_candidates(
                    hidden_NH[rows].to(compute_dtype), weight_VH, raw, labels, top_k, multiplier=multiplier,
                    softcap=softcap, maxima=maxima)
            if needs_grad:
                grad_hidden[rows] = head_grad_input(grad, weight_VH, fp8_head).to(hidden_NH.dtype)
        ctx.save_for_backward(grad_hidden, weight_VH, candidate_ids, candidate_logits)
        ctx.transform = (multiplier, softcap)
        ctx.chunk_size = chunk_size
        ctx.hidden_dtype = hidden_NH.dtype
        nll_out = nll_rows.clone() if loss_rows is nll_rows else nll_rows  # two outputs, two tensors
        ctx.mark_non_differentiable(nll_out, correct, candidate_ids, contains)
        return loss_rows, nll_out, correct, candidate_ids, candidate_logits, contains

    @staticmethod
    def backward(ctx, grad_loss_rows, _grad_nll, _grad_correct, _grad_ids, grad_candidate_logits, _grad_contains):
        grad_ce, weight_VH, candidate_ids, candidate_logits = ctx.saved_tensors
        grad_hidden = grad_ce * grad_loss_rows[:, None].to(grad_ce.dtype)
        if grad_candidate_logits is not None:
            multiplier, softcap = ctx.transform
            grad_raw = grad_candidate_logits * _transform_slope(
                candidate_logits, multiplier=multiplier, softcap=softcap
            )
            for start in range(0, grad_raw.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                rows_of_head = weight_VH[candidate_ids[rows]]  # [chunk, K, H]
                grad_rows = torch.einsum("nk,nkh->nh", grad_raw[rows].to(weight_VH.dtype), rows_of_head)
                grad_hidden[rows] += grad_rows.to(ctx.hidden_dtype)
        return (grad_hidden,) + (None,) * 10


def slot_scale(nll_N: torch.Tensor, token_weights_N: torch.Tensor, *, dpace_alpha: float | None,
               num_slots: int) -> torch.Tensor:
    """Per-slot loss scale [N] (no gradient), DFlash's two weightings: fixed weights over their sum, or
    D-PACE weights (slots with weight 0 have no loss) over the number of slots with loss, as the base
    drafter's loss and speculators normalize them."""
    with torch.no_grad():
        if dpace_alpha is None:
            return token_weights_N / token_weights_N.sum().clamp_min(1e-12)
        if num_slots < 1 or nll_N.numel() % num_slots:
            raise ValueError(f"D-PACE groups slots into blocks of num_slots={num_slots}; {nll_N.numel()} slots")
        valid = token_weights_N > 0
        weights = dpace_weights(nll_N.view(-1, num_slots), valid.view(-1, num_slots), alpha=dpace_alpha)
        return weights.flatten() / valid.sum().clamp_min(1)


@dataclasses.dataclass
class DFlash2Objective:
    """loss = dflash_loss + alpha * selector_loss; per-slot booleans [N] for the metrics."""

    loss: torch.Tensor
    dflash_loss: torch.Tensor
    selector_loss: torch.Tensor
    unary_correct: torch.Tensor
    label_in_top_k: torch.Tensor
    selector_correct: torch.Tensor


def selector_cross_entropy_rows(scores_NK: torch.Tensor, label_index_N: torch.Tensor) -> torch.Tensor:
    """CE_K(scores, label index) per slot [N]: the selector's K-way loss before the slot scale."""
    return torch.logsumexp(scores_NK, dim=-1) - scores_NK.gather(1, label_index_N[:, None]).squeeze(1)


def dflash2_objective(
    hidden_NH: torch.Tensor,
    *,
    lm_head_weight: torch.Tensor,
    selector: nn.Module,
    labels_N: torch.Tensor,
    predecessor_ids_N: torch.Tensor,
    token_weights_N: torch.Tensor,
    output_multiplier: float = 1.0,
    softcap: float | None = None,
    selector_loss_weight: float = 1.0,
    chunk_size: int = 2048,
    dpace_alpha: float | None = None,
    num_slots: int = 0,
    label_smoothing: float = 0.0,
    compiled: bool = False,
    dpace_source: str = "unary",
    teacher_hidden_NH: torch.Tensor | None = None,
    fp8_head: Fp8LMHead | None = None,
) -> DFlash2Objective:
    """Both losses over N drafted slots. `selector` is a `CandidateSelector` (top_k, context,
    transition_scores); `predecessor_ids_N` the token before each slot on an accepted path.
    `token_weights_N`: fixed slot weights (0: no loss), or with `dpace_alpha` only the 0/1 validity,
    the slots then weighted by D-PACE within blocks of `num_slots`. `label_smoothing` s smooths the
    unary cross-entropy ((1 - s) * CE + s * mean over the vocabulary of -log q); the selector's
    K-way loss keeps hard labels. `compiled`: the per-chunk kernel torch.compile'd (GPU). `dpace_source`
    (with `dpace_alpha`): D-PACE's confidence of a slot is exp(-NLL) of the unary logits ("unary") or of
    the selector's K-way scores ("selector"); either way the weights scale both losses.
    `teacher_hidden_NH`: the target's final-normed state per slot (whose logits predict its label); with
    it the unary loss is KL(teacher || drafter) over the transformed logits, the teacher's logits made a
    chunk at a time, and `labels_N` must be the teacher's argmax (the selector, the candidates and
    D-PACE's unary confidence read them). `fp8_head`: the FP8 copy of the head (`dflash_core.model.lm_head_fp8.Fp8LMHead`),
    whose GEMMs then make the unary logits and their input gradient; the candidates' rows, the selector and a
    KL teacher's logits keep the head's dtype."""
    if lm_head_weight.requires_grad:
        raise ValueError("the LM head must be frozen (requires_grad=False): it belongs to the target")
    check_fp8_head(fp8_head, lm_head_weight)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if output_multiplier <= 0:  # the candidates are the raw top-K: a negative multiplier would flip them
        raise ValueError(f"output_multiplier must be > 0, got {output_multiplier}")
    if dpace_source not in DPACE_SOURCES:
        raise ValueError(f"dpace_source must be one of {DPACE_SOURCES}, got {dpace_source!r}")
    if dpace_source == "selector" and dpace_alpha is None:
        raise ValueError("dpace_source 'selector' sets D-PACE's confidences: it needs dpace_alpha (D-PACE weights)")
    kl = teacher_hidden_NH is not None
    if kl and label_smoothing:
        raise ValueError("label_smoothing applies to cross-entropy labels, not to the KL loss")
    if kl and teacher_hidden_NH.shape != hidden_NH.shape:
        raise ValueError(f"teacher_hidden_NH {tuple(teacher_hidden_NH.shape)} must match hidden_NH "
                         f"{tuple(hidden_NH.shape)}: one teacher row per drafted slot")
    if compiled:
        kernel = compiled_unary_kl_kernel() if kl else compiled_unary_kernel()
    else:
        kernel = _unary_kl_rows if kl else _unary_rows
    token_weights_N = token_weights_N.float()
    unary_rows, unary_nll, unary_correct, candidate_ids, candidate_logits, label_in_top_k = (
        _UnaryLossAndCandidates.apply(
            hidden_NH,
            lm_head_weight,
            labels_N,
            teacher_hidden_NH,
            selector.top_k,
            float(output_multiplier),
            None if softcap is None else float(softcap),
            chunk_size,
            float(label_smoothing),
            kernel,
            fp8_head,
        )
    )
    context = selector.context(hidden_NH, predecessor_ids_N)
    scores = candidate_logits + selector.transition_scores(context, candidate_ids).float()
    # The label sits where the top-K has it, else in the last slot (injected).
    label_index = (candidate_ids == labels_N[:, None]).long().argmax(dim=-1)
    selector_rows = selector_cross_entropy_rows(scores, label_index)
    confidence_nll = selector_rows.detach() if dpace_source == "selector" else unary_nll
    scale = slot_scale(confidence_nll, token_weights_N, dpace_alpha=dpace_alpha, num_slots=num_slots)
    dflash_loss = (scale * unary_rows).sum()
    selector_loss = (scale * selector_rows).sum()
    with torch.no_grad():
        selector_correct = (scores.argmax(dim=-1) == label_index) & label_in_top_k
    return DFlash2Objective(
        loss=dflash_loss + selector_loss_weight * selector_loss,
        dflash_loss=dflash_loss,
        selector_loss=selector_loss,
        unary_correct=unary_correct,
        label_in_top_k=label_in_top_k,
        selector_correct=selector_correct,
    )


def selector_metrics(
    objective: DFlash2Objective, *, valid_BAK: torch.Tensor, anchor_valid_BA: torch.Tensor
) -> dict[str, torch.Tensor]:
    """DFlash's block metrics of the unary argmax, plus the selector's (all detached tensors)."""
    valid = valid_BAK.detach()
    unary = block_metrics(
        correct_BAK=objective.unary_correct.view_as(valid), valid_BAK=valid, anchor_valid_BA=anchor_valid_BA
    )
    selector_correct = objective.selector_correct.view_as(valid)
    selector = block_metrics(correct_BAK=selector_correct, valid_BAK=valid, anchor_valid_BA=anchor_valid_BA)
    num_valid = valid.sum().float().clamp_min(1.0)
    in_top_k = objective.label_in_top_k.view_as(valid) & valid
    return {
        **unary,
        "loss": objective.loss.detach(),
        "dflash_loss": objective.dflash_loss.detach(),
        "selector_loss": objective.selector_loss.detach(),
        "unary_topk_recall": in_top_k.sum().float() / num_valid,
        "selector_accuracy": (selector_correct & valid).sum().float() / num_valid,
        "selector_accuracy_in_top_k": (selector_correct & valid).sum().float()
        / in_top_k.sum().float().clamp_min(1.0),
        "selector_accuracy_per_position": selector["accuracy_per_position"],
        "selector_acceptance_length": selector["acceptance_length_empirical"],
        "selector_acceptance_length_expected": selector["acceptance_length"],
    }
