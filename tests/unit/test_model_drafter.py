"""The drafter end to end on tiny targets: gradients, state_dict, overfitting, drafting with a cache.

Run: .venv/bin/python -m pytest tests/unit/test_model_drafter.py -q
"""

import warnings

import pytest
import torch

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.anchors import BlockPlan
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config

_SEQ = 40


def _setup(family: str, *, block_size: int = 4, layer_types=None, sliding_window=None, seed: int = 0):
    torch.manual_seed(seed)
    target_config = tiny_target_config(family, num_layers=8 if family == "qwen3_5" else 6)
    target = build_target(target_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(
            target_config, num_layers=2, block_size=block_size, num_tapped_layers=2,
            layer_types=layer_types, sliding_window=sliding_window,
        )
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0))
    drafter.attach_target(target_heads(target))
    input_ids = torch.randint(1, target_config.vocab_size, (2, _SEQ))
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    plan = plan_blocks(
        loss_mask_BT=torch.ones(2, _SEQ, dtype=torch.bool), num_anchors=8, block_size=block_size,
        generator=torch.Generator().manual_seed(seed),
    )
    return target, drafter, input_ids, captured, plan


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_gradients_reach_the_drafter_only(family):
    target, drafter, input_ids, captured, plan = _setup(family)
    _, loss, metrics = drafter(
        input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan, teacher_hidden=captured.final_hidden
    )
    loss.backward()
    assert torch.isfinite(loss) and set(metrics) >= {"loss", "accuracy_per_position", "acceptance_length"}
    assert all(p.grad is None for p in target.parameters())
    for name, parameter in drafter.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_target_heads_are_borrowed_not_owned():
    target, drafter, *_ = _setup("llama")
    keys = drafter.state_dict().keys()
    assert not any("embed" in key or "lm_head" in key for key in keys)
    target_ids = {id(p) for p in target.parameters()}
    assert not target_ids & {id(p) for p in drafter.parameters()}
    assert {key.split(".")[0] for key in keys} == {"fc", "hidden_norm", "layers", "norm"}


def test_metrics_stay_on_device_as_tensors():
    _, drafter, input_ids, captured, plan = _setup("qwen3")
    _, _, metrics = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan)
    assert all(isinstance(value, torch.Tensor) for value in metrics.values())
    assert metrics["accuracy_per_position"].shape == (3,)


@pytest.mark.parametrize("teacher", [True, False])
def test_tiny_drafter_overfits_a_fixed_batch(teacher):
    _, drafter, input_ids, captured, plan = _setup("qwen3")
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    teacher_hidden = captured.final_hidden if teacher else None
    losses = []
    for _ in range(140):
        _, loss, metrics = drafter(
            input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan, teacher_hidden=teacher_hidden
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10
    assert metrics["accuracy_per_position"][0] > 0.95
    assert metrics["acceptance_length"] > 3.0  # of at most 4 = block size


def test_teacher_labels_are_the_targets_argmax_at_the_previous_position():
    target, drafter, input_ids, captured, plan = _setup("llama")
    output, _, _ = drafter(
        input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan, teacher_hidden=captured.final_hidden
    )
    argmax = target(input_ids).logits.argmax(-1)
    for row in range(2):
        for slot, anchor in enumerate(plan.anchors[row].tolist()):
            valid = plan.label_valid[row, slot]
            expected = argmax[row, anchor : anchor + 3]  # position p+k-1 predicts token p+k
            assert valid[0]  # slot 1 always learns
            assert torch.equal(output.labels_BAK[row, slot][valid], expected[: len(valid)][valid])
    per_slot = BlockPlan(**{**plan.__dict__, "teacher_index": None})  # the dedup path must agree
    again, _, _ = drafter(
        input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=per_slot, teacher_hidden=captured.final_hidden
    )
    assert torch.equal(again.labels_BAK, output.labels_BAK)


@pytest.mark.parametrize(
    ("family", "layer_types", "window"),
    [("qwen3", None, None), ("llama", ["sliding_attention", "full_attention"], 8), ("qwen3_5", None, None)],
)
def test_drafting_with_a_cache_matches_training(family, layer_types, window):
    """The block the evaluator drafts after accepting token p equals the training block anchored at p."""
    _, drafter, input_ids, captured, plan = _setup(family, layer_types=layer_types, sliding_window=window)
    anchor = 30
    one_block = BlockPlan(
        anchors=torch.tensor([[anchor]]), anchor_valid=torch.tensor([[True]]),
        label_valid=torch.ones(1, 1, 3, dtype=torch.bool), document_ids=plan.document_ids[:1],
        position_ids=plan.position_ids[:1], block_size=4,
    )
    with torch.no_grad():
        trained, _, _ = drafter(input_ids=input_ids[:1], target_hidden=captured.tapped_hidden[:1], plan=one_block)
        training_logits = drafter.target_heads.lm_head(trained.hidden_BAKH[0, 0])
    cache = drafter.new_cache()
    # Context beyond the anchor (as after verifying a longer draft), then cropped back.
    drafter.extend_context(
        cache, target_hidden=captured.tapped_hidden[:1, : anchor + 5], position_ids=torch.arange(anchor + 5)[None]
    )
    cache.crop(anchor)
    drafted = drafter.draft_block(cache, last_token_ids=input_ids[:1, anchor], position_ids=torch.tensor([anchor]))
    torch.testing.assert_close(drafted[0], training_logits, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError):
        cache.crop(anchor + 1)


def test_wrong_feature_width_is_a_value_error():
    _, drafter, input_ids, captured, plan = _setup("qwen3")
    with pytest.raises(ValueError, match="features"):
        drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden[..., :-1], plan=plan)
