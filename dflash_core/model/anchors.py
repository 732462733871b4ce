"""Anchor sampling and the per-batch block plan.

A block starts at an anchor p: [token p, MASK x (B-1)], and slot k (1..B-1) learns token p+k.
Sampling is vectorized torch with no host sync, so it runs wherever the batch lives; building
the plan on the CPU (in the data loader) also gives the exact teacher positions for free, since
`nonzero` on a CPU tensor costs the GPU nothing.
"""

from __future__ import annotations

import dataclasses

import torch

ANCHOR_SAMPLINGS = ("uniform", "stratified")


def document_ids_from_positions(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Document index per token of a packed row: a new document starts where positions don't step by 1."""
    starts = torch.ones_like(position_ids_BT, dtype=torch.bool)
    starts[:, 1:] = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    return starts.long().cumsum(dim=1) - 1


def eligible_anchor_positions(
    *, loss_mask_BT: torch.Tensor, document_ids_BT: torch.Tensor, block_size: int, prompt_anchors: bool = False
) -> torch.Tensor:
    """Bool [B, T]: p may anchor a block.

    p is a loss-mask position with at least one token of its own document before it (the block's
    target context) and whose next token p+1 is a loss position of the same document, so slot 1
    always carries loss. The block may run past the end of its document (or of the row): those
    slots get no label (`plan_blocks` masks them), as in speculators. So the last tokens of every
    response, the end-of-turn token among them, are learned at every slot, not only the last.
    `prompt_anchors`: the loss mask is not asked for (prompt positions anchor too; their slots then
    learn the target's argmax), only the document rule. `block_size` is kept for callers; the rule
    does not depend on it.
    """
    del block_size
    batch, seq_len = loss_mask_BT.shape
    loss = torch.ones_like(loss_mask_BT, dtype=torch.bool) if prompt_anchors else loss_mask_BT.bool()
    eligible = torch.zeros_like(loss)
    if seq_len < 3:
        return eligible
    docs = document_ids_BT
    same_doc_before = docs[:, 1:-1] == docs[:, :-2]
    next_is_label = loss[:, 2:] & (docs[:, 2:] == docs[:, 1:-1])
    eligible[:, 1:-1] = loss[:, 1:-1] & same_doc_before & next_is_label
    if prompt_anchors:  # padding (document id -1 where the caller has document ids) never anchors
        eligible &= docs >= 0
    return eligible


def sample_anchors(
    *, eligible_BT: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None,
    sampling: str = "uniform",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` distinct eligible positions per row, sorted ascending.

    sampling "uniform": any `num_anchors` of them, uniformly. "stratified": a row's E eligible positions,
    in row order, cut into `num_anchors` strata of floor or ceil(E / num_anchors) consecutive ones, one
    uniform pick in each: anchors spread evenly, so blocks overlap less and cover more label positions,
    and every document gets anchors in proportion to its eligible positions. Both take every eligible
    position when there are at most `num_anchors`.

    Returns (anchors [B, A] long, valid [B, A] bool); rows with fewer eligible positions are
    padded at the end with anchor 0 and valid False.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if sampling not in ANCHOR_SAMPLINGS:
        raise ValueError(f"anchor sampling must be one of {ANCHOR_SAMPLINGS}, got {sampling!r}")
    if sampling == "stratified":
        return _stratified_anchors(eligible_BT, num_anchors=num_anchors, generator=generator)
    batch, seq_len = eligible_BT.shape
    scores = torch.rand(batch, seq_len, generator=generator, device=eligible_BT.device)
    scores = torch.where(eligible_BT, scores, torch.full_like(scores, -1.0))
    picked = scores.topk(min(num_anchors, seq_len), dim=1)
    positions = torch.where(picked.values >= 0, picked.indices, torch.full_like(picked.indices, seq_len))
    if num_anchors > seq_len:
        pad = positions.new_full((batch, num_anchors - seq_len), seq_len)
        positions = torch.cat((positions, pad), dim=1)
    positions = positions.sort(dim=1).values
    valid = positions < seq_len
    return torch.where(valid, positions, torch.zeros_like(positions)), valid


def _stratified_anchors(
    eligible_BT: torch.Tensor, *, num_anchors: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_anchors(sampling="stratified")`: stratum i holds the eligible ranks [ceil(iE/A), ceil((i+1)E/A)),
    at least one when E >= A, so the picks are distinct and ascending; with E < A, anchor i is rank i."""
    device = eligible_BT.device
    rank_BT = eligible_BT.long().cumsum(dim=1)  # 1-based rank of each eligible position
    count_B1 = rank_BT[:, -1:]
    index = torch.arange(num_anchors, device=device)
    low = (index * count_B1 + num_anchors - 1) // num_anchors
    high = ((index + 1) * count_B1 + num_anchors - 1) // num_anchors
    draw = torch.rand(eligible_BT.shape[0], num_anchors, generator=generator, device=device)
    strided = low + (draw * (high - low)).long().clamp(max=(high - low - 1).clamp_min(0))
    ranks = torch.where(count_B1 >= num_anchors, strided, index.expand_as(strided))
    valid = index < count_B1
    positions = torch.searchsorted(rank_BT, ranks + 1)  # the position holding that rank
    return torch.where(valid, positions, torch.zeros_like(positions)), valid


@dataclasses.dataclass
class BlockPlan:
    """Where the blocks of one batch sit and which of their slots carry loss.

    anchors/anchor_valid: [B, A]; label_valid: [B, A, block_size-1] (slot k=1..B-1 learns the
    token at anchor+k); teacher_index: flat indices (row * T + pos) of the target positions whose
    argmax the slots need, each once (None: compute them per slot).
    """

    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    label_valid: torch.Tensor
    document_ids: torch.Tensor
    position_ids: torch.Tensor
    block_size: int
    teacher_index: torch.Tensor | None = None

    @classmethod
    def at_anchors(cls, anchors: list[int], *, seq_len: int, block_size: int, device=None) -> BlockPlan:
        """One row, one document, blocks at the given anchors with every slot labelled: the plan a
        consumer's parity check or a drafting comparison feeds (no sampling)."""
        count = len(anchors)
        return cls(
            anchors=torch.tensor([anchors], device=device),
            anchor_valid=torch.ones(1, count, dtype=torch.bool, device=device),
            label_valid=torch.ones(1, count, block_size - 1, dtype=torch.bool, device=device),
            document_ids=torch.zeros(1, seq_len, dtype=torch.long, device=device),
            position_ids=torch.arange(seq_len, device=device)[None],
            block_size=block_size,
        )

    @property
    def num_anchors(self) -> int:
        return self.anchors.shape[1]

    @property
    def seq_len(self) -> int:
        return self.document_ids.shape[1]

    def label_positions(self) -> torch.Tensor:
        """[B, A, block_size-1] sequence index of each slot's target token (clamped in range)."""
        offsets = torch.arange(1, self.block_size, device=self.anchors.device)
        return (self.anchors[..., None] + offsets).clamp(max=self.seq_len - 1)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> BlockPlan:
        moved = {
            field.name: (
                value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
            )
            for field in dataclasses.fields(self)
            for value in [getattr(self, field.name)]
        }
        return BlockPlan(**moved)


def plan_blocks(
    *,
    loss_mask_BT: torch.Tensor,
    num_anchors: int,
    block_size: int,
    position_ids_BT: torch.Tensor | None = None,
    document_ids_BT: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    with_teacher_index: bool = True,
    anchor_sampling: str = "uniform",
    prompt_anchors: bool = False,
) -> BlockPlan:
    """Sample anchors and derive which slots carry loss. Pass position ids reset per document
    (or document ids) for packed rows; with neither, each row is one document. `anchor_sampling`: see
    `sample_anchors`. `prompt_anchors`: blocks may also start in prompts and every slot inside its
    document carries loss, loss mask or not; only for labels from the target's argmax (teacher)."""
    if loss_mask_BT.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got shape {tuple(loss_mask_BT.shape)}")
    batch, seq_len = loss_mask_BT.shape
    device = loss_mask_BT.device
    if position_ids_BT is None:
        if document_ids_BT is None:
            position_ids_BT = torch.arange(seq_len, device=device).expand(batch, seq_len)
        else:
            position_ids_BT = _positions_from_documents(document_ids_BT)
    if document_ids_BT is None:
        document_ids_BT = document_ids_from_positions(position_ids_BT)
    eligible = eligible_anchor_positions(
        loss_mask_BT=loss_mask_BT, document_ids_BT=document_ids_BT, block_size=block_size,
        prompt_anchors=prompt_anchors,
    )
    anchors, anchor_valid = sample_anchors(eligible_BT=eligible, num_anchors=num_anchors, generator=generator,
                                           sampling=anchor_sampling)
    offsets = torch.arange(1, block_size, device=device)
    unclamped = anchors[..., None] + offsets
    label_pos = unclamped.clamp(max=seq_len - 1)
    rows = torch.arange(batch, device=device)[:, None, None]
    # A slot past the row's end or in the next document has no label.
    in_document = (unclamped < seq_len) & (
        document_ids_BT[rows, label_pos] == document_ids_BT.gather(1, anchors)[..., None]
    )
    label_valid = anchor_valid[..., None] & in_document
    if not prompt_anchors:
        label_valid &= loss_mask_BT.bool()[rows, label_pos]
    teacher_index = None
    if with_teacher_index:
        # The target's prediction of token p+k is its output at p+k-1.
        needed = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
        needed[rows.expand_as(label_pos)[label_valid], (label_pos - 1)[label_valid]] = True
        teacher_index = needed.flatten().nonzero().squeeze(1)
    return BlockPlan(
        anchors=anchors,
        anchor_valid=anchor_valid,
        label_valid=label_valid,
        document_ids=document_ids_BT,
        position_ids=position_ids_BT,
        block_size=block_size,
        teacher_index=teacher_index,
    )


def _positions_from_documents(document_ids_BT: torch.Tensor) -> torch.Tensor:
    starts = torch.ones_like(document_ids_BT, dtype=torch.bool)
    starts[:, 1:] = document_ids_BT[:, 1:] != document_ids_BT[:, :-1]
    index = torch.arange(document_ids_BT.shape[1], device=document_ids_BT.device).expand_as(document_ids_BT)
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index
