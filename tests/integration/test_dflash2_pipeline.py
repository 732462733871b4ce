"""DFlash 2 end to end from one setting (`drafter.variant: dflash2`): the real Trainer trains a tiny
drafter on CPU and learns, a resumed run continues exactly, the checkpoint reloads as DFlash 2 for
the evaluator (selector path; output = the target's greedy decoding) and exports in both formats;
z-lab's `DFlash2DraftModel` loads the native export with no missing or unexpected keys and drafts
what our drafter drafts.

Run: .venv/bin/python -m pytest tests/integration/test_dflash2_pipeline.py -q
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dflash_core.evaluate import SpeculativeDecoder, greedy_decode
from dflash_core.evaluate.inputs import load_drafter_checkpoint
from dflash_core.export import export_drafter, load_drafter, read_export_config
from dflash_core.model.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_core.target import HiddenStateCapture, target_heads
from dflash_core.train.config import TrainConfig
from dflash_core.train.assemble import build_trainer
from dflash_core.train.loop import Trainer
from tests.unit.test_trainer import tiny_config

_DFLASH2 = {"variant": "dflash2", "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
            "selector_top_k": 4}


def _config(tmp_path, **changes) -> TrainConfig:
    """test_trainer's tiny run (1 layer, B=4, data labels), 30 steps, as DFlash 2."""
    config = tiny_config(tmp_path, **{"max_steps": 30, "checkpoint_every": 1000, "log_every": 10, **changes})
    config.drafter = type(config.drafter).model_validate({**config.drafter.model_dump(), **_DFLASH2})
    return config


def _records(trainer: Trainer) -> list[dict]:
    return [json.loads(line) for line in trainer.run_dir.joinpath("metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DFlash 2 run of 30 steps (loss 10.9 -> 1.7, selector acceptance 1.1 -> 2.2 seen): (trainer, checkpoint dir)."""
    trainer = build_trainer(_config(tmp_path_factory.mktemp("dflash2-run")))
    result = trainer.run()
    trainer.close()
    return trainer, result.checkpoint


def test_the_setting_trains_a_dflash2_drafter_that_learns(trained):
    trainer, checkpoint = trained
    assert isinstance(trainer.drafter, DFlash2DraftModel) and isinstance(trainer.drafter_config, DFlash2Config)
    assert trainer.drafter_config.selector_rank == 8 and trainer.drafter_config.selector_top_k == 4
    first, last = (record["window"] for record in _records(trainer)[::2])
    for name in ("selector_loss", "dflash_loss", "unary_topk_recall", "selector_acceptance_length"):
        assert name in last, name
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert last["selector_acceptance_length"] > first["selector_acceptance_length"] + 0.5
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["drafter_config"]["selector_rank"] == 8


def test_resume_continues_identically_and_refuses_the_other_variant(tmp_path):
    straight = build_trainer(_config(tmp_path / "a", max_steps=4, checkpoint_every=2, log_every=1))
    straight.run()
    first = build_trainer(_config(tmp_path / "b", max_steps=2, checkpoint_every=2, log_every=1))
    first.run()
    second = build_trainer(_config(tmp_path / "b", max_steps=4, checkpoint_every=2, log_every=1))
    assert second.resume() and second.step == 2
    second.run()
    drop = ("tokens_per_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in _records(second)] == \
        [{k: v for k, v in r.items() if k not in drop} for r in _records(straight)]
    as_dflash = tiny_config(tmp_path / "b", max_steps=4)
    as_dflash.drafter = as_dflash.drafter.model_copy(update={"variant": "dflash"})
    with pytest.raises(ValueError, match="variant is 'dflash'"):  # the same run, as a DFlash one
        build_trainer(as_dflash).resume()


def test_checkpoint_evaluates_on_the_selector_path_and_equals_greedy_decoding(trained):
    trainer, checkpoint = trained
    drafter = load_drafter_checkpoint(checkpoint)
    assert isinstance(drafter, DFlash2DraftModel)
    drafter.attach_target(target_heads(trainer.target))
    prompt = trainer.corpus.tokens[:10].tolist()
    decoded = SpeculativeDecoder(target=trainer.target, drafter=drafter).generate(prompt, max_new_tokens=24)
    assert decoded.tokens == greedy_decode(trainer.target, prompt, max_new_tokens=24).tokens
    with pytest.raises(ValueError, match="DFlash-only"):
        SpeculativeDecoder(target=trainer.target, drafter=drafter, mode="tree")


def test_exports_load_back_and_zlab_loads_the_native_one(trained, tmp_path):
    trainer, checkpoint = trained
    drafter = load_drafter_checkpoint(checkpoint)
    paths = export_drafter(drafter, target_config=trainer.target.config, out_dir=tmp_path,
                           verifier_name_or_path="/models/tiny-llama")
    native = json.loads((paths["native"] / "config.json").read_text())
    assert native["architectures"] == ["DFlash2DraftModel"] and native["is_causal"] is False
    assert native["dflash_config"]["selector_rank"] == 8 and native["dflash_config"]["causal"] is False
    assert read_export_config(paths["speculators"])[0] == "speculators"
    for path in paths.values():
        again = load_drafter(path)
        assert isinstance(again, DFlash2DraftModel) and again.config == drafter.config
        assert all(torch.equal(again.state_dict()[k], v) for k, v in drafter.state_dict().items())

    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, info = zlab.DFlash2DraftModel.from_pretrained(paths["native"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # Same proposals: z-lab drafts one block from the prompt's target features and the anchor token.
    target = trainer.target
    drafter.attach_target(target_heads(target))
    prompt = torch.tensor([trainer.corpus.tokens[:12].tolist()])
    capture = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=False)
    tapped = capture(prompt).tapped_hidden
    capture.close()
    block_ids = torch.full((1, drafter.config.block_size), reference.mask_token_id)
    block_ids[0, 0] = prompt[0, -1]
    with torch.no_grad():
        hidden = reference.eval()(
            target_hidden=tapped[:, :-1], noise_embedding=target.get_input_embeddings()(block_ids),
            position_ids=torch.arange(prompt.shape[1] - 1 + block_ids.shape[1])[None], use_cache=False,
        )[:, 1:]
        theirs, _, _ = reference.propose(hidden, block_ids[:, 0], target.lm_head, 0.0)
    cache = drafter.new_cache()
    context_len = prompt.shape[1] - 1
    drafter.extend_context(cache, target_hidden=tapped[:, :context_len], position_ids=torch.arange(context_len)[None])
    ours = drafter.draft_tokens(cache, last_token_ids=prompt[:, -1], position_ids=torch.tensor([context_len]))
    assert torch.equal(theirs, ours)
