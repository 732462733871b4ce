"""Exports: both formats round-trip to an equal drafter; bad drafters are refused before writing.

Run: .venv/bin/python -m pytest tests/unit/test_export.py -q
"""

import dataclasses
import json
import re
import warnings

import pytest
import torch

from dflash_core.export import build_export_configs, export_drafter, load_drafter, read_export_config
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_core.model.loss_spec import LossSpec
from dflash_core.target import tiny_target_config


_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def _drafter(family="qwen3", *, dflash2: dict | None = None, loss: dict | None = None,
             intermediate_size: int | None = None, **overrides):
    """A tiny drafter (DFlash 2 with the `dflash2` fields; `loss`: training loss options; `intermediate_size`:
    an MLP of its own width, drafter.intermediate_size)."""
    target_config = tiny_target_config(family, num_layers=8 if family == "qwen3_5" else 6)
    kwargs = dict(num_layers=2, block_size=4, num_tapped_layers=2)
    kwargs.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target_config, **kwargs)
    if intermediate_size is not None:
        config = dataclasses.replace(config, intermediate_size=intermediate_size)
    if dflash2 is not None:
        config = DFlash2Config.from_dflash(config, **dflash2)
    torch.manual_seed(0)
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0, **(loss or {})))
    with torch.no_grad():  # off the identity init, so equal weights mean something
        for parameter in drafter.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape))
    return drafter, target_config


def _assert_equal_drafters(a, b):
    assert a.config.to_dict() == b.config.to_dict()
    assert a.loss == b.loss  # the training settings ride along
    state_b = b.state_dict()
    assert state_b.keys() == a.state_dict().keys()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, state_b[name]), name


@pytest.mark.parametrize(
    ("family", "formats", "overrides"),
    [
        ("qwen3", ("native", "speculators"), {}),
        ("qwen3", ("native", "speculators"), {"layer_types": ["sliding_attention", "full_attention"],
                                             "sliding_window": 8}),
        ("llama", ("native", "speculators"), {}),
        ("qwen3_5", ("native", "speculators"), {}),  # the target's partial rotary is not the drafter's
        ("qwen3", ("native", "speculators"), {"loss": {"loss_type": "kl"}}),  # training settings ride along
        ("qwen3", ("native", "speculators"), {"loss": {"loss_weighting": "dpace", "dpace_alpha": 0.3}}),
        ("qwen3", ("native", "speculators"), {"dflash2": _DFLASH2}),
        ("qwen3", ("native", "speculators"), {"dflash2": _DFLASH2, "num_layers": 3, "intermediate_size": 48}),
        ("llama", ("native", "speculators"), {"dflash2": {**_DFLASH2, "selector_loss_weight": 0.5},
                                              "layer_types": ["sliding_attention", "full_attention"],
                                              "sliding_window": 8}),
        ("qwen3", ("native",), {"dflash2": {**_DFLASH2, "output_multiplier": 0.5,
                                            "final_logit_softcapping": 30.0}}),
    ],
)
def test_round_trip_gives_an_equal_drafter(tmp_path, family, formats, overrides):
    drafter, target_config = _drafter(family, **overrides)
    paths = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, verifier_name_or_path="/models/t",
                           formats=formats)
    assert set(paths) == set(formats)
    for name, path in paths.items():
        assert read_export_config(path)[0] == name
        again = load_drafter(path)
        assert type(again) is type(drafter)
        _assert_equal_drafters(drafter, again)


def test_config_fields_and_the_layer_id_offset(tmp_path):
    drafter, target_config = _drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    paths = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, verifier_name_or_path="/models/t")
    native = json.loads((paths["native"] / "config.json").read_text())
    spec = json.loads((paths["speculators"] / "config.json").read_text())
    ids = drafter.config.target_layer_ids
    assert native["architectures"] == ["DFlashDraftModel"]
    assert native["dflash_config"]["target_layer_ids"] == ids
    assert native["dflash_config"]["mask_token_id"] == drafter.config.mask_token_id
    assert native["block_size"] == 4 and native["sliding_window"] == 8
    assert native["layer_types"] == ["sliding_attention", "full_attention"]
    assert spec["speculators_model_type"] == "dflash"
    assert spec["aux_hidden_state_layer_ids"] == [k + 1 for k in ids]
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "/models/t"
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["transformer_layer_config"]["sliding_window"] == 8
    # vLLM's default num_speculative_tokens: block_size - 1 in both formats.
    assert native["n_predict"] == spec["transformer_layer_config"]["n_predict"] == 3
    # What runtimes read: non-causal blocks on every layer (z-lab: is_causal; vLLM: dflash_config.causal;
    # speculators -> vLLM: sliding_window_non_causal), and a top-level rope_theta.
    assert native["is_causal"] is False and native["dflash_config"]["causal"] is False
    assert spec["sliding_window_non_causal"] is True
    assert native["rope_theta"] == native["rope_parameters"]["rope_theta"] == drafter.config.rope_theta


@pytest.mark.parametrize("flags", [{}, {"is_causal": True}, {"causal": True}, {"is_causal": False},
                                   {"causal": False}])
def test_a_native_config_with_causal_layers_is_refused(tmp_path, flags):
    """A z-lab config with sliding layers runs them causally in a runtime whose flag it lacks (z-lab reads
    only `is_causal`, vLLM only `dflash_config.causal`): our non-causal drafter would draft something else
    there, so it is not loaded as if it were ours."""
    drafter, target_config = _drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    path = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, formats=("native",))["native"]
    data = json.loads((path / "config.json").read_text())
    del data["is_causal"], data["dflash_config"]["causal"]
    if "is_causal" in flags:
        data["is_causal"] = flags["is_causal"]
    if "causal" in flags:
        data["dflash_config"]["causal"] = flags["causal"]
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="causal"):
        load_drafter(path)


@pytest.mark.parametrize(
    ("form", "field", "where"),
    [("native", "n_predict", ()), ("speculators", "n_predict", ("transformer_layer_config",)),
     ("speculators", "speculative_tokens", ("speculators_config", "proposal_methods", 0))],
)
def test_an_export_stating_another_draft_length_is_refused(tmp_path, form, field, where):
    """vLLM takes num_speculative_tokens from these fields and never reads block_size: an export whose value
    is not block_size - 1 would be served with another number of mask slots, so it does not load."""
    drafter, target_config = _drafter()  # block_size 4
    path = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, verifier_name_or_path="/t")[form]
    data = json.loads((path / "config.json").read_text())
    holder = data
    for key in where:
        holder = holder[key]
    assert holder[field] == 3
    holder[field] = 7
    (path / "config.json").write_text(json.dumps(data))
    message = rf"{re.escape(str(path / 'config.json'))}: .*{field} is 7, but block_size 4 .* = 3"
    with pytest.raises(ValueError, match=message):
        load_drafter(path)
    del holder[field]  # older exports and z-lab's configs state none: they load
    (path / "config.json").write_text(json.dumps(data))
    _assert_equal_drafters(drafter, load_drafter(path))


def test_no_target_weights_in_the_files(tmp_path):
    from safetensors.torch import load_file

    drafter, target_config = _drafter()
    paths = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, verifier_name_or_path="/t")
    for path in paths.values():
        names = load_file(path / "model.safetensors").keys()
        assert names == drafter.state_dict().keys()
        assert not any("embed" in n or "lm_head" in n for n in names)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"target_layer_ids": [1, 6]}, "out of range"),
        ({"mask_token_id": 300, "vocab_size": 512}, "vocab_size"),
        ({"rope_theta": 5e5}, "rope_theta"),
        ({"hidden_size": 32}, "hidden_size"),
    ],
)
def test_a_drafter_that_does_not_fit_the_target_is_refused(change, match):
    drafter, target_config = _drafter()
    config = DFlashConfig(**{**drafter.config.to_dict(), **change})
    with pytest.raises(ValueError, match=match):
        build_export_configs(config, target_config=target_config, verifier_name_or_path="/t", dtype=torch.float32)


@pytest.mark.parametrize(
    ("change", "match"),
    [({"qk_norm": False}, "q/k RMSNorm"), ({"partial_rotary_factor": 0.25}, "rotary_dim = head_dim"),
     ({"attention_bias": True}, "attention_bias")],
)
@pytest.mark.parametrize("dflash2", [None, _DFLASH2], ids=["dflash", "dflash2"])
def test_drafters_no_runtime_would_serve_as_trained_are_refused(tmp_path, change, match, dflash2):
    """Old checkpoints (Llama drafters without q/k norm, hybrid drafters with the target's partial
    rotary) load, but are never written: every runtime would run them with different attention."""
    drafter, target_config = _drafter(dflash2=dflash2)
    legacy = build_drafter(dataclasses.replace(drafter.config, **change))
    for formats in (("native",), ("native", "speculators")):
        with pytest.raises(ValueError, match=match):
            export_drafter(legacy, target_config=target_config, out_dir=tmp_path, verifier_name_or_path="/t",
                           formats=formats)
    assert not any(tmp_path.iterdir())


def test_the_speculators_format_needs_a_verifier_path():
    with pytest.raises(ValueError, match="verifier_name_or_path"):
        build_export_configs(_drafter()[0].config, target_config=tiny_target_config("qwen3"),
                             verifier_name_or_path="", dtype=torch.float32)


def test_bf16_export_and_missing_config_dir(tmp_path):
    drafter, target_config = _drafter()
    paths = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, formats=("native",),
                           dtype=torch.bfloat16)
    assert json.loads((paths["native"] / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_drafter(paths["native"])
    torch.testing.assert_close(loaded.fc.weight, drafter.fc.weight.bfloat16().float())
    with pytest.raises(ValueError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")


def test_dflash2_exports_what_zlab_and_speculators_read(tmp_path):
    """Native: architecture DFlash2DraftModel, the DFlash 2 fields in dflash_config, non-causal flags,
    bare codebook names (z-lab maps them onto its embeddings). Speculators: model type dflash2 with its
    four fields at the top level, and refused (nothing written) for a drafter whose unary logits are
    scaled or softcapped, which that format cannot say."""
    from safetensors.torch import load_file

    drafter, target_config = _drafter(dflash2=_DFLASH2)
    paths = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, verifier_name_or_path="/t")
    native = json.loads((paths["native"] / "config.json").read_text())
    spec = json.loads((paths["speculators"] / "config.json").read_text())
    assert native["architectures"] == ["DFlash2DraftModel"]
    assert native["is_causal"] is False and native["dflash_config"]["causal"] is False
    assert {k: native["dflash_config"][k] for k in _DFLASH2} == _DFLASH2
    assert native["dflash_config"]["input_embedding_scale"] == 1.0
    assert spec["speculators_model_type"] == spec["speculators_config"]["algorithm"] == "dflash2"
    assert spec["architectures"] == ["DFlash2DraftModel"] and {k: spec[k] for k in _DFLASH2} == _DFLASH2
    assert spec["sliding_window_non_causal"] is True
    names = load_file(paths["native"] / "model.safetensors").keys()
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel"} <= names
    capped, _ = _drafter(dflash2={**_DFLASH2, "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="native format only"):
        export_drafter(capped, target_config=target_config, out_dir=tmp_path / "capped", verifier_name_or_path="/t")
    assert not (tmp_path / "capped").exists()
    assert isinstance(load_drafter(export_drafter(capped, target_config=target_config, out_dir=tmp_path / "capped",
                                                  formats=("native",))["native"]), DFlash2DraftModel)
    # A DFlash config carrying DFlash 2 fields is neither: refused, not half-loaded.
    native["architectures"] = ["DFlashDraftModel"]
    (paths["native"] / "config.json").write_text(json.dumps(native))
    with pytest.raises(ValueError, match="DFlash 2 fields"):
        load_drafter(paths["native"])
