"""A packed target forward with the batch's host copy of the position ids does not wait for the GPU
(dflash_core.target.packed_mask): torch's sync debug mode raises on any synchronizing call inside it, and
does raise without the host copy, where transformers reads the device's position ids. Skipped
without a GPU.

Run (any CUDA GPU): python3 -m pytest tests/gpu/test_packed_mask_gpu.py -q --noconftest
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def packed_capture():
    from dflash_core.target import HiddenStateCapture, build_target, tiny_target_config
    from dflash_core.target.runtime import use_flex_attention

    torch.manual_seed(0)
    target = build_target(tiny_target_config("qwen3", num_layers=3), device="cuda", dtype=torch.bfloat16)
    assert use_flex_attention(target) is None
    capture = HiddenStateCapture(target, layer_ids=[0, 2], capture_final=True)
    host_positions = torch.cat([torch.arange(n) for n in (100, 28, 128)])[None].repeat(2, 1).pin_memory()
    input_ids = torch.randint(1, 100, host_positions.shape, device="cuda")
    positions = host_positions.to("cuda")
    capture(input_ids, position_ids=positions, host_position_ids=host_positions)  # compile and warm up once
    torch.cuda.synchronize()
    return capture, input_ids, positions, host_positions


def test_the_forward_with_the_host_copy_never_waits_for_the_device(packed_capture):
    capture, input_ids, positions, host_positions = packed_capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        captured = capture(input_ids, position_ids=positions, host_position_ids=host_positions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference = capture(input_ids, position_ids=positions)
    torch.testing.assert_close(captured.tapped_hidden, reference.tapped_hidden, atol=0, rtol=0)


def test_without_the_host_copy_transformers_waits_for_the_device(packed_capture):
    capture, input_ids, positions, _ = packed_capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            capture(input_ids, position_ids=positions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
