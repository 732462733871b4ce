"""DFlash 2 on tiny targets: identity init, block-local convolution, the selector loss against a
direct computation, gradients, serving-faithful metrics, drafting, config and export round trips.

Run: .venv/bin/python -m pytest tests/unit/test_dflash2.py -q
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.anchors import BlockPlan
from dflash_core.model.dflash2 import (
    CandidateSelector,
    DFlash2Config,
    DFlash2DraftModel,
    config_from_dict,
    draft_tokens,
    drafter_config,
)
from dflash_core.model.dynamic_conv import grouped_dynamic_causal_conv
from dflash_core.export import export_drafter, load_drafter
from dflash_core.model.dflash2_loss import dflash2_objective, transform_logits
from dflash_core.model.loss import dpace_weights
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config

_SEQ, _BLOCK, _VOCAB = 40, 4, 256
_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def _setup(*, seed: int = 0, num_anchors: int = 8, **dflash2_fields):
    torch.manual_seed(seed)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config)
    config = DFlash2Config.from_target(
        target_config,
        num_layers=2,
        block_size=_BLOCK,
        num_tapped_layers=2,
        **{**_DFLASH2, **dflash2_fields},
    )
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0))
    drafter.attach_target(target_heads(target))
    input_ids = torch.randint(1, _VOCAB, (2, _SEQ))
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    plan = plan_blocks(
        loss_mask_BT=torch.ones(2, _SEQ, dtype=torch.bool),
        num_anchors=num_anchors,
        block_size=_BLOCK,
        generator=torch.Generator().manual_seed(seed),
    )
    return target, drafter, input_ids, captured, plan


def _perturb(module: torch.nn.Module, *, scale: float = 0.1, seed: int = 1) -> None:
    """Move every parameter off its init (identity convs, unit norms) so nothing is trivially equal."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


def _run(drafter, input_ids, captured, plan, **kwargs):
    return drafter(
        input_ids=input_ids,
        target_hidden=captured.tapped_hidden,
        plan=plan,
        teacher_hidden=captured.final_hidden,
        **kwargs,
    )


def test_fresh_dflash2_computes_what_dflash_computes():
    target, drafter, input_ids, captured, plan = _setup()
    base = build_drafter(DFlashConfig(
        **{f.name: getattr(drafter.config, f.name) for f in dataclasses.fields(DFlashConfig)}
    ), loss=drafter.loss)
    shared = {k: v for k, v in drafter.state_dict().items() if k in base.state_dict()}
    base.load_state_dict(shared, strict=True)
    base.attach_target(target_heads(target))
    with torch.no_grad():
        out2, _, metrics2 = _run(drafter, input_ids, captured, plan)
        out1, loss1, _ = _run(base, input_ids, captured, plan)
    assert torch.equal(out2.hidden_BAKH, out1.hidden_BAKH)
    torch.testing.assert_close(metrics2["dflash_loss"], loss1)
    cache1, cache2 = base.new_cache(), drafter.new_cache()
    for model, cache in ((base, cache1), (drafter, cache2)):
        model.extend_context(
            cache, target_hidden=captured.tapped_hidden[:1, :20], position_ids=torch.arange(20)[None]
        )
    kwargs = dict(last_token_ids=input_ids[:1, 20], position_ids=torch.tensor([20]))
    assert torch.equal(drafter.draft_block(cache2, **kwargs), base.draft_block(cache1, **kwargs))


def test_conv_taps_stay_inside_their_block_and_look_back_only():
    torch.manual_seed(0)
    batch, blocks, block, hidden, group, kernel = 2, 3, 4, 32, 8, 3
    x = torch.randn(batch, blocks * block, hidden)
    delta = torch.randn(batch, blocks * block, kernel, hidden // group)
    base = torch.randn(kernel, hidden)
    out = grouped_dynamic_causal_conv(x, delta, base, block_size=block, group_size=group)
    # Direct loop: out[t] = sum_j (base[j] + delta[t, j, g]) * x[t-j] for t-j in t's block.
    expected = torch.zeros_like(x)
    for t in range(blocks * block):
        for j in range(kernel):
            if t % block - j < 0:
                continue
            coefficient = base[j] + delta[:, t, j].repeat_interleave(group, dim=-1)
            expected[:, t] += coefficient * x[:, t - j]
    torch.testing.assert_close(out, expected)
    changed = x.clone()
    changed[:, block : 2 * block] += 1.0  # block 1
    again = grouped_dynamic_causal_conv(changed, delta, base, block_size=block, group_size=group)
    assert torch.equal(again[:, :block], out[:, :block]) and torch.equal(
        again[:, 2 * block :], out[:, 2 * block :]
    )
    changed = x.clone()
    changed[:, block + 2] += 1.0  # slot 2 of block 1: slots 0, 1 of that block keep their output
    again = grouped_dynamic_causal_conv(changed, delta, base, block_size=block, group_size=group)
    assert torch.equal(again[:, : block + 2], out[:, : block + 2])
    assert not torch.equal(again[:, block + 2], out[:, block + 2])


def test_training_blocks_do_not_see_each_other_and_equal_drafted_blocks():
    """Perturb block j's anchor token: block i is unchanged. Each training block equals what the
    drafter drafts with a cache after accepting its anchor."""
    _, drafter, input_ids, captured, _ = _setup()
    _perturb(drafter)
    anchors = [5, 9, 20, 30]  # laid out back to back; blocks 0 and 1 are also adjacent in the text
    plan = BlockPlan.at_anchors(anchors, seq_len=_SEQ, block_size=_BLOCK)
    with torch.no_grad():
        out, _, _ = drafter(input_ids=input_ids[:1], target_hidden=captured.tapped_hidden[:1], plan=plan)
        changed_ids = input_ids[:1].clone()
        changed_ids[0, 9] = (changed_ids[0, 9] + 1) % _VOCAB  # block 1's anchor (context features are fixed)
        again, _, _ = drafter(input_ids=changed_ids, target_hidden=captured.tapped_hidden[:1], plan=plan)
    assert torch.equal(again.hidden_BAKH[:, [0, 2, 3]], out.hidden_BAKH[:, [0, 2, 3]])
    assert not torch.equal(again.hidden_BAKH[:, 1], out.hidden_BAKH[:, 1])
    for slot, anchor in enumerate(anchors):
        cache = drafter.new_cache()
        drafter.extend_context(
            cache, target_hidden=captured.tapped_hidden[:1, :anchor], position_ids=torch.arange(anchor)[None]
        )
        drafted = drafter.draft_hidden(
            cache, last_token_ids=input_ids[:1, anchor], position_ids=torch.tensor([anchor])
        )
        torch.testing.assert_close(drafted[0], out.hidden_BAKH[0, slot], atol=1e-5, rtol=1e-4)


def _reference_objective(
    hidden, weight, selector, labels, predecessors, token_weights, *, multiplier, softcap, alpha
):
    """Full-vocabulary logits, the textbook way: the thing the chunked objective must equal."""
    logits = transform_logits(hidden @ weight.T, multiplier=multiplier, softcap=softcap)
    ce = F.cross_entropy(logits, labels, reduction="none")
    dflash = (token_weights * ce).sum() / token_weights.sum()
    candidates = logits.topk(selector.top_k, dim=-1).indices
    present = (candidates == labels[:, None]).any(-1)
    candidates[:, -1] = torch.where(present, candidates[:, -1], labels)
    unary = logits.gather(1, candidates)
    pred = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)
    transition = torch.einsum("nr,nkr->nk", pred, selector.successor_codebook[candidates])
    target_index = torch.stack(
        [(row == label).nonzero()[0, 0] for row, label in zip(candidates, labels, strict=True)]
    )
    selector_ce = F.cross_entropy(unary + transition, target_index, reduction="none")
    return dflash + alpha * (token_weights * selector_ce).sum() / token_weights.sum(), present


@pytest.mark.parametrize("vocab", [_VOCAB, 5000])  # 5,000: the grouped top-K, on the loss kernel's maxima
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.7, 3.0)])
def test_selector_loss_and_gradients_match_a_direct_computation(multiplier, softcap, vocab):
    torch.manual_seed(0)
    num, hidden_size, top_k = 23, 16, 5
    weight = torch.randn(vocab, hidden_size)
    selector = CandidateSelector(vocab_size=vocab, hidden_size=hidden_size, rank=6, top_k=top_k)
    selector.reset_parameters(std=0.5)
    hidden = torch.randn(num, hidden_size, requires_grad=True)
    logits = hidden.detach() @ weight.T
    labels = torch.randint(0, vocab, (num,))
    labels[:8] = logits[:8].topk(3, dim=-1).indices[:, 2]  # some labels among the top-K, others injected
    predecessors = torch.randint(0, vocab, (num,))
    token_weights = torch.rand(num)
    token_weights[3] = 0.0
    args = dict(multiplier=multiplier, softcap=softcap, alpha=0.6)
    expected, present = _reference_objective(
        hidden, weight, selector, labels, predecessors, token_weights, **args
    )
    assert 0 < present.sum() < num
    expected_grads = torch.autograd.grad(expected, [hidden, *selector.parameters()])
    objective = dflash2_objective(
        hidden,
        lm_head_weight=weight,
        selector=selector,
        labels_N=labels,
        predecessor_ids_N=predecessors,
        token_weights_N=token_weights,
        output_multiplier=multiplier,
        softcap=softcap,
        selector_loss_weight=0.6,
        chunk_size=7,  # uneven chunks
    )
    torch.testing.assert_close(objective.loss, expected)
    assert torch.equal(objective.label_in_top_k, present)
    grads = torch.autograd.grad(objective.loss, [hidden, *selector.parameters()])
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_dpace_weights_both_losses_as_the_base_drafter_does():
    """D-PACE: slot weights from the unary NLL (no gradient through them), both losses over the
    number of slots with loss, exactly as a direct computation with `dpace_weights`."""
    torch.manual_seed(1)
    slots, blocks, hidden_size = 4, 6, 16
    num = slots * blocks
    weight = torch.randn(_VOCAB, hidden_size)
    selector = CandidateSelector(vocab_size=_VOCAB, hidden_size=hidden_size, rank=6, top_k=5)
    selector.reset_parameters(std=0.5)
    hidden = torch.randn(num, hidden_size, requires_grad=True)
    labels = torch.randint(0, _VOCAB, (num,))
    predecessors = torch.randint(0, _VOCAB, (num,))
    valid = torch.ones(num)
    valid[[3, 7, 10, 11]] = 0.0

    logits = hidden @ weight.T
    ce = F.cross_entropy(logits, labels, reduction="none")
    weights = dpace_weights(ce.detach().view(blocks, slots), valid.bool().view(blocks, slots), alpha=0.4).flatten()
    candidates = logits.topk(5, dim=-1).indices
    present = (candidates == labels[:, None]).any(-1)
    candidates[:, -1] = torch.where(present, candidates[:, -1], labels)
    pred = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)
    scores = logits.gather(1, candidates) + torch.einsum("nr,nkr->nk", pred, selector.successor_codebook[candidates])
    target_index = (candidates == labels[:, None]).long().argmax(-1)
    selector_ce = F.cross_entropy(scores, target_index, reduction="none")
    expected = ((weights * ce).sum() + 0.6 * (weights * selector_ce).sum()) / valid.sum()

    objective = dflash2_objective(
        hidden, lm_head_weight=weight, selector=selector, labels_N=labels, predecessor_ids_N=predecessors,
        token_weights_N=valid, selector_loss_weight=0.6, chunk_size=7, dpace_alpha=0.4, num_slots=slots,
    )
    torch.testing.assert_close(objective.loss, expected)
    grads = torch.autograd.grad(objective.loss, [hidden, *selector.parameters()])
    expected_grads = torch.autograd.grad(expected, [hidden, *selector.parameters()])
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_gradients_reach_every_drafter_parameter_and_no_target_parameter():
    target, drafter, input_ids, captured, plan = _setup(output_multiplier=0.8, final_logit_softcapping=5.0)
    _, loss, metrics = _run(drafter, input_ids, captured, plan, loss_chunk_size=13)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is None for p in target.parameters())
    names = [name for name, _ in drafter.named_parameters()]
    assert {"candidate_selector.predecessor_codebook", "layers.1.mlp_conv.kernel_projection.weight"} <= set(
        names
    )
    for name, parameter in drafter.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_selector_acceptance_metric_is_the_greedy_paths_own_acceptance():
    """The metric (teacher-forced predecessors, serving candidates) must equal what walking the
    selector greedily from each anchor and comparing with the labels gives."""
    _, drafter, input_ids, captured, plan = _setup(num_anchors=12, selector_top_k=16)
    _perturb(drafter.candidate_selector, scale=0.3)
    with torch.no_grad():
        out, _, metrics = _run(drafter, input_ids, captured, plan)
        batch, anchors = plan.anchors.shape
        hidden = out.hidden_BAKH.reshape(batch * anchors, _BLOCK - 1, -1)
        anchor_ids = input_ids.gather(1, plan.anchors).flatten()
        path, _ = drafter.candidate_selector.greedy_path(hidden, drafter.unary_logits(hidden), anchor_ids)
    matches = (path == out.labels_BAK.reshape(batch * anchors, -1)) & plan.label_valid.reshape(
        batch * anchors, -1
    )
    run = matches.long().cumprod(-1).sum(-1).float()
    valid = plan.anchor_valid.flatten().float()
    expected = 1 + (run * valid).sum() / valid.sum()
    torch.testing.assert_close(metrics["selector_acceptance_length"], expected)
    argmax_differs = (path != drafter.unary_logits(hidden).argmax(-1)).any()
    assert argmax_differs  # the selector changes proposals here, so the check is not the unary one
    assert 0 <= metrics["selector_accuracy"] <= metrics["unary_topk_recall"] <= 1


def test_tiny_dflash2_learns_a_fixed_batch():
    _, drafter, input_ids, captured, plan = _setup()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    first = None
    for _ in range(100):
        _, loss, metrics = _run(drafter, input_ids, captured, plan)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first if first is not None else metrics
    assert metrics["loss"] < first["loss"] / 5
    assert metrics["unary_topk_recall"] > 0.95
    assert metrics["selector_acceptance_length"] > 3.0  # of at most 4 = block size


def test_draft_tokens_walk_the_selector_from_the_anchor():
    _, drafter, input_ids, captured, _ = _setup()
    _perturb(drafter)
    cache = drafter.new_cache()
    drafter.extend_context(
        cache, target_hidden=captured.tapped_hidden[:, :20], position_ids=torch.arange(20)[None].expand(2, -1)
    )
    kwargs = dict(last_token_ids=input_ids[:, 20], position_ids=torch.tensor([20, 20]))
    tokens = draft_tokens(drafter, cache, **kwargs)
    hidden = drafter.draft_hidden(cache, **kwargs)
    unary = drafter.unary_logits(hidden)
    selector = drafter.candidate_selector
    predecessor = input_ids[:, 20]
    for slot in range(_BLOCK - 1):  # one slot at a time, by hand
        values, candidates = unary[:, slot].topk(selector.top_k, dim=-1)
        scores = values + selector.transition_scores(
            selector.context(hidden[:, slot], predecessor), candidates
        )
        predecessor = candidates.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
        assert torch.equal(tokens[:, slot], predecessor)
    base = build_drafter(DFlashConfig.from_target(
        tiny_target_config("qwen3"), num_layers=2, block_size=_BLOCK, num_tapped_layers=2
    ))
    base.attach_target(drafter.target_heads)
    base_cache = base.new_cache()
    base.extend_context(
        base_cache,
        target_hidden=captured.tapped_hidden[:, :20],
        position_ids=torch.arange(20)[None].expand(2, -1),
    )
    assert torch.equal(
        draft_tokens(base, base_cache, **kwargs), base.draft_block(base_cache, **kwargs).argmax(-1)
    )


def test_config_validation_variants_and_round_trips():
    target_config = tiny_target_config("qwen3")
    base = DFlashConfig.from_target(
        target_config, num_layers=2, block_size=_BLOCK, num_tapped_layers=2
    )
    config = drafter_config("dflash2", base, selector_top_k=8)
    assert isinstance(config, DFlash2Config) and config.selector_top_k == 8 and config.conv_kernel_size == 2
    assert drafter_config("dflash", base) is base
    assert config_from_dict(config.to_dict()) == config and config_from_dict(base.to_dict()) == base
    assert isinstance(build_drafter(config, device="meta"), DFlash2DraftModel)
    bad = [
        dict(conv_group_size=24),
        dict(conv_kernel_size=_BLOCK + 1),
        dict(selector_top_k=_VOCAB + 1),
        dict(output_multiplier=0.0),
        dict(final_logit_softcapping=-1.0),
        dict(selector_loss_weight=-1.0),
    ]
    for fields in bad:
        with pytest.raises(ValueError):
            DFlash2Config.from_dflash(base, **fields)
    assert build_drafter(config, device="meta", loss=LossSpec(loss_type="kl")).loss.loss_type == "kl"  # KL unary loss
    assert build_drafter(config, device="meta", loss=LossSpec(loss_weighting="dpace")).loss.loss_weighting == "dpace"
    legacy = {**config.to_dict(), "loss_type": "ce", "loss_gamma": 2.0, "dropout": 0.0}  # older checkpoints
    assert config_from_dict(legacy) == config and LossSpec.from_dict(legacy) == LossSpec(loss_gamma=2.0)
    with pytest.raises(ValueError, match="variant"):
        drafter_config("eagle3", base)
    with pytest.raises(ValueError, match="given for variant 'dflash'"):
        drafter_config("dflash", base, selector_rank=4)


def test_native_export_round_trips_and_refuses_target_weights(tmp_path):
    target, drafter, *_ = _setup(output_multiplier=0.5)
    _perturb(drafter)
    path = export_drafter(drafter, target_config=target.config, out_dir=tmp_path, formats=("native",))["native"]
    again = load_drafter(path)
    assert again.config == drafter.config
    state, loaded = drafter.state_dict(), again.state_dict()
    assert state.keys() == loaded.keys() and all(torch.equal(state[k], loaded[k]) for k in state)
    drafter.extra = torch.nn.Linear(2, 2)  # a stray module whose weights are not a drafter's
    with pytest.raises(ValueError, match="non-drafter"):
        export_drafter(drafter, target_config=target.config, out_dir=tmp_path / "bad", formats=("native",))


def test_objective_refuses_a_multiplier_that_would_flip_the_candidates():
    """The candidates are the raw logits' top-K, which is the transformed top-K only for multiplier > 0."""
    weight = torch.randn(_VOCAB, 8)
    selector = CandidateSelector(vocab_size=_VOCAB, hidden_size=8, rank=4, top_k=3)
    with pytest.raises(ValueError, match="output_multiplier must be > 0, got -1.0"):
        dflash2_objective(torch.randn(4, 8), lm_head_weight=weight, selector=selector,
                          labels_N=torch.zeros(4, dtype=torch.long), predecessor_ids_N=torch.zeros(4, dtype=torch.long),
                          token_weights_N=torch.ones(4), output_multiplier=-1.0)
