"""Target capture: layer-id semantics, pre-norm final state, early stop, validator, hybrid family.

Run: .venv/bin/python -m pytest tests/unit/test_target_capture.py -q
"""

import inspect

import pytest
import torch

from dflash_core.target import (
    CapturedStates,
    HiddenStateCapture,
    build_target,
    language_model,
    target_heads,
    tiny_target_config,
    validate_capture,
)

_FAMILIES = ["llama", "qwen3", "qwen3_5"]


def _target(family: str):
    torch.manual_seed(0)
    config = tiny_target_config(family, num_layers=8)
    return build_target(config), config


@pytest.fixture(scope="module", params=_FAMILIES)
def family_capture(request):
    target, config = _target(request.param)
    input_ids = torch.randint(1, config.vocab_size, (2, 24))
    layer_ids = [1, 3, 5]
    captured = HiddenStateCapture(target, layer_ids=layer_ids, capture_final=True)(input_ids)
    with torch.no_grad():
        reference = target(input_ids, output_hidden_states=True)
    return request.param, target, config, input_ids, captured, reference


def test_native_id_k_is_hidden_states_k_plus_1(family_capture):
    _, _, _, _, captured, reference = family_capture
    for layer_id in captured.layer_ids:
        assert torch.equal(captured.layer(layer_id), reference.hidden_states[layer_id + 1])
        assert not torch.equal(captured.layer(layer_id), reference.hidden_states[layer_id])


def test_final_state_is_taken_before_the_final_norm(family_capture):
    _, target, _, _, captured, reference = family_capture
    normed_last = reference.hidden_states[-1]
    assert not torch.allclose(captured.final_hidden, normed_last)
    with torch.no_grad():
        torch.testing.assert_close(language_model(target).norm(captured.final_hidden), normed_last)
        heads = target_heads(target)
        torch.testing.assert_close(heads.lm_head(heads.final_norm(captured.final_hidden)), reference.logits)


def test_captures_are_valid_and_non_zero_for_every_family(family_capture):
    family, _, config, input_ids, captured, _ = family_capture
    validate_capture(captured, input_ids=input_ids, hidden_size=config.hidden_size)
    for layer_id in captured.layer_ids:
        assert captured.layer(layer_id).abs().mean() > 1e-3, (family, layer_id)


def test_without_teacher_the_forward_stops_after_the_last_tapped_layer():
    target, config = _target("qwen3")
    layers = language_model(target).layers
    ran = []
    for index, layer in enumerate(layers):
        layer.register_forward_hook(lambda module, args, output, index=index: ran.append(index))
    capture = HiddenStateCapture(target, layer_ids=[1, 4], capture_final=False)
    input_ids = torch.randint(1, config.vocab_size, (1, 12))
    captured = capture(input_ids)
    assert ran == [0, 1, 2, 3, 4]
    assert captured.final_hidden is None
    with torch.no_grad():
        reference = target(input_ids, output_hidden_states=True).hidden_states
    assert torch.equal(captured.layer(4), reference[5])
    capture.close()
    ran.clear()
    with torch.no_grad():
        target(input_ids)
    assert ran == list(range(8))  # hooks removed: the model runs whole again


def _captured(config, input_ids):
    width = config.hidden_size
    states = torch.randn(*input_ids.shape, 3 * width)
    return CapturedStates(input_ids=input_ids, tapped_hidden=states, layer_ids=[1, 3, 5])


def test_validator_rejects_zeroed_nan_and_mismatched_captures():
    config = tiny_target_config("qwen3")
    input_ids = torch.randint(1, config.vocab_size, (2, 10))
    width = config.hidden_size
    good = _captured(config, input_ids)
    validate_capture(good, input_ids=input_ids, hidden_size=width)

    zeroed = _captured(config, input_ids)
    zeroed.tapped_hidden[..., width : 2 * width] = 0.0
    with pytest.raises(ValueError, match=r"target layer 3 \(hidden_states\[4\]\).*constant"):
        validate_capture(zeroed, input_ids=input_ids, hidden_size=width)

    poisoned = _captured(config, input_ids)
    poisoned.tapped_hidden[1, 4, 2 * width + 7] = float("nan")
    with pytest.raises(ValueError, match="target layer 5 .*NaN"):
        validate_capture(poisoned, input_ids=input_ids, hidden_size=width)

    with pytest.raises(ValueError, match="different token ids"):
        validate_capture(good, input_ids=input_ids.flip(1), hidden_size=width)
    with pytest.raises(ValueError, match="shape"):
        validate_capture(good, input_ids=input_ids, hidden_size=width + 1)

    no_final = _captured(config, input_ids)
    no_final.final_hidden = torch.zeros(2, 10, width)
    with pytest.raises(ValueError, match="final layer"):
        validate_capture(no_final, input_ids=input_ids, hidden_size=width)


def test_bad_layer_ids_raise():
    target, _ = _target("llama")
    with pytest.raises(ValueError, match="out of range"):
        HiddenStateCapture(target, layer_ids=[1, 8], capture_final=False)
    with pytest.raises(ValueError, match="ascending"):
        HiddenStateCapture(target, layer_ids=[3, 1], capture_final=False)


def test_hybrid_captures_say_which_gdn_kernels_run_and_compile_leaves_gdn_layers_eager():
    from dflash_core.target.runtime import compile_decoder_layers

    assert HiddenStateCapture(_target("qwen3")[0], layer_ids=[1], capture_final=False).gdn_kernels is None
    target, config = _target("qwen3_5")
    kernels = HiddenStateCapture(target, layer_ids=[1], capture_final=False).gdn_kernels
    assert (kernels.recurrence, kernels.conv) == ("torch", "torch")  # no fla on a CPU
    compile_decoder_layers(target)  # lazy: nothing compiles until a layer runs
    compiled = ["forward" in vars(layer) for layer in language_model(target).layers]
    assert compiled == [kind == "full_attention" for kind in config.layer_types]


def test_graphed_layers_hand_back_outputs_a_later_call_cannot_overwrite():
    """A CUDA graph writes every replay's output into the same memory; the target's layers in the
    reduce-overhead mode hand back copies, so layer k's replay cannot overwrite layer k-1's output (its
    input) or a tapped layer's state."""
    from collections import namedtuple

    from dflash_core.target.runtime import compile_decoder_layers, graph_outputs_owned

    Pair = namedtuple("Pair", "hidden extra")
    graph_memory = torch.zeros(3)

    def replay(x):  # as a graph's replay: its outputs live in memory the next replay writes
        graph_memory.copy_(x)
        return graph_memory, (graph_memory, 7), Pair(graph_memory, None)

    forward = graph_outputs_owned(replay)
    first = forward(torch.ones(3))
    forward(torch.full((3,), 2.0))  # the next layer's replay
    hidden, (nested, seven), pair = first
    assert torch.equal(hidden, torch.ones(3)) and torch.equal(nested, torch.ones(3)) and seven == 7
    assert isinstance(pair, Pair) and torch.equal(pair.hidden, torch.ones(3)) and pair.extra is None
    assert forward.__wrapped__ is replay

    target, _ = _target("qwen3")
    compile_decoder_layers(target, mode="reduce-overhead")  # lazy: nothing compiles until a layer runs
    # owned -> torch.compile's wrapper -> the layer's own forward
    assert all(inspect.ismethod(vars(layer)["forward"].__wrapped__.__wrapped__)
               for layer in language_model(target).layers)
    target, _ = _target("qwen3")
    compile_decoder_layers(target)  # the default mode hands back inductor's own outputs
    assert all(inspect.ismethod(vars(layer)["forward"].__wrapped__) for layer in language_model(target).layers)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_compile_mode_reaches_the_target_and_drafter_layers(monkeypatch, mode):
    import types

    import dflash_core.target.runtime as target_runtime
    from dflash_core.train.parallelize import parallelize

    seen = {}
    monkeypatch.setattr(target_runtime, "compile_decoder_layers", lambda model, *, mode: seen.update(target=mode))
    drafter = types.SimpleNamespace(compile_layers=lambda *, mode: seen.update(drafter=mode))
    parts = types.SimpleNamespace(config=types.SimpleNamespace(compile=True, compile_mode=mode), drafter=drafter,
                                  target=None)
    assert parallelize(parts, world_size=1) is drafter
    assert seen == {"target": mode, "drafter": mode}
