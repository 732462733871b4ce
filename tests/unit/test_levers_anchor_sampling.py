"""Stratified anchor sampling (`anchor_sampling: stratified`): one anchor per stratum of a row's eligible
positions, so the same anchor budget covers more supervised tokens than uniform sampling and every
document gets its share; plans keep every invariant of the uniform sampler; a step trains on them.

The measurement (printed with -s): share of a packed 2,048-token row's label positions covered by at
least one block, at 512 anchors, uniform vs stratified.

Run: .venv/bin/python -m pytest -q -s tests/unit/test_levers_anchor_sampling.py
"""

import numpy as np
import pytest
import torch

from dflash_core.model.anchors import document_ids_from_positions, eligible_anchor_positions, plan_blocks, sample_anchors
from dflash_core.model.build import build_drafter

_BUDGET, _ANCHORS = 2048, 512


def packed_row(seed: int, *, budget: int = _BUDGET) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask [1, T], position_ids [1, T]): chat samples back to back as the bench's data packs them
    (prompt 8..256 tokens, median ~75; greedy completion 16..256, median ~150), padding at the end."""
    rng = np.random.default_rng(seed)
    positions, masks, used = [], [], 0
    while True:
        prompt = int(np.clip(rng.lognormal(4.3, 0.8), 8, 256))
        response = int(np.clip(rng.lognormal(5.0, 0.6), 16, 256))
        if used + prompt + response > budget:
            break
        positions.append(np.arange(prompt + response))
        masks.append(np.r_[np.zeros(prompt, bool), np.ones(response, bool)])
        used += prompt + response
    positions.append(np.zeros(budget - used, np.int64))
    masks.append(np.zeros(budget - used, bool))
    return torch.from_numpy(np.concatenate(masks))[None], torch.from_numpy(np.concatenate(positions))[None]


def label_coverage(plan, loss_mask: torch.Tensor) -> float:
    """Share of the supervised label positions (loss mask on, a token of the same document before) that
    at least one block's labelled slot covers."""
    docs = plan.document_ids
    labels = loss_mask.bool().clone()
    labels[:, 0] = False
    labels[:, 1:] &= docs[:, 1:] == docs[:, :-1]
    covered = torch.zeros_like(labels)
    positions = plan.label_positions()
    rows = torch.arange(labels.shape[0])[:, None, None].expand_as(positions)
    covered[rows[plan.label_valid], positions[plan.label_valid]] = True
    return ((covered & labels).sum() / labels.sum()).item()


def _plan(seed: int, sampling: str, *, block_size: int, num_anchors: int = _ANCHORS, **kwargs):
    loss_mask, positions = packed_row(seed)
    plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=num_anchors, block_size=block_size,
                       position_ids_BT=positions, generator=torch.Generator().manual_seed(seed),
                       anchor_sampling=sampling, **kwargs)
    return plan, loss_mask


@pytest.mark.parametrize("block_size", [8, 16])
def test_stratified_covers_more_supervised_tokens_than_uniform(block_size):
    coverage = {mode: float(np.mean([label_coverage(*_plan(seed, mode, block_size=block_size)) for seed in range(8)]))
                for mode in ("uniform", "stratified")}
    sparse = {mode: float(np.mean([label_coverage(*_plan(seed, mode, block_size=block_size, num_anchors=128))
                                   for seed in range(8)])) for mode in ("uniform", "stratified")}
    print(f"\nB={block_size}, {_ANCHORS} anchors per {_BUDGET} tokens: label coverage uniform "
          f"{coverage['uniform']:.4f}, stratified {coverage['stratified']:.4f}; at 128 anchors: uniform "
          f"{sparse['uniform']:.4f}, stratified {sparse['stratified']:.4f}")
    assert coverage["stratified"] > coverage["uniform"]
    assert sparse["stratified"] > sparse["uniform"] + 0.05
    # What stratified sampling misses sits at the start of a response, before its first anchor (a response's
    # first token can only be the label of a block anchored in the prompt): within one stratum of it.
    plan, loss_mask = _plan(0, "stratified", block_size=block_size)
    docs = plan.document_ids[0]
    mask = loss_mask[0]
    width = -(-int(eligible_anchor_positions(loss_mask_BT=loss_mask, document_ids_BT=plan.document_ids,
                                             block_size=block_size).sum()) // _ANCHORS)
    covered = torch.zeros_like(mask)
    covered[plan.label_positions()[0][plan.label_valid[0]]] = True
    starts = torch.nonzero(mask[1:] & ~mask[:-1]).squeeze(1) + 1
    for missed in torch.nonzero(mask & ~covered).squeeze(1).tolist():
        start = starts[starts <= missed].max().item()
        assert docs[start] == docs[missed] and missed - start <= width, (missed, start, width)
    # Anchors in prompts reach those too (and the labels get the target's argmax there).
    assert label_coverage(*_plan(0, "stratified", block_size=block_size, prompt_anchors=True)) > 0.999


def test_one_anchor_per_stratum_and_the_uniform_samplers_invariants():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        seq_len = int(torch.randint(3, 90, (1,), generator=generator))
        eligible = torch.rand(2, seq_len, generator=generator) < torch.rand(1, generator=generator)
        num_anchors = int(torch.randint(1, 40, (1,), generator=generator))
        anchors, valid = sample_anchors(eligible_BT=eligible, num_anchors=num_anchors, generator=generator,
                                        sampling="stratified")
        assert anchors.shape == valid.shape == (2, num_anchors)
        for row in range(2):
            positions = eligible[row].nonzero().squeeze(1).tolist()
            count = len(positions)
            picked = anchors[row][valid[row]].tolist()
            assert valid[row].tolist() == [i < count for i in range(num_anchors)]  # valid first, then padding
            assert (anchors[row][~valid[row]] == 0).all()
            assert picked == sorted(set(picked)) and set(picked) <= set(positions)
            assert len(picked) == min(num_anchors, count)
            if count >= num_anchors:  # anchor i holds an eligible rank of stratum i
                ranks = [positions.index(p) for p in picked]
                for i, rank in enumerate(ranks):
                    assert -(-i * count // num_anchors) <= rank < -(-(i + 1) * count // num_anchors), (trial, i)


def test_every_eligible_position_can_be_drawn_and_documents_get_their_share():
    eligible = torch.zeros(1, 40, dtype=torch.bool)
    eligible[0, 3:13] = True  # 10 eligible positions, 4 anchors: strata of 2 or 3
    drawn = set()
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        anchors, _ = sample_anchors(eligible_BT=eligible, num_anchors=4, generator=generator, sampling="stratified")
        drawn.update(anchors[0].tolist())
    assert drawn == set(range(3, 13))
    # Per document, anchors follow its eligible positions within 2 (uniform sampling: binomial spread).
    loss_mask, positions = packed_row(3)
    docs = document_ids_from_positions(positions)
    plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=_ANCHORS, block_size=8, position_ids_BT=positions,
                       generator=torch.Generator().manual_seed(3), anchor_sampling="stratified")
    rule = eligible_anchor_positions(loss_mask_BT=loss_mask, document_ids_BT=docs, block_size=8)
    total = rule.sum().item()
    for doc in docs[0][rule[0]].unique().tolist():
        share = _ANCHORS * (rule[0] & (docs[0] == doc)).sum().item() / total
        got = (docs[0][plan.anchors[0][plan.anchor_valid[0]]] == doc).sum().item()
        assert abs(got - share) <= 2, (doc, got, share)


def test_refuses_an_unknown_sampling_and_a_step_trains_on_stratified_plans():
    with pytest.raises(ValueError, match="anchor sampling must be one of"):
        sample_anchors(eligible_BT=torch.ones(1, 8, dtype=torch.bool), num_anchors=2, sampling="document")
    from dflash_core.model import DFlashConfig
    from dflash_core.model.dflash2 import DFlash2Config
    from dflash_core.model.loss_spec import LossSpec
    from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config
    from dflash_core.train.config import DrafterSettings
    from dflash_core.train.step import drafter_step

    assert DrafterSettings().anchor_sampling == "uniform"
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config)
    base = DFlashConfig.from_target(target_config, num_layers=1, block_size=4, num_tapped_layers=1)
    config = DFlash2Config.from_dflash(base, conv_group_size=16, selector_rank=8, selector_top_k=4)
    drafter = build_drafter(config, loss=LossSpec(loss_weighting="dpace"))
    drafter.attach_target(target_heads(target))
    loss_mask, positions = packed_row(0, budget=64)
    input_ids = torch.randint(1, 200, (1, 64))
    captured = HiddenStateCapture(target, layer_ids=base.target_layer_ids, capture_final=True)(input_ids,
                                                                                               position_ids=positions)
    tensors = {"input_ids": input_ids, "position_ids": positions, "loss_mask": loss_mask}
    metrics = drafter_step(drafter, tensors=tensors, captured=captured, num_anchors=8, block_size=4, teacher=True,
                           generator=torch.Generator().manual_seed(0), device=torch.device("cpu"),
                           attention_backend="sdpa", loss_scale=1.0, anchor_sampling="stratified")
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert torch.isfinite(metrics["loss"]) and grads and all(torch.isfinite(g).all() for g in grads)
