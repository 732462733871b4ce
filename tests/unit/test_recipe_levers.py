"""Training-only recipe levers (feature noise, dropout, label smoothing), in the drafter's LossSpec: off
by default and a no-op when off, on they change the training step but never drafting or exports, and a
step's seed fixes them.

Run: .venv/bin/python -m pytest tests/unit/test_recipe_levers.py -q
"""


import pytest
import torch
import torch.nn.functional as F

from dflash_core.export import build_export_configs
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.dflash2 import DFlash2Config, draft_tokens
from dflash_core.model.dflash2_loss import dflash2_objective
from dflash_core.model.loss import chunked_lm_head_loss
from dflash_core.model.regularize import dropout_masks, noisy_features
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config
from dflash_core.train.config import DrafterSettings, TrainConfig
from dflash_core.train.step import drafter_step, regularization_generator

_SEQ, _BLOCK, _VOCAB = 40, 4, 256
_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
_LEVERS = {"feature_noise": 0.2, "dropout": 0.1, "label_smoothing": 0.1}
REGULARIZATION_FIELDS = tuple(_LEVERS)


@pytest.fixture(scope="module")
def world():
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config)
    input_ids = torch.randint(1, _VOCAB, (1, _SEQ))
    base = DFlashConfig.from_target(target_config, num_layers=2, block_size=_BLOCK, num_tapped_layers=2)
    captured = HiddenStateCapture(target, layer_ids=base.target_layer_ids, capture_final=True)(input_ids)
    tensors = {"input_ids": input_ids, "position_ids": torch.arange(_SEQ)[None],
               "loss_mask": torch.ones(1, _SEQ, dtype=torch.bool), "document_ids": torch.zeros(1, _SEQ, dtype=torch.long)}
    return target, target_config, base, captured, tensors


def _config(base: DFlashConfig, variant: str) -> DFlashConfig:
    return DFlash2Config.from_dflash(base, **_DFLASH2) if variant == "dflash2" else base


def _drafter(world, variant: str, **levers):
    target, _, base, _, _ = world
    torch.manual_seed(3)
    drafter = build_drafter(_config(base, variant), loss=LossSpec(loss_weighting="dpace", loss_gamma=2.0, **levers))
    with torch.no_grad():  # off the identity init, so every module's gradient is exercised
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(7)))
    drafter.attach_target(target_heads(target))
    return drafter


def _step(world, drafter, *, seed: int = 0):
    _, _, _, captured, tensors = world
    generator = torch.Generator().manual_seed(seed)
    metrics = drafter_step(drafter, tensors=tensors, captured=captured, num_anchors=8, block_size=_BLOCK, teacher=True,
                           generator=generator, device=torch.device("cpu"), attention_backend="sdpa", loss_scale=1.0)
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return metrics["loss"], grads, generator.get_state()


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_levers_are_off_by_default():
    settings = DrafterSettings()
    assert all(getattr(settings, name) == 0 for name in REGULARIZATION_FIELDS)
    spec = settings.loss_spec()
    assert {name: getattr(spec, name) for name in REGULARIZATION_FIELDS} == dict.fromkeys(REGULARIZATION_FIELDS, 0.0)
    assert spec.loss_weighting == "dpace" and not spec.stochastic and not LossSpec().stochastic


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_off_is_the_plain_step_and_draws_nothing(world, variant):
    """Levers at 0: the step equals a direct forward without a generator, bit for bit, and the step
    generator is left where the anchor plan left it."""
    drafter = _drafter(world, variant)
    assert regularization_generator(drafter, generator=torch.Generator(), device=torch.device("cpu")) is None
    loss, grads, state = _step(world, drafter)
    _, _, _, captured, tensors = world
    from dflash_core.model import plan_blocks

    generator = torch.Generator().manual_seed(0)
    plan = plan_blocks(loss_mask_BT=tensors["loss_mask"], num_anchors=8, block_size=_BLOCK,
                       position_ids_BT=tensors["position_ids"], generator=generator, with_teacher_index=True)
    _, direct_loss, _ = drafter(input_ids=tensors["input_ids"], target_hidden=captured.tapped_hidden, plan=plan,
                                teacher_hidden=captured.final_hidden, attention_backend="sdpa")
    direct_loss.backward()
    direct = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    assert _same((loss, grads), (direct_loss.detach(), direct))
    assert torch.equal(state, generator.get_state())


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("lever", sorted(_LEVERS))
def test_each_lever_changes_training_and_is_fixed_by_the_seed(world, variant, lever):
    off = _step(world, _drafter(world, variant))
    drafter = _drafter(world, variant, **{lever: _LEVERS[lever]})
    on = _step(world, drafter, seed=0)
    assert not _same(off, on)
    assert _same(on, _step(world, drafter, seed=0))  # same step seed: same anchors, noise and masks
    if lever != "label_smoothing":  # noise and dropout draw from the step's generator, after the anchors
        seeds = {int(regularization_generator(drafter, generator=torch.Generator().manual_seed(seed),
                                              device=torch.device("cpu")).initial_seed()) for seed in (0, 0, 1)}
        assert len(seeds) == 2


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_levers_leave_drafting_eval_mode_and_exports_alone(world, variant):
    target, target_config, _, captured, tensors = world
    plain, regularized = _drafter(world, variant), _drafter(world, variant, **_LEVERS)
    assert regularized.loss.stochastic
    caches = []
    for drafter in (plain, regularized):  # evaluation: a cache over the context, then one block
        caches.append(drafter.new_cache())
        drafter.extend_context(caches[-1], target_hidden=captured.tapped_hidden[:, :20],
                               position_ids=torch.arange(20)[None])
    kwargs = dict(last_token_ids=tensors["input_ids"][:, 20], position_ids=torch.tensor([20]))
    assert torch.equal(plain.draft_block(caches[0], **kwargs), regularized.draft_block(caches[1], **kwargs))
    assert torch.equal(draft_tokens(plain, caches[0], **kwargs), draft_tokens(regularized, caches[1], **kwargs))
    # forward in eval mode: no noise, no dropout (label smoothing changes only the loss value)
    from dflash_core.model import plan_blocks

    plan = plan_blocks(loss_mask_BT=tensors["loss_mask"], num_anchors=8, block_size=_BLOCK,
                       generator=torch.Generator().manual_seed(0))
    outputs = []
    for drafter in (plain, regularized):
        drafter.eval()
        out, _, _ = drafter(input_ids=tensors["input_ids"], target_hidden=captured.tapped_hidden, plan=plan,
                            teacher_hidden=captured.final_hidden, attention_backend="sdpa",
                            generator=torch.Generator().manual_seed(1))
        outputs.append(out.hidden_BAKH)
        drafter.train()
    assert torch.equal(*outputs)
    exported = [build_export_configs(d.config, target_config=target_config, verifier_name_or_path="target",
                                     dtype=torch.float32, formats=("native",), loss=d.loss) for d in (plain, regularized)]
    assert exported[0] == exported[1]
    assert not set(REGULARIZATION_FIELDS) & set(regularized.config.to_dict())
    assert not set(REGULARIZATION_FIELDS) & set(exported[1]["native"]["dflash_config"])


def test_feature_noise_is_relative_to_each_state():
    torch.manual_seed(0)
    hidden = torch.cat((torch.randn(2, 500, 64), 30 * torch.randn(2, 500, 64)), dim=-1)  # two layers, 30x apart
    noisy = noisy_features(hidden, num_layers=2, scale=0.1, generator=torch.Generator().manual_seed(0))
    noise = (noisy - hidden).view(2, 500, 2, 64)
    rms = hidden.view(2, 500, 2, 64).square().mean(-1, keepdim=True).sqrt()
    ratio = (noise / rms).std(dim=(0, 1, 3))
    assert torch.allclose(ratio, torch.full((2,), 0.1), rtol=0.05)
    again = noisy_features(hidden, num_layers=2, scale=0.1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(noisy, again)


def test_dropout_masks_keep_the_expected_value():
    masks = dropout_masks(shape=(4, 256, 64), rate=0.25, num_layers=3, generator=torch.Generator().manual_seed(0),
                          device=torch.device("cpu"))
    assert len(masks) == 3 and all(len(pair) == 2 for pair in masks)
    mask = masks[0][0]
    assert mask.unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert (mask == 0).float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert mask.mean().item() == pytest.approx(1.0, abs=0.02)
    assert not torch.equal(masks[0][0], masks[0][1])


@pytest.mark.parametrize("dpace", [False, True])
def test_label_smoothing_matches_torch_cross_entropy(dpace):
    torch.manual_seed(0)
    rows, hidden_size, vocab, smoothing = 12, 16, 50, 0.1
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size)
    labels = torch.randint(0, vocab, (rows,))
    valid = torch.ones(rows, dtype=torch.bool)
    valid[5] = False
    token_weights = torch.rand(rows)
    out = chunked_lm_head_loss(hidden, lm_head_weight=weight, valid_N=valid, labels_N=labels, chunk_size=5,
                               label_smoothing=smoothing,
                               **({"dpace_alpha": 0.5, "num_slots": 3} if dpace else {"token_weights_N": token_weights}))
    out.loss.backward()
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    logits = reference_hidden @ weight.T
    smoothed = F.cross_entropy(logits, labels, reduction="none", label_smoothing=smoothing)
    if dpace:
        from dflash_core.model.loss import dpace_weights

        nll = F.cross_entropy(logits, labels, reduction="none").detach()
        scale = dpace_weights(nll.view(-1, 3), valid.view(-1, 3), alpha=0.5).flatten() / valid.sum()
    else:
        scale = token_weights * valid / (token_weights * valid).sum()
    reference = (scale * smoothed).sum()
    reference.backward()
    assert out.loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(hidden.grad, reference_hidden.grad, atol=1e-6)


def test_dflash2_label_smoothing_smooths_the_unary_loss_only():
    torch.manual_seed(0)
    rows, hidden_size, vocab, smoothing = 8, 16, 40, 0.2
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size)
    labels = torch.randint(0, vocab, (rows,))
    token_weights = torch.rand(rows)

    class _NoSelector(torch.nn.Module):  # the unary loss alone (alpha 0 below)
        top_k = 4

        def context(self, hidden_NH, predecessors_N):
            return hidden_NH[:, :2] * 0

        def transition_scores(self, context_NR, candidates_NK):
            return torch.zeros(candidates_NK.shape)

    objective = dflash2_objective(hidden, lm_head_weight=weight, selector=_NoSelector(), labels_N=labels,
                                  predecessor_ids_N=labels, token_weights_N=token_weights, selector_loss_weight=0.0,
                                  chunk_size=3, label_smoothing=smoothing)
    objective.loss.backward()
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    smoothed = F.cross_entropy(reference_hidden @ weight.T, labels, reduction="none", label_smoothing=smoothing)
    reference = (token_weights / token_weights.sum() * smoothed).sum()
    reference.backward()
    assert objective.dflash_loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(hidden.grad, reference_hidden.grad, atol=1e-6)


def test_settings_refuse_what_cannot_apply():
    with pytest.raises(ValueError, match="label_smoothing"):
        DrafterSettings(variant="dflash", loss_type="kl", label_smoothing=0.1)
    with pytest.raises(ValueError):
        DrafterSettings(dropout=1.0)
    with pytest.raises(ValueError):
        DrafterSettings(feature_noise=-0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        LossSpec(loss_type="kl", label_smoothing=0.1)
    with pytest.raises(ValueError, match="dropout"):
        LossSpec(dropout=1.0)


def test_every_train_config_field_is_described_for_the_ui():
    from dflash_core.train.config import OptimSettings

    for model in (TrainConfig, DrafterSettings, OptimSettings):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert "<" not in field.description and ">" not in field.description, f"{model.__name__}.{name}"


def test_the_trainer_builds_the_drafter_with_the_levers(world):
    from dflash_core.train.drafter_setup import drafter_config_for

    _, target_config, _, _, _ = world
    config = TrainConfig(target="tiny:qwen3", data=["x"], drafter={"num_layers": 2, "block_size": 4,
                                                                   "loss_gamma": 2.0, **_LEVERS})
    built = drafter_config_for(config, target_config=target_config)
    assert not set(REGULARIZATION_FIELDS) & set(built.to_dict())  # the architecture only
    spec = config.drafter.loss_spec()
    assert {name: getattr(spec, name) for name in REGULARIZATION_FIELDS} == _LEVERS and spec.loss_gamma == 2.0
