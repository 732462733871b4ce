"""A real consumer loads our speculators-format export: speculators 0.9's own DFlash model class,
given the same target features, must produce the same draft logits as our drafter.

speculators is a test-time dependency installed with --no-deps (see the test report); the module
skips cleanly when it is absent.

Run: .venv/bin/python -m pytest tests/integration/test_speculators_parity.py -q
"""

import dataclasses
import warnings

import pytest
import torch

pytest.importorskip("speculators.models.dflash", reason="speculators==0.9.0 is not installed")

from dflash_core.export import export_drafter  # noqa: E402
from dflash_core.model import DFlashConfig  # noqa: E402
from dflash_core.model.build import build_drafter  # noqa: E402
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.anchors import BlockPlan  # noqa: E402
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config  # noqa: E402

_SEQ, _BLOCK = 24, 4
_ANCHORS = [3, 9, 15]


def _drafter_and_target(tmp_path, *, layer_types=None, sliding_window=None, family="qwen3", intermediate_size=None):
    torch.manual_seed(0)
    target_config = tiny_target_config(family, **({"num_layers": 8} if family == "qwen3_5" else {}))
    target = build_target(target_config)
    verifier_dir = tmp_path / "verifier"
    target.save_pretrained(verifier_dir)
    config = DFlashConfig.from_target(
        target_config, num_layers=2, block_size=_BLOCK, num_tapped_layers=2,
        layer_types=layer_types, sliding_window=sliding_window,
    )
    if intermediate_size is not None:  # drafter.intermediate_size: an MLP narrower than the target's
        config = dataclasses.replace(config, intermediate_size=intermediate_size)
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0))
    with torch.no_grad():  # norms start at 1: perturb them so a skipped norm would show
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    drafter.attach_target(target_heads(target))
    return target, target_config, drafter, verifier_dir


def _load_with_speculators(path):
    from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash
    from speculators.models.dflash import DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex needs torch.compile; sdpa runs anywhere
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SpeculatorsDFlash.from_pretrained(path, config=config).eval()


def _speculators_logits(model, target, input_ids, final_hidden):
    """What a speculators consumer does: its aux ids index transformers' hidden_states directly."""
    with torch.no_grad():
        states = target(input_ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[k] for k in model.target_layer_ids], dim=-1)
        loss_mask = torch.zeros(1, _SEQ, dtype=torch.long)
        loss_mask[0, _ANCHORS] = 1  # exactly as many valid positions as anchors: no random choice
        _, logits, *_ = model._backbone_forward(
            aux, input_ids, loss_mask, final_hidden, torch.zeros(1, _SEQ, dtype=torch.long),
            max_anchors=len(_ANCHORS),
        )
    return logits.view(len(_ANCHORS), _BLOCK, -1)[:, 1:]


def _our_logits(drafter, target, config, input_ids):
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    plan = BlockPlan.at_anchors(_ANCHORS, seq_len=_SEQ, block_size=_BLOCK)
    with torch.no_grad():
        output, _, _ = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                               attention_backend="sdpa")
        return drafter.target_heads.lm_head(output.hidden_BAKH[0]), captured.final_hidden


@pytest.mark.parametrize(
    ("family", "layer_types", "window", "mlp"),
    [("qwen3", None, None, None), ("qwen3", ["sliding_attention", "full_attention"], 64, None),
     ("llama", None, None, None), ("qwen3_5", None, None, None), ("qwen3", None, None, 48)],
    ids=["qwen3", "qwen3-sliding-window-carried", "llama", "qwen3_5-hybrid", "qwen3-narrow-mlp"],
)
def test_speculators_loads_our_export_and_gives_the_same_logits(tmp_path, family, layer_types, window, mlp):
    target, target_config, drafter, verifier_dir = _drafter_and_target(
        tmp_path, layer_types=layer_types, sliding_window=window, family=family, intermediate_size=mlp
    )
    paths = export_drafter(drafter, target_config=target_config, out_dir=tmp_path / "export",
                           verifier_name_or_path=str(verifier_dir), formats=("speculators",))
    theirs = _load_with_speculators(paths["speculators"])

    assert theirs.target_layer_ids == [k + 1 for k in drafter.config.target_layer_ids]
    assert theirs.mask_token_id == drafter.config.mask_token_id
    assert theirs.block_size == _BLOCK
    assert theirs.sliding_window_indices == [i for i, t in enumerate(drafter.config.layer_types) if t != "full_attention"]
    if window:
        assert theirs.sliding_window == window
    # It reloaded the verifier-owned weights from the verifier path our config names.
    assert torch.equal(theirs.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(theirs.lm_head.weight, target.lm_head.weight)

    input_ids = torch.randint(1, target_config.vocab_size, (1, _SEQ))
    ours, final_hidden = _our_logits(drafter, target, drafter.config, input_ids)
    torch.testing.assert_close(_speculators_logits(theirs, target, input_ids, final_hidden), ours,
                               atol=1e-4, rtol=1e-4)


def test_an_off_by_one_layer_id_would_be_caught(tmp_path):
    """The check above is sensitive to the offset: taps one layer off give different logits."""
    target, target_config, drafter, verifier_dir = _drafter_and_target(tmp_path)
    paths = export_drafter(drafter, target_config=target_config, out_dir=tmp_path / "export",
                           verifier_name_or_path=str(verifier_dir), formats=("speculators",))
    theirs = _load_with_speculators(paths["speculators"])
    theirs.config.aux_hidden_state_layer_ids = list(drafter.config.target_layer_ids)  # the classic bug
    input_ids = torch.randint(1, target_config.vocab_size, (1, _SEQ))
    ours, final_hidden = _our_logits(drafter, target, drafter.config, input_ids)
    assert not torch.allclose(_speculators_logits(theirs, target, input_ids, final_hidden), ours, atol=1e-3)
