"""A checkpoint's own manifest names what it was trained for as well as on: the shards read, then the target's
files (config, weights, tokenizer) by sha256, as the train flow's result names them
(`dflash_core.lineage_refs.target_refs`, what tasks/artifacts.py `target_inputs` calls). Trained on the real
SeaweedFS with a tiny model dir as the target.

Run: `.venv/bin/python -m pytest tests/integration/test_checkpoint_target_inputs.py -q -n 0`
"""

from __future__ import annotations

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import TARGET_MODEL, TOKENIZER, read_manifest, write_artifact
from dflash_core.lineage_refs import DigestCache
from dflash_core.storage import sha256_file
from dflash_core.defaults import default_num_anchors
from dflash_core.train.checkpoint import _FILES
from dflash_core.train.config import TrainConfig
from tests.train_fixtures import synthetic_shard


def test_the_checkpoint_manifest_names_the_shards_then_the_targets_files(store, prefix, tiny_target, tmp_path,
                                                                        one_thread) -> None:
    from dflash_core.train.assemble import build_trainer

    shard = synthetic_shard(tmp_path / "src" / "shard-00000.arrow", num_samples=40, min_len=12, max_len=24)
    shard_key = f"{prefix}/tokenized/shard-00000.arrow"
    write_artifact(store, shard_key, shard, kind=ArtifactKind.TOKENIZED)
    config = TrainConfig.model_validate({
        "run_name": "with-target", "target": str(tiny_target), "data": [shard_key],
        "output_dir": str(tmp_path / "runs"),
        "token_budget": 96, "max_steps": 2, "checkpoint_every": 2, "log_every": 1, "upload_checkpoints": True,
        "validate_capture_batches": 0, "drafter": {"num_layers": 1, "block_size": 4, "loss_gamma": 4.0}})
    digests = DigestCache(tmp_path / "cache" / "sha256.json")
    trainer = build_trainer(config, store=store, models_dir=tmp_path / "models", digests=digests,
                            checkpoint_prefix=f"{prefix}/checkpoints/with-target")
    try:
        trainer.run()
    finally:
        trainer.close()

    step = f"{prefix}/checkpoints/with-target/step-000002"
    weights = read_manifest(store, f"{step}/model.safetensors")
    shard_refs, target_refs = weights.inputs[:1], weights.inputs[1:]
    assert [(ref.uri, ref.sha256, ref.role) for ref in shard_refs] == \
        [(store.uri(shard_key), store.head(shard_key).sha256, None)]
    files = {ref.uri.rsplit("/", 1)[-1]: ref for ref in target_refs}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    for name, ref in files.items():
        assert ref.uri == (tiny_target / name).as_uri() and ref.sha256 == sha256_file(tiny_target / name), ref
        assert ref.role == (TOKENIZER if name.startswith(("tokenizer", "special_tokens", "chat_template"))
                            else TARGET_MODEL), ref
    assert all(read_manifest(store, f"{step}/{name}").inputs == weights.inputs for name in _FILES)
    assert weights.config["drafter"]["num_anchors"] == default_num_anchors(96)  # resolved, never None
    assert str(tiny_target / "model.safetensors") in digests.path.read_text(), "the weights were not cached"
