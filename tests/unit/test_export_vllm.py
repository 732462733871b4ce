"""Our exports as vLLM 0.26.0 reads them: its own loader code, from its wheel, on CPU (vLLM is not installed).

Run: .venv/bin/python -m pytest -q -n 0 tests/unit/test_export_vllm.py
Needs the wheel `bash infra/setup.sh` downloads to .venv/share/vllm-wheel; without it every test fails.

The pure-Python config code runs from the wheel's sources (stub parent packages stand in for the rest of
vLLM): the speculators algos and `SpeculatorsConfig`, `EAGLEConfig`, qwen3_dflash.py's per-layer attention
resolution, the aux-layer and mask-token lookups. What qwen3_dflash.py reads of the draft config, the
weight names it builds and the target-side meaning of an aux layer id are read with `ast`.
"""

from __future__ import annotations

import ast
import json
import sys
import types
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest

from dflash_core.export import export_drafter
from dflash_core.export.engines import VLLM_CHECKED_VERSION
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import DFlash2Config
from dflash_core.target import tiny_target_config

_REPO = Path(__file__).resolve().parents[2]
# CI: infra/setup.sh puts it in .venv/share/vllm-wheel; /tmp/vw is a developer's unpacked copy.
_WHEEL_DIRS = (Path(sys.prefix) / "share" / "vllm-wheel", _REPO / ".venv" / "share" / "vllm-wheel",
               Path("/tmp/vw"))
_BLOCK_SIZE = 4
_SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
_QWEN3_DFLASH = "vllm/model_executor/models/qwen3_dflash.py"


def vllm_wheel_path() -> Path:
    for directory in _WHEEL_DIRS:
        found = sorted(directory.glob(f"vllm-{VLLM_CHECKED_VERSION}-*.whl"))
        if found:
            return found[0]
    pytest.fail(f"vLLM {VLLM_CHECKED_VERSION}'s wheel is not in {_WHEEL_DIRS[0]}: run `bash infra/setup.sh`, "
                "which downloads it (these tests run its loader code on our exports)")


@pytest.fixture(scope="module")
def wheel():
    with zipfile.ZipFile(vllm_wheel_path()) as archive:
        yield archive


def _source(wheel: zipfile.ZipFile, path: str) -> str:
    return wheel.read(path).decode()


def _top_level(source: str, names: set[str], namespace: dict[str, Any], *, filename: str) -> dict[str, Any]:
    """Run only the top-level functions / assignments named `names` of `source` in `namespace`."""
    keep = [node for node in ast.parse(source).body
            if (isinstance(node, ast.FunctionDef) and node.name in names)
            or (isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & names)]
    found = {getattr(n, "name", None) or n.targets[0].id for n in keep}
    assert found == names, f"{filename} lacks {names - found}"
    exec(compile(ast.Module(body=keep, type_ignores=[]), filename, "exec"), namespace)
    return namespace


@pytest.fixture
def vllm(wheel, monkeypatch):
    """vLLM's config modules executed from the wheel, with stub parent packages (restored after the test)."""
    def module(name: str, source: str | None = None) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, name, mod)
        if source is not None:
            exec(compile(source, f"{wheel.filename}!{name}", "exec"), mod.__dict__)
        return mod

    for package in ("vllm", "vllm.transformers_utils", "vllm.transformers_utils.configs",
                    "vllm.transformers_utils.configs.speculators"):
        module(package)
    utils = module("vllm.transformers_utils.utils")  # the real one imports vllm.envs: run only what configs use
    utils.without_trust_remote_code = _top_level(
        _source(wheel, "vllm/transformers_utils/utils.py"), {"without_trust_remote_code"}, {"Any": Any},
        filename="utils.py")["without_trust_remote_code"]
    specs = "vllm.transformers_utils.configs.speculators"
    algos = module(f"{specs}.algos", _source(wheel, "vllm/transformers_utils/configs/speculators/algos.py"))
    base = module(f"{specs}.base", _source(wheel, "vllm/transformers_utils/configs/speculators/base.py"))
    eagle = module("vllm.transformers_utils.configs.eagle",
                   _source(wheel, "vllm/transformers_utils/configs/eagle.py"))
    from transformers import Qwen3Config

    v2_runner = types.SimpleNamespace(use_v2_model_runner=True)
    dflash = _top_level(
        _source(wheel, _QWEN3_DFLASH), {"_SLIDING_ATTENTION", "_dflash_layer_causal", "dflash_has_any_non_causal",
                                        "_resolve_layer_attention"},
        {"Qwen3Config": Qwen3Config, "get_current_vllm_config": lambda: v2_runner}, filename=_QWEN3_DFLASH)
    runner = _top_level(_source(wheel, "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"),
                        {"get_eagle3_aux_layers_from_config"}, {"SpeculativeConfig": Any},
                        filename="eagle3_utils.py")
    runner |= _top_level(_source(wheel, "vllm/v1/worker/gpu/spec_decode/utils.py"),
                         {"get_parallel_drafting_token_id"}, {}, filename="spec_decode/utils.py")
    return types.SimpleNamespace(algos=algos, SpeculatorsConfig=base.SpeculatorsConfig,
                                 EAGLEConfig=eagle.EAGLEConfig, dflash=dflash, runner=runner, v2_runner=v2_runner)


def _export(tmp_path: Path, *, family: str = "qwen3", dflash2: bool = False, **overrides):
    """(DFlashConfig, target config, {format: export dir}) of a tiny drafter."""
    target_config = tiny_target_config(family, num_layers=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target_config, num_layers=2, block_size=_BLOCK_SIZE,
                                          num_tapped_layers=2, **overrides)
    if dflash2:
        config = DFlash2Config.from_dflash(config, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                           selector_top_k=4)
    paths = export_drafter(build_drafter(config), target_config=target_config, out_dir=tmp_path,
                           verifier_name_or_path="/models/target")
    return config, target_config, paths


def _draft_hf_config(vllm, path: Path):
    """The draft hf_config vLLM builds (speculative.py:913-930): SpeculatorsConfig for the speculators format
    (transformers_utils/config.py:283-290), else AutoConfig's config wrapped in EAGLEConfig(method="dflash")."""
    if "speculators_model_type" in json.loads((path / "config.json").read_text()):
        return vllm.SpeculatorsConfig.from_pretrained(str(path))
    from transformers import AutoConfig

    return vllm.EAGLEConfig(AutoConfig.from_pretrained(str(path)), method="dflash", model_type="eagle")


def _meant(config: DFlashConfig, target_config) -> dict[str, Any]:
    """Each draft-config attribute qwen3_dflash.py reads (but dflash_config, checked key by key), as our
    drafter was trained."""
    sliding = "sliding_attention" in config.layer_types
    return {
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "vocab_size": config.vocab_size,
        "num_hidden_layers": config.num_layers, "hidden_act": "silu", "attention_bias": config.attention_bias,
        "max_position_embeddings": target_config.max_position_embeddings,
        # Full-head rotary (no partial_rotary_factor), default rope type.
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "layer_types": list(config.layer_types), "sliding_window": config.sliding_window if sliding else None,
    }


# What qwen3_dflash.py reads that our exports leave to its default, the default (as its source writes it)
# and why that default is what we trained.
_DEFAULTED_ATTRIBUTES = {
    "add_swa_attention_sink_bias": (False, "no attention sinks"),
    "eagle_config": ({}, "nothing beyond dflash_config"),
    "logit_scale": (1.0, "the target's LM head, unscaled"),
    "target_hidden_size": (None, "absent: fc takes L * hidden_size; check_against_target makes it the target's"),
    "draft_vocab_size": (None, "None: vocab_size (the full vocabulary, no d2t map)"),
}
_PROVIDED_KEYS = {"mask_token_id", "target_layer_ids", "causal"}
_DEFAULTED_KEYS = {
    "use_swa": (False, "layer_types says which layers slide"),
    "swa_window_size": ("getattr(config, 'sliding_window', None)", "the window is sliding_window"),
    "attention_sink_bias": ("getattr(config, 'add_swa_attention_sink_bias', False)", "no attention sinks"),
    "use_aux_hidden_state": (None, "absent: True, the drafter reads the tapped target states"),
    "layer_ids": (None, "read only where target_layer_ids is absent"),
}


def _draft_config_reads(source: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(attribute -> its defaults, dflash_config key -> its defaults) of every read of the draft config in
    qwen3_dflash.py: `config.X`, `self.config.X`, getattr / hasattr on them; `.get`, `[...]` and `in` on
    `dflash_config` / `drafter_config` (eagle_config updated with dflash_config). Defaults as JSON, "null"
    for none."""
    config_exprs = {"config", "self.config"}

    def is_dflash_dict(node: ast.AST) -> bool:
        text = ast.unparse(node)
        return text in {"dflash_config", "drafter_config"} or "'dflash_config'" in text

    def default(args: list[ast.expr], index: int) -> str:
        if len(args) <= index:
            return "null"
        try:
            return json.dumps(ast.literal_eval(args[index]))
        except ValueError:
            return json.dumps(ast.unparse(args[index]))

    attributes: dict[str, set[str]] = {}
    keys: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        loads = isinstance(getattr(node, "ctx", None), ast.Load)
        func = getattr(node, "func", None)
        if isinstance(node, ast.Attribute) and loads and ast.unparse(node.value) in config_exprs:
            attributes.setdefault(node.attr, set()).add("null")
        elif isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") \
                and ast.unparse(node.args[0]) in config_exprs:
            attributes.setdefault(node.args[1].value, set()).add(default(node.args, 2))
        elif isinstance(func, ast.Attribute) and func.attr == "get" and is_dflash_dict(func.value):
            keys.setdefault(node.args[0].value, set()).add(default(node.args, 1))
        elif isinstance(node, ast.Subscript) and loads and is_dflash_dict(node.value):
            keys.setdefault(node.slice.value, set()).add("null")
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) \
                and is_dflash_dict(node.comparators[0]):
            keys.setdefault(node.left.value, set()).add("null")
    return attributes, keys


@pytest.mark.parametrize("overrides", [{}, _SLIDING, {"family": "llama"}], ids=["full", "sliding", "llama"])
def test_speculators_export_through_vllms_speculators_config(tmp_path, vllm, overrides):
    """algos.update_dflash + SpeculatorsConfig, executed on our speculators config.json: the mask id, the
    native layer ids (vLLM subtracts 1 from our aux ids), non-causal layers, the window, and the draft length
    both where vLLM defaults it (n_predict) and where serving the directory as the model takes it from."""
    config, _, paths = _export(tmp_path, **overrides)
    hf = _draft_hf_config(vllm, paths["speculators"])
    ids = list(config.target_layer_ids)
    assert hf.architectures == ["DFlashDraftModel"]
    assert hf.dflash_config == {"mask_token_id": config.mask_token_id, "target_layer_ids": ids, "causal": False}
    assert hf.eagle_aux_hidden_state_layer_ids == [k + 1 for k in ids]
    assert hf.layer_types == list(config.layer_types)
    assert hf.sliding_window == (config.sliding_window if "sliding_attention" in config.layer_types else None)
    assert getattr(hf, "n_predict", None) == _BLOCK_SIZE - 1 and hf.draft_vocab_size == config.vocab_size
    data = json.loads((paths["speculators"] / "config.json").read_text())
    assert vllm.SpeculatorsConfig.extract_vllm_speculative_config(data) == {
        "method": "dflash", "num_speculative_tokens": _BLOCK_SIZE - 1}


@pytest.mark.parametrize("overrides", [{}, _SLIDING, {"family": "llama"}], ids=["full", "sliding", "llama"])
@pytest.mark.parametrize("form", ["native", "speculators"])
def test_every_field_qwen3_dflash_reads_is_what_we_trained(tmp_path, vllm, wheel, overrides, form):
    """Every attribute and dflash_config key qwen3_dflash.py reads is either written by our export with the
    value we trained, or left to a default (checked in its source) that means the same; per layer, vLLM's own
    resolution gives our window and non-causal attention; the runner taps native id + 1 and drafts from our
    mask token."""
    config, target_config, paths = _export(tmp_path, **overrides)
    hf = _draft_hf_config(vllm, paths[form])
    attributes, keys = _draft_config_reads(_source(wheel, _QWEN3_DFLASH))
    meant = _meant(config, target_config)
    assert set(attributes) == set(meant) | set(_DEFAULTED_ATTRIBUTES) | {"dflash_config"}, "it reads other fields"
    for name, value in meant.items():
        assert getattr(hf, name) == value, name
    for name, (vllm_default, why) in _DEFAULTED_ATTRIBUTES.items():
        assert json.dumps(vllm_default) in attributes[name], (name, attributes[name])
        if name == "draft_vocab_size":  # speculators sets it, native leaves it to vLLM (qwen3_dflash.py:662)
            assert getattr(hf, name, None) in (None, config.vocab_size), why
        else:
            assert not hasattr(hf, name), f"{name}: {why}"
    assert set(keys) == _PROVIDED_KEYS | set(_DEFAULTED_KEYS), "qwen3_dflash.py reads other dflash_config keys"
    for name, (vllm_default, why) in _DEFAULTED_KEYS.items():
        assert name not in hf.dflash_config, f"{name}: {why}"
        assert json.dumps(vllm_default) in keys[name], (name, keys[name])
    assert hf.dflash_config["mask_token_id"] == config.mask_token_id
    assert hf.dflash_config["target_layer_ids"] == list(config.target_layer_ids)
    resolved = [vllm.dflash["_resolve_layer_attention"](hf, i) for i in range(config.num_layers)]
    window = config.sliding_window
    assert resolved == [(window if kind == "sliding_attention" else None, False) for kind in config.layer_types]
    assert vllm.dflash["dflash_has_any_non_causal"](hf)
    spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf))
    assert vllm.runner["get_eagle3_aux_layers_from_config"](spec) == tuple(k + 1 for k in config.target_layer_ids)
    assert vllm.runner["get_parallel_drafting_token_id"](hf) == config.mask_token_id
    assert getattr(hf, "n_predict", None) == _BLOCK_SIZE - 1


def test_mixed_sliding_layers_need_vllms_v2_runner(tmp_path, vllm):
    """What engines.py's start note says: mixed sliding/full drafters fail to start without the V2 runner."""
    _, _, paths = _export(tmp_path, **_SLIDING)
    vllm.v2_runner.use_v2_model_runner = False
    with pytest.raises(NotImplementedError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        vllm.dflash["_resolve_layer_attention"](_draft_hf_config(vllm, paths["native"]), 0)


def test_an_aux_layer_id_is_the_state_after_that_many_target_layers(wheel):
    """Target side of the +1: vLLM's Llama, Qwen3 (Qwen2Model) and Qwen3.5 (Qwen3NextModel) record aux id 0
    before the first layer and id i + 1 after layer i, as hidden_states + residual (the residual stream, not
    normed): aux id k + 1 is the output of layer k, what our capture hooks for native id k."""
    models = {"llama.py": "LlamaModel", "qwen2.py": "Qwen2Model", "qwen3_next.py": "Qwen3NextModel"}
    for filename, class_name in models.items():
        tree = ast.parse(_source(wheel, f"vllm/model_executor/models/{filename}"))
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
        forward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
        loop = next(n for n in ast.walk(forward) if isinstance(n, ast.For))
        records = [n for n in ast.walk(forward) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Attribute) and n.func.attr == "_maybe_add_hidden_state"]
        in_loop = [n for n in ast.walk(loop) if n in records]
        assert [ast.unparse(n.args[1]) for n in records if n not in in_loop] == ["0"], filename
        index = loop.target.elts[0] if isinstance(loop.target, ast.Tuple) else loop.target
        assert [ast.unparse(n.args[1]) for n in in_loop] == [f"{index.id} + 1"], filename
        layer_call = next(i for i, s in enumerate(loop.body) if "layer(" in ast.unparse(s))
        record_at = next(i for i, s in enumerate(loop.body) if "_maybe_add_hidden_state" in ast.unparse(s))
        assert layer_call < record_at, filename
    for filename, subclass in (("qwen3.py", "Qwen3Model"), ("qwen3_5.py", "Qwen3_5Model")):
        cls = next(n for n in ast.parse(_source(wheel, f"vllm/model_executor/models/{filename}")).body
                   if isinstance(n, ast.ClassDef) and n.name == subclass)
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "forward" for n in cls.body), subclass
    interfaces = _source(wheel, "vllm/model_executor/models/interfaces.py")
    assert "value = hidden_states + residual if residual is not None else hidden_states" in interfaces


def test_our_weight_names_are_the_modules_qwen3_dflash_builds(tmp_path, wheel):
    """Each weight name we write, after vLLM's stacking (q/k/v -> qkv_proj, gate/up -> gate_up_proj), walks
    modules qwen3_dflash.py (and qwen2.py's MLP) create; embed_tokens and lm_head are absent, so vLLM shares
    the target's (llm_base_proposer: has_own_* false)."""
    from safetensors.torch import load_file

    _, _, paths = _export(tmp_path)
    source = _source(wheel, _QWEN3_DFLASH)
    modules = {t.attr for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
               if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
    mlp = next(n for n in ast.parse(_source(wheel, "vllm/model_executor/models/qwen2.py")).body
               if isinstance(n, ast.ClassDef) and n.name == "Qwen2MLP")
    modules |= {t.attr for n in ast.walk(mlp) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute)}
    mapper = next(n for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.keyword) and n.arg == "orig_to_new_stacked")
    stacked = {old: new for old, (new, _) in ast.literal_eval(mapper.value).items()}
    for form, path in paths.items():
        for name in load_file(path / "model.safetensors"):
            for old, new in stacked.items():
                name = name.replace(old + ".", new + ".")
            parts = [p for p in name.split(".")[:-1] if not p.isdigit()]
            assert set(parts) <= modules, (form, name, set(parts) - modules)
            assert "embed_tokens" not in name and "lm_head" not in name


def test_vllm_reads_the_draft_length_from_n_predict_never_block_size(wheel):
    """Why the exports write n_predict: speculative.py defaults num_speculative_tokens to the draft config's
    n_predict, and the DFlash proposers run 1 + num_speculative_tokens query slots; none reads block_size."""
    speculative = ast.parse(_source(wheel, "vllm/config/speculative.py"))
    assigns = {ast.unparse(n) for n in ast.walk(speculative) if isinstance(n, ast.Assign)}
    assert "n_predict = getattr(self.draft_model_config.hf_config, 'n_predict', None)" in assigns
    assert "self.num_speculative_tokens = n_predict" in assigns
    v1, v2 = "vllm/v1/spec_decode/dflash.py", "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"
    for path in (_QWEN3_DFLASH, v1, v2):
        tree = ast.parse(_source(wheel, path))
        reads = [ast.unparse(n) for n in ast.walk(tree)
                 if (isinstance(n, ast.Attribute) and n.attr == "block_size" and "config" in ast.unparse(n.value))
                 or (isinstance(n, ast.Constant) and n.value == "block_size")]
        assert not reads, (path, reads)
    assert "num_query_per_req = 1 + self.num_speculative_tokens" in _source(wheel, v1)
    assert "num_query_per_req = 1 + self.num_speculative_steps" in _source(wheel, v2)


def test_vllm_0_26_serves_no_dflash2(tmp_path, vllm, wheel):
    """engines.py's row for vLLM 0.26.0: no `dflash2` speculators type, no DFlash2DraftModel architecture, so
    both DFlash 2 exports stop at start-up (the speculators one here, by its own loader)."""
    _, _, paths = _export(tmp_path, dflash2=True)
    assert "dflash" in vllm.algos.SUPPORTED_SPECULATORS_TYPES
    assert "dflash2" not in vllm.algos.SUPPORTED_SPECULATORS_TYPES
    with pytest.raises(ValueError, match="speculators-format"):
        _draft_hf_config(vllm, paths["speculators"])
    native = _draft_hf_config(vllm, paths["native"])
    assert native.architectures == ["DFlash2DraftModel"]  # EAGLEConfig keeps a name starting with DFlash
    registry = ast.parse(_source(wheel, "vllm/model_executor/models/registry.py"))
    architectures = {
        k.value: tuple(e.value for e in v.elts)
        for n in ast.walk(registry) if isinstance(n, ast.Dict) for k, v in zip(n.keys, n.values)
        if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple)
        and all(isinstance(e, ast.Constant) for e in v.elts)
    }
    assert architectures["DFlashDraftModel"] == ("qwen3_dflash", "DFlashQwen3ForCausalLM")
    assert not any("DFlash2" in name for name in architectures)
