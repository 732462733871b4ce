"""The pipeline is one DAG of results, on the real Prefect and S3 servers with a real tokenizer and a
tiny real model: a run on a dataset of its own trains on exactly the shards its tokenize stage made
(by sha256, in the checkpoint's manifest), never on the held-out split, and evaluates on the
held-out split; a training shard holding a held-out prompt id is refused; a stage started alone
takes the URI of its upstream's result.json.

Run: `.venv/bin/python -m pytest -q tests/integration/test_dag.py`
"""

from __future__ import annotations

import json
import uuid

import pytest

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import read_manifest
from tests.unit.conftest_tokenize import jsonl, make_record


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer, deep enough to tap (>= 4 layers)."""
    from tests.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("dag-target"), num_layers=4)


def _records(prefix: str, count: int) -> bytes:
    return jsonl(*[make_record(id=f"{prefix}{i}", source="mine", reasoning=None, generation={"model": "unit"},
                               prompt=[{"role": "user", "content": f"Question {prefix}{i}: name a colour."}],
                               content=f"Answer {i}: a colour such as blue, green or red, in a few words.")
                   for i in range(count)])


def _put_completions(store, settings, dataset: str, shards: dict[str, bytes]) -> str:
    for name, data in shards.items():
        store.put_bytes(artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, dataset, "r1", name), data)
    return store.uri(artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, dataset, "r1")) + "/"


def _stages(tiny_target, tmp_path, run_name: str) -> dict:
    from flows.evaluate import EvaluateParams
    from flows.export import ExportParams
    from flows.tokenize import TokenizeParams
    from flows.train import TrainFlowParams

    config = {"run_name": run_name, "target": str(tiny_target), "output_dir": str(tmp_path / "runs"),
              "token_budget": 96, "max_steps": 4, "checkpoint_every": 4, "log_every": 2,
              "validate_capture_batches": 1,
              "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0}}
    return {"tokenization": TokenizeParams(tokenizer_dir=str(tiny_target), workers=1),
            "training": TrainFlowParams(config=config),
            "evaluation": EvaluateParams(num_prompts=2, max_new_tokens=6, modes=["block"]),
            "export": ExportParams(formats=["native"])}


def test_a_pipeline_on_its_own_dataset_trains_on_its_shards_and_evaluates_held_out(
        prefect_server, store, env_settings, tiny_target, tmp_path):
    from flows.pipeline import PipelineParams, pipeline

    dataset = f"dag-{uuid.uuid4().hex[:8]}"
    completions = _put_completions(store, env_settings, dataset, {
        "shard-00000.jsonl": _records("a", 8), "shard-00001.jsonl": _records("b", 8),
        "heldout-00000.jsonl": _records("h", 3)})
    run_name = f"dag-{tmp_path.name}"[:50]
    stages = _stages(tiny_target, tmp_path, run_name)
    stages["tokenization"].completions = completions  # the first stage's input: from the form
    state = pipeline(PipelineParams(**stages), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    tokenized, checkpoint, evaluation = result.tokenization, result.training, result.evaluation

    # tokenize made the dataset's own shards, split as the completions were
    assert [s.uri.rsplit("/", 1)[-1] for s in tokenized.train_shards] == ["shard-00000.arrow", "shard-00001.arrow"]
    assert [s.uri.rsplit("/", 1)[-1] for s in tokenized.heldout_shards] == ["heldout-00000.arrow"]
    assert all(f"/tokenized/{dataset}/r1/" in s.uri for s in tokenized.train_shards + tokenized.heldout_shards)
    assert sorted(tokenized.heldout_prompt_ids) == ["h0", "h1", "h2"]

    # train read exactly those shards: the checkpoint's manifest lists their sha256, and nothing else
    expected = [(s.uri, s.sha256) for s in tokenized.train_shards]
    assert [(s.uri, s.sha256) for s in checkpoint.data] == expected
    weights = read_manifest(store, store.key_of(checkpoint.uri) + "/model.safetensors")
    assert [(ref.uri, ref.sha256) for ref in weights.inputs] == expected
    assert checkpoint.dataset.result_uri == tokenized.result_uri and checkpoint.step == 4
    assert checkpoint.run_yaml and checkpoint.provenance and checkpoint.metrics

    # evaluate measured the held-out split, and says so in its report
    assert evaluation.split == "heldout" and evaluation.checkpoint == checkpoint.uri
    assert evaluation.prompts == [s.uri for s in tokenized.heldout_shards]
    report = json.loads(store.get_bytes(store.key_of(evaluation.report)))
    assert report["measured_on"].startswith("held-out prompts") and report["config"]["split"] == "heldout"
    assert {ref.uri for ref in read_manifest(store, store.key_of(evaluation.report)).inputs} >= \
        {s.uri for s in tokenized.heldout_shards}

    # export took the checkpoint it was handed
    assert result.export.checkpoint == checkpoint.uri and set(result.export.exports) == {"native"}
    assert read_manifest(store, f"exports/{run_name}/native/config.json").inputs[0].uri == \
        f"{checkpoint.uri}/model.safetensors"
    # every stage's result is stored, so each can be started alone from its upstream's URI
    for stage in (result.tokenization, result.training, result.evaluation, result.export):
        assert store.exists(store.key_of(stage.result_uri)), stage.kind


def test_in_sample_evaluation_is_asked_for_and_labelled(prefect_server, store, env_settings, tiny_target,
                                                        tmp_path):
    """A stage alone from its form: evaluate takes the train result's URI and measures the training split."""
    from flows.evaluate import EvaluateParams, evaluate
    from flows.pipeline import PipelineParams, pipeline

    dataset = f"dag-{uuid.uuid4().hex[:8]}"
    completions = _put_completions(store, env_settings, dataset, {"shard-00000.jsonl": _records("a", 8),
                                                                  "heldout-00000.jsonl": _records("h", 2)})
    stages = _stages(tiny_target, tmp_path, f"ins-{tmp_path.name}"[:50])
    stages["tokenization"].completions = completions
    trained = pipeline(PipelineParams(tokenization=stages["tokenization"], training=stages["training"])).training
    state = evaluate(EvaluateParams(checkpoint=trained.result_uri, split="train", num_prompts=2, max_new_tokens=4,
                                    modes=["block"]), return_state=True)
    assert state.is_completed(), state
    report = state.result()
    assert report.split == "train" and report.prompts == [trained.data[0].uri]
    assert json.loads(store.get_bytes(store.key_of(report.report)))["measured_on"].startswith("IN-SAMPLE")


def test_a_training_shard_holding_a_held_out_prompt_id_is_refused(prefect_server, store, env_settings,
                                                                  tiny_target):
    from flows.tokenize import HeldOutLeak, TokenizeParams, tokenize

    dataset = f"leak-{uuid.uuid4().hex[:8]}"
    completions = _put_completions(store, env_settings, dataset, {
        "shard-00000.jsonl": _records("a", 6) + _records("h", 1), "heldout-00000.jsonl": _records("h", 2)})
    state = tokenize(TokenizeParams(completions=completions, tokenizer_dir=str(tiny_target), workers=1),
                     return_state=True)
    assert state.is_failed()
    with pytest.raises(HeldOutLeak, match=r"1 training samples have held-out prompt ids \(h0 in shard-00000.jsonl\)"):
        state.result()
    assert not list(store.list(f"tokenized/{dataset}/")), "refused before any shard was written"


def test_the_form_is_checked_as_a_dag_before_anything_runs():
    """One source per stage input: the stage before it, or the form; said at once, not hours in."""
    from pydantic import ValidationError

    from flows.evaluate import EvaluateParams
    from flows.pipeline import PipelineParams
    from flows.tokenize import TokenizeParams
    from flows.train import TrainFlowParams

    with pytest.raises(ValidationError, match="the training stage needs dataset: add a tokenization stage or set "
                                              "training.dataset"):
        PipelineParams(training=TrainFlowParams(config={"target": "embedded"}))
    with pytest.raises(ValidationError, match="training.dataset is set, but the tokenization stage's result is its "
                                              "input: leave it empty"):
        PipelineParams(tokenization=TokenizeParams(completions="s3://b/completions/d/r/"),
                       training=TrainFlowParams(config={"target": "embedded", "data": ["s3://b/x.arrow"]}))
    with pytest.raises(ValidationError, match="the evaluation stage needs checkpoint"):
        PipelineParams(evaluation=EvaluateParams())
    PipelineParams(evaluation=EvaluateParams(checkpoint="s3://b/reports/train/r/x/attempt-1/result.json"))
