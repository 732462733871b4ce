"""Drafter config from target configs: tapped layer ids, shapes, q/k norm, partial rotary RoPE.

Run: .venv/bin/python -m pytest tests/unit/test_model_config.py -q
"""

import warnings

import pytest
import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash_core.model.attention import RotaryEmbedding, apply_rope
from dflash_core.model.build import build_drafter
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.config import DFlashConfig, tapped_layer_ids
from dflash_core.target import tiny_target_config


def _from_target(config, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hybrid family warns that the attention gate is not copied
        return DFlashConfig.from_target(config, **kwargs)


@pytest.mark.parametrize(
    ("num_target_layers", "expected"),
    [(36, [1, 9, 17, 25, 33]), (64, [1, 16, 31, 46, 61]), (30, [1, 8, 14, 20, 27])],
)
def test_tapped_layer_ids_spread_from_1_to_n_minus_3(num_target_layers, expected):
    assert tapped_layer_ids(num_target_layers=num_target_layers, num_tapped_layers=5) == expected


def test_tapped_layer_ids_reject_impossible_requests():
    with pytest.raises(ValueError):
        tapped_layer_ids(num_target_layers=6, num_tapped_layers=5)
    with pytest.raises(ValueError):
        tapped_layer_ids(num_target_layers=36, num_tapped_layers=0)


def test_qwen3_8b_shape_derives_the_released_drafter_shape():
    target = transformers.Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    )
    config = _from_target(target, num_layers=5, block_size=16)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        4096, 32, 8, 128,
    )
    assert config.qk_norm and LossSpec().gamma(config.block_size) == 7.0 and config.rotary_dim == 128
    drafter = build_drafter(_from_target(target, num_layers=5, block_size=16), device="meta")
    assert drafter.fc.in_features == 5 * 4096 and drafter.fc.bias is None
    assert LossSpec().gamma(_from_target(target, num_layers=5, block_size=8).block_size) == 4.0


def test_every_family_gets_the_runtime_attention_conventions():
    """z-lab's reference, vLLM and SGLang build every drafter layer as plain Qwen3 attention: q/k
    norm, full-head rotary, no bias. The target's own attention details are not copied."""
    llama = _from_target(tiny_target_config("llama"), num_layers=2, block_size=8)
    qwen3 = _from_target(tiny_target_config("qwen3"), num_layers=2, block_size=8)
    hybrid = _from_target(tiny_target_config("qwen3_5", num_layers=8), num_layers=2, block_size=8)
    for config in (llama, qwen3, hybrid):
        assert config.qk_norm and not config.attention_bias
        assert config.partial_rotary_factor == 1.0 and config.rotary_dim == config.head_dim
    assert build_drafter(llama, device="meta").layers[0].self_attn.q_norm is not None


def test_composite_qwen3_5_config_uses_its_text_config():
    text = tiny_target_config("qwen3_5", num_layers=8)
    composite = transformers.Qwen3_5Config(text_config=text.to_dict())
    assert _from_target(composite, num_layers=2, block_size=8).to_dict() == _from_target(
        text, num_layers=2, block_size=8
    ).to_dict()


def test_partial_rotary_kernel_matches_the_hybrid_targets_own_rope():
    """New drafters rotate whole heads; the partial path stays exact for drafters trained before."""
    text = tiny_target_config("qwen3_5", num_layers=8)
    config = DFlashConfig(**{**_from_target(text, num_layers=2, block_size=8).to_dict(),
                             "partial_rotary_factor": 0.25})
    ours = RotaryEmbedding(rotary_dim=config.rotary_dim, theta=config.rope_theta)
    theirs = modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(text)
    positions = torch.arange(50)[None]
    query = torch.randn(1, 4, 50, config.head_dim)
    their_cos, their_sin = theirs(query, positions)
    our_cos, our_sin = ours(positions)
    torch.testing.assert_close(our_cos, their_cos)
    rotated = apply_rope(query, our_cos, our_sin)
    expected, _ = modeling_qwen3_5.apply_rotary_pos_emb(query, query, their_cos, their_sin)
    torch.testing.assert_close(rotated, expected)
    assert torch.equal(rotated[..., config.rotary_dim :], query[..., config.rotary_dim :])
    full = RotaryEmbedding(rotary_dim=config.head_dim, theta=config.rope_theta)
    assert not torch.allclose(apply_rope(query, *full(positions)), expected)  # ignoring the factor is wrong


def test_bad_settings_raise_value_errors():
    target = tiny_target_config("qwen3")
    with pytest.raises(ValueError, match="loss_gamma"):
        LossSpec().gamma(5)  # a block size the DFlash paper gives no decay for
    build_drafter(_from_target(target, num_layers=2, block_size=5), device="meta")  # drafting needs none
    with pytest.raises(ValueError, match="sliding_window"):
        _from_target(target, num_layers=2, block_size=8, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types"):
        _from_target(target, num_layers=2, block_size=8, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="mask_token_id"):
        _from_target(target, num_layers=2, block_size=8, mask_token_id=10**6)
    scaled = tiny_target_config("llama")
    scaled.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type"):
        _from_target(scaled, num_layers=2, block_size=8)
