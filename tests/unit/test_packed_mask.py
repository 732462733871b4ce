"""Transformers' packed-sequence check reads the host copy of the position ids (dflash_core.target.packed_mask).

Run: .venv/bin/python -m pytest tests/unit/test_packed_mask.py -q
"""

import torch
from transformers import masking_utils

from dflash_core.target.packed_mask import host_position_ids
from dflash_core.target import HiddenStateCapture, build_target, tiny_target_config

_PACKED = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
_ONE_DOCUMENT_A_ROW = torch.arange(8).expand(2, 8).clone()


def test_the_check_answers_from_the_held_copy_not_the_tensor_it_is_given():
    """The copy held is packed and the tensor passed is not: the answer follows the copy, so the
    passed tensor (on a GPU: the device's) was never read."""
    original = masking_utils.find_packed_sequence_indices
    with host_position_ids(_PACKED):
        found = masking_utils.find_packed_sequence_indices(_ONE_DOCUMENT_A_ROW)
    assert found.tolist() == original(_PACKED).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8]
    with host_position_ids(_ONE_DOCUMENT_A_ROW):
        assert masking_utils.find_packed_sequence_indices(_PACKED) is None


def test_outside_the_context_or_for_another_shape_transformers_decides_alone():
    assert masking_utils.find_packed_sequence_indices(_ONE_DOCUMENT_A_ROW) is None
    with host_position_ids(_ONE_DOCUMENT_A_ROW[:1]):
        assert masking_utils.find_packed_sequence_indices(_PACKED) is not None
    with host_position_ids(None):
        assert masking_utils.find_packed_sequence_indices(_PACKED) is not None


def test_a_capture_with_the_host_copy_matches_one_without():
    torch.manual_seed(0)
    target = build_target(tiny_target_config("qwen3", num_layers=3))
    capture = HiddenStateCapture(target, layer_ids=[0, 2], capture_final=True)
    input_ids = torch.randint(1, 100, _PACKED.shape)
    device_copy = capture(input_ids, position_ids=_PACKED)
    host_copy = capture(input_ids, position_ids=_PACKED, host_position_ids=_PACKED.clone())
    torch.testing.assert_close(host_copy.tapped_hidden, device_copy.tapped_hidden, atol=0, rtol=0)
    torch.testing.assert_close(host_copy.final_hidden, device_copy.final_hidden, atol=0, rtol=0)
    unpacked = capture(input_ids, position_ids=_ONE_DOCUMENT_A_ROW)
    assert not torch.allclose(unpacked.tapped_hidden, host_copy.tapped_hidden)  # the packing mattered
