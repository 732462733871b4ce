"""Nothing that failed the quality gate reaches training: a tokenized dataset with 87% empty responses
(the gate's own verdict, written beside it as the tokenize flow writes it) is refused by `dflash train`
and by the training flow, naming the shard and the failed check; the explicit override trains and is
recorded in run.yaml and in the checkpoint manifests.

Run: `.venv/bin/python -m pytest -q tests/integration/test_train_gate.py`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from dflash_core.data.verdict import DATASET_MANIFEST_NAME, PENDING, DatasetManifest, verdict_from_problems
from dflash_core.layout import ArtifactKind
from dflash_core.lineage import input_ref, read_manifest, write_artifact
from dflash_core.tokenize import GateThresholds, arrow_bytes, check_gate, sample_frame, skipped_frame, summarize
from dflash_core.tokenize.shard import FLAG_COLUMNS

ROOT = Path(__file__).resolve().parents[2]


def _mostly_empty_table(num_samples: int = 100, empty: int = 87) -> pa.Table:
    """87 of 100 responses are 6 loss tokens of boilerplate, as in the field's failed 914K-sample set."""
    rng = np.random.default_rng(0)
    ids, masks = [], []
    for index in range(num_samples):
        loss = 6 if index < empty else 30
        ids.append(rng.integers(1, 200, size=10 + loss).tolist())
        masks.append([0] * 10 + [1] * loss)
    return pa.table({
        "id": [f"s{i}" for i in range(num_samples)], "source": ["chat"] * num_samples,
        "input_ids": pa.array(ids, type=pa.list_(pa.uint32())), "loss_mask": pa.array(masks, type=pa.list_(pa.uint8())),
        "num_tokens": pa.array([len(x) for x in ids], type=pa.int32()),
        "num_loss_tokens": pa.array([sum(m) for m in masks], type=pa.int32()),
        **{flag: pa.array([False] * num_samples) for flag in FLAG_COLUMNS},
    })


@pytest.fixture
def failed_dataset(store) -> tuple[str, str]:
    """(prefix, shard key) of a tokenized dataset whose gate failed, laid out as the tokenize flow leaves it."""
    prefix = f"tokenized/gate-{uuid.uuid4().hex[:8]}/run-a"
    table = _mostly_empty_table()
    shard_key = f"{prefix}/shard-00000.arrow"
    write_artifact(store, shard_key, arrow_bytes(table, metadata=PENDING.arrow_metadata()), kind=ArtifactKind.TOKENIZED)
    samples = sample_frame(table, shard="shard-00000")
    problems = check_gate(summarize(samples, skipped_frame([], shard="shard-00000")), GateThresholds())
    assert "max_short_fraction" in {p.check for p in problems}
    manifest = DatasetManifest(dataset="gate", run="run-a", gate=verdict_from_problems(problems, overridden=False),
                               shards={"shard-00000.arrow": input_ref(store, shard_key).sha256}, samples=100)
    write_artifact(store, f"{prefix}/{DATASET_MANIFEST_NAME}", manifest.to_bytes(), kind=ArtifactKind.TOKENIZED)
    return prefix + "/", shard_key


def _config(tmp_path: Path, name: str, data: list[str]) -> Path:
    config = {"run_name": name, "target": "tiny:llama", "data": data, "output_dir": str(tmp_path / "runs"),
              "token_budget": 96, "max_steps": 2, "checkpoint_every": 2, "log_every": 1,
              "validate_capture_batches": 1,
              "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def _dflash_train(config: Path, settings, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DFLASH_WORK_DIR": str(settings.work_dir),
           "DFLASH_S3_ENDPOINT_URL": settings.s3_endpoint_url, "DFLASH_S3_BUCKET": settings.s3_bucket,
           "DFLASH_S3_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
           "DFLASH_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value()}
    return subprocess.run([sys.executable, "-m", "dflash_core.cli", "train", "--config", str(config), *extra],
                          env=env, capture_output=True, text=True, timeout=300, cwd=config.parent)


@pytest.mark.slow  # two `dflash train` processes
def test_dflash_train_refuses_a_failed_dataset_and_records_the_override(store, settings, failed_dataset,
                                                                        tmp_path) -> None:
    prefix, shard_key = failed_dataset
    refused = _dflash_train(_config(tmp_path, "refused", [prefix]), settings)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert f"{store.uri(shard_key)}: quality gate failed (dataset.json of gate/run-a)" in output
    assert "max_short_fraction" in output and "87% of samples have <= 8 loss tokens" in output
    assert not (tmp_path / "runs" / "refused" / "checkpoints").exists() or \
        not any((tmp_path / "runs" / "refused" / "checkpoints").iterdir()), "nothing trained"

    run_name = f"override-{uuid.uuid4().hex[:6]}"
    allowed = _dflash_train(_config(tmp_path, run_name, [prefix]), settings, "--set", "allow_failed_quality_gate=true")
    assert allowed.returncode == 0, (allowed.stdout + allowed.stderr)[-3000:]
    assert "allow_failed_quality_gate is set: training on" in allowed.stdout + allowed.stderr
    run_yaml = yaml.safe_load((tmp_path / "runs" / run_name / "run.yaml").read_text())
    assert run_yaml["allow_failed_quality_gate"] is True
    manifest = read_manifest(store, f"checkpoints/{run_name}/step-000002/model.safetensors")
    assert manifest.config["allow_failed_quality_gate"] is True
    assert [ref.uri for ref in manifest.inputs if ref.role is None] == [store.uri(shard_key)]


def test_training_flow_refuses_a_failed_dataset(prefect_server, store, env_settings, failed_dataset, tmp_path) -> None:
    from flows.train import TrainFlowParams, train

    prefix, shard_key = failed_dataset
    config = json.loads(_config(tmp_path, f"flow-{uuid.uuid4().hex[:6]}", [prefix]).read_text())
    state = train(TrainFlowParams(config=config), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception) as error:
        state.result()
    assert f"{store.uri(shard_key)}: quality gate failed" in str(error.value)
    assert "max_short_fraction" in str(error.value)
