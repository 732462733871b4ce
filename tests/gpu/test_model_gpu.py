"""Drafter on CUDA: bf16 (autocast) vs fp32, flex_attention vs dense SDPA forward and backward,
compiled layers vs eager. Skipped without CUDA.

Run (CUDA machine): python3 -m pytest tests/gpu/test_model_gpu.py -q
(on a machine without pydantic add --noconftest: the shared conftest imports the settings)
"""

import warnings

import pytest
import torch

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.loss import compile_loss_kernel
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_BATCH, _SEQ, _ANCHORS = 2, 512, 24


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3", num_layers=6, hidden_size=256, vocab_size=2048)
    target = build_target(target_config, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(
            target_config, num_layers=2, block_size=16, num_tapped_layers=3,
            layer_types=["sliding_attention", "full_attention"], sliding_window=128,
        )
    input_ids = torch.randint(1, target_config.vocab_size, (_BATCH, _SEQ), device="cuda")
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    loss_mask = torch.ones(_BATCH, _SEQ, dtype=torch.bool)
    loss_mask[:, :64] = False
    plan = plan_blocks(
        loss_mask_BT=loss_mask, num_anchors=_ANCHORS, block_size=16, generator=torch.Generator().manual_seed(0)
    ).to("cuda")
    return target, config, input_ids, captured, plan


def _loss_and_grads(setup, *, backend: str, bf16: bool, compiled: bool = False):
    target, config, input_ids, captured, plan = setup
    torch.manual_seed(1)
    drafter = config.build(device="cuda")
    drafter.attach_target(target_heads(target))
    compile_loss_kernel(False)
    if compiled:
        drafter.compile_layers()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        _, loss, metrics = drafter(
            input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
            teacher_hidden=captured.final_hidden, attention_backend=backend,
        )
    loss.backward()
    compile_loss_kernel(False)
    return loss.detach(), {name: p.grad.detach().clone() for name, p in drafter.named_parameters()}, metrics


@pytest.fixture(scope="module")
def fp32_reference(setup):
    torch.backends.cuda.matmul.allow_tf32 = False
    return _loss_and_grads(setup, backend="sdpa", bf16=False)


def test_flex_matches_dense_sdpa_forward_and_backward_fp32(setup, fp32_reference):
    ref_loss, ref_grads, _ = fp32_reference
    loss, grads, _ = _loss_and_grads(setup, backend="flex", bf16=False)
    assert _relative_error(loss, ref_loss) < 1e-4
    for name, grad in grads.items():
        assert _relative_error(grad, ref_grads[name]) < 5e-3, name


def test_bf16_autocast_matches_fp32_within_bf16_tolerance(setup, fp32_reference):
    ref_loss, ref_grads, _ = fp32_reference
    loss, grads, _ = _loss_and_grads(setup, backend="flex", bf16=True)
    assert torch.isfinite(loss)
    assert _relative_error(loss, ref_loss) < 1e-2
    all_grads = torch.cat([g.flatten() for g in grads.values()])
    all_ref = torch.cat([ref_grads[n].flatten() for n in grads])
    assert _relative_error(all_grads, all_ref) < 3e-2
    for name, grad in grads.items():
        assert _relative_error(grad, ref_grads[name]) < 1e-1, name


def test_compiled_layers_match_eager_bf16(setup):
    eager_loss, eager_grads, eager_metrics = _loss_and_grads(setup, backend="flex", bf16=True)
    loss, grads, metrics = _loss_and_grads(setup, backend="flex", bf16=True, compiled=True)
    assert _relative_error(loss, eager_loss) < 1e-2
    for name, grad in grads.items():
        assert _relative_error(grad, eager_grads[name]) < 5e-2, name
    assert metrics["accuracy_per_position"].device.type == "cuda"
