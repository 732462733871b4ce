"""Drafter on CUDA: bf16 (autocast) vs fp32, flex_attention vs dense SDPA forward and backward,
compiled layers vs eager. Skipped without CUDA.

Run (CUDA machine): python3 -m pytest tests/gpu/test_model_gpu.py -q
(on a machine without pydantic add --noconftest: the shared conftest imports the settings)
"""

import warnings

import pytest
import torch

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
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
    drafter = build_drafter(config, device="cuda")
    drafter.attach_target(target_heads(target))
    if compiled:
        drafter.compile_layers()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        _, loss, metrics = drafter(
            input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
            teacher_hidden=captured.final_hidden, attention_backend=backend,
        )
    loss.backward()
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


def test_tuned_flex_backward_matches_torchs_default_config():
    """The drafter's tuned backward config (sm90, head_dim > 128) changes the tiling, not the result."""
    from dflash_core.model.masks import create_flex_block_mask, flex_attend, tuned_flex_options

    device = torch.device("cuda")
    options = tuned_flex_options(256, device) or {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                                                  "bwd_BLOCK_N2": 64, "bwd_num_stages": 2, "bwd_num_warps": 8}
    positions = torch.cat([torch.arange(300), torch.arange(212)])[None]
    plan = plan_blocks(loss_mask_BT=torch.ones_like(positions), num_anchors=_ANCHORS, block_size=16,
                       position_ids_BT=positions, generator=torch.Generator().manual_seed(0),
                       with_teacher_index=False).to(device)
    block_mask = create_flex_block_mask(plan, compile_mask=True)
    q_len = _ANCHORS * 16
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(1, heads, length, 256, device=device, dtype=torch.bfloat16, generator=generator)
              for heads, length in ((8, q_len), (2, 512 + q_len), (2, 512 + q_len))]
    grads = []
    for kernel_options in (None, options):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        flex_attend(block_mask, compiled=True, kernel_options=kernel_options)(*leaves).float().square().mean().backward()
        grads.append([t.grad for t in leaves])
    for tuned, default in zip(grads[1], grads[0]):
        assert _relative_error(tuned, default) < 1e-2
