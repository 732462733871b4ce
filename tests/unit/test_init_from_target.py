"""`init: target`: the drafter starts from the target's last layers and passes the last tap through fc.

Run: .venv/bin/python -m pytest tests/unit/test_init_from_target.py -q
"""

import warnings

import pytest
import torch

from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.model.init_from_target import init_from_target_layers
from dflash_core.target import build_target, language_model, tiny_target_config


def _drafter_and_layers(family: str):
    torch.manual_seed(0)
    target_config = tiny_target_config(family, num_layers=8 if family == "qwen3_5" else 6)
    target = build_target(target_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target_config, num_layers=2, block_size=8, num_tapped_layers=2)
    drafter = build_drafter(config)
    return drafter, language_model(target).layers


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_last_target_layers_seed_the_drafter(family):
    drafter, layers = _drafter_and_layers(family)
    copied = init_from_target_layers(drafter, layers)

    first = len(layers) - len(drafter.layers)
    for index, layer in enumerate(drafter.layers):
        source = layers[first + index]
        torch.testing.assert_close(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        torch.testing.assert_close(layer.mlp.down_proj.weight, source.mlp.down_proj.weight)
        torch.testing.assert_close(layer.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
        if family == "qwen3":  # Qwen3 has q/k norms; Llama has none, so ours stay at one
            torch.testing.assert_close(layer.self_attn.k_norm.weight, source.self_attn.k_norm.weight)
        else:
            assert torch.equal(layer.self_attn.k_norm.weight, torch.ones_like(layer.self_attn.k_norm.weight))
    assert any("self_attn.v_proj.weight" in line for line in copied)

    features = torch.randn(3, drafter.fc.in_features)
    hidden = drafter.fc.out_features
    torch.testing.assert_close(drafter.fc(features), features[:, -hidden:])
    torch.testing.assert_close(drafter.hidden_norm.weight, layers[first].input_layernorm.weight)


def test_a_drafter_deeper_than_the_target_is_refused():
    drafter, layers = _drafter_and_layers("llama")
    with pytest.raises(ValueError, match="cannot seed 2 drafter layers from a 1-layer target"):
        init_from_target_layers(drafter, layers[:1])


def test_hybrid_target_copies_what_matches():
    """Qwen3.5's last layer is gated attention (a q_proj twice as wide): the MLP and norms still match."""
    drafter, layers = _drafter_and_layers("qwen3_5")
    copied = init_from_target_layers(drafter, layers)
    assert any("mlp.gate_proj.weight" in line for line in copied)
    assert not any("self_attn.q_proj.weight" in line and "layers.1." in line for line in copied)
