"""The pipeline is one DAG of results, on the real Prefect and S3 servers with a real tokenizer and a
tiny real model: a run (`whole_run`, the session's whole DAG from one form, shared with
test_real_run.py) trains on exactly the shards its tokenize stage made (by sha256, in the checkpoint's
manifest), never on the held-out split, and evaluates on the held-out split; every node it made has a
lineage page in the UI and the run's page its S3 usage and summary; a training shard holding a held-out
prompt id is refused; a stage started alone takes the URI of its upstream's result.json.

Run: `.venv/bin/python -m pytest -q tests/integration/test_dag.py`
"""

from __future__ import annotations

import json
import re
import uuid

import pytest

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import read_manifest
from tests.integration.shared_runs import TRAIN_STEPS, export_settings
from tests.unit.conftest_tokenize import jsonl, make_record


def _records(prefix: str, count: int) -> bytes:
    return jsonl(*[make_record(id=f"{prefix}{i}", source="mine", reasoning=None, generation={"model": "unit"},
                               prompt=[{"role": "user", "content": f"Question {prefix}{i}: name a colour."}],
                               content=f"Answer {i}: a colour such as blue, green or red, in a few words.")
                   for i in range(count)])


def _put_completions(store, settings, dataset: str, shards: dict[str, bytes]) -> str:
    for name, data in shards.items():
        store.put_bytes(artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, dataset, "r1", name), data)
    return store.uri(artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, dataset, "r1")) + "/"


def _names(shards) -> list[str]:
    return [s.uri.rsplit("/", 1)[-1] for s in shards]


def test_a_pipeline_trains_on_its_tokenize_stages_shards_and_evaluates_held_out(whole_run, store, settings,
                                                                                 tiny_target):
    state, result = whole_run.state, whole_run.result
    assert state.is_completed(), state
    generation, tokenized, checkpoint, evaluation = (result.generation, result.tokenization, result.training,
                                                     result.evaluation)

    # tokenize made the dataset's own shards, split as the completions were
    by_split = {split: [n.removesuffix(".jsonl") + ".arrow" for n in _names(s for s in generation.shards
                                                                          if s.split == split)]
                for split in ("train", "heldout")}
    assert _names(tokenized.train_shards) == by_split["train"] == ["shard-00000.arrow", "shard-00001.arrow"]
    assert _names(tokenized.heldout_shards) == by_split["heldout"] == ["heldout-00000.arrow"]
    assert all(f"/tokenized/{generation.dataset}/{generation.run}/" in s.uri
               for s in tokenized.train_shards + tokenized.heldout_shards)
    assert sorted(tokenized.heldout_prompt_ids) == sorted(generation.heldout_prompt_ids)
    assert len(tokenized.heldout_prompt_ids) == 2

    # train read exactly those shards: the checkpoint's manifest lists their sha256, and nothing else
    expected = [(s.uri, s.sha256) for s in tokenized.train_shards]
    assert [(s.uri, s.sha256) for s in checkpoint.data] == expected
    weights = read_manifest(store, store.key_of(checkpoint.uri) + "/model.safetensors")
    assert [(ref.uri, ref.sha256) for ref in weights.inputs if ref.role is None] == expected
    assert any(ref.role for ref in weights.inputs)  # and the target it was trained for, by its files
    assert checkpoint.dataset.result_uri == tokenized.result_uri and checkpoint.step == TRAIN_STEPS
    assert checkpoint.run_yaml and checkpoint.provenance and checkpoint.metrics

    # evaluate measured the held-out split, and says so in its report
    assert evaluation.split == "heldout" and evaluation.checkpoint == checkpoint.uri
    assert evaluation.prompts == [s.uri for s in tokenized.heldout_shards]
    # ... and set it beside the training tau, with how many times training went over its data
    fit, trained = evaluation.generalization, checkpoint.final_metrics
    assert trained["data_passes"] > 0 and fit["data_passes"] == trained["data_passes"]
    assert fit["train_tau"] == trained["window_acceptance_length_empirical"]
    assert fit["heldout_tau"] == evaluation.summaries[0]["tau"] and isinstance(fit["overfit"], bool)
    report = json.loads(store.get_bytes(store.key_of(evaluation.report)))
    assert report["measured_on"].startswith("held-out prompts") and report["config"]["split"] == "heldout"
    assert {ref.uri for ref in read_manifest(store, store.key_of(evaluation.report)).inputs} >= \
        {s.uri for s in tokenized.heldout_shards}

    # export took the checkpoint it was handed
    assert result.export.checkpoint == checkpoint.uri and set(result.export.exports) == {"native"}
    assert read_manifest(store, f"exports/{whole_run.name}/native/config.json").inputs[0].uri == \
        f"{checkpoint.uri}/model.safetensors"
    # every stage's result is stored, so each can be started alone from its upstream's URI
    for stage in (result.generation, result.tokenization, result.training, result.evaluation, result.export):
        assert store.exists(store.key_of(stage.result_uri)), stage.kind
    _check_the_evidence(store, settings, state, result, tiny_target)


def _artifacts(flow_run_ids: list[str]) -> dict[str, object]:
    """The newest artifact of each key these flow runs made."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=flow_run_ids)), sort=ArtifactSort.CREATED_DESC)
    artifacts: dict[str, object] = {}
    for artifact in found:
        artifacts.setdefault(artifact.key, artifact)
    return artifacts


def _names_completions(page: str) -> bool:
    """A completions node among the page's parents, linked to its own lineage page or not."""
    return re.search(r"completions (`|\[)completions/", page) is not None


def _check_the_evidence(store, settings, state, result, tiny_target) -> None:
    """Each node a stage made has a lineage page naming its producer (flow run and task run, linked), its inputs
    with hashes (the target's and tokenizer's files among them), its parents (linked to their pages) and what was
    made from it; the pipeline run's page ends with its S3 usage and its summary, linked to those pages."""
    from dflash_core.lineage_views import artifact_url, flow_run_url, task_run_url
    from dflash_core.storage import sha256_file
    from tasks.artifacts import lineage_key

    ui = settings.prefect_api_url
    tokenized, checkpoint, evaluation, export = result.tokenization, result.training, result.evaluation, result.export
    pages = _artifacts([tokenized.flow_run, checkpoint.flow_run, evaluation.flow_run, export.flow_run])
    dataset_node = tokenized.train_shards[0].uri.rsplit("/", 1)[0] + "/"
    page = {name: pages[lineage_key(node)] for name, node in (
        ("tokenized", dataset_node), ("checkpoint", checkpoint.uri + "/"), ("evaluation", evaluation.report),
        ("export", export.exports["native"]))}
    weights = read_manifest(store, store.key_of(checkpoint.uri) + "/model.safetensors")
    verdict = read_manifest(store, store.key_of(tokenized.dataset_manifest))
    assert weights.producer.task_run_id and verdict.producer.task_run_id  # the trainer's task run; a task's
    ckpt = page["checkpoint"].data
    assert flow_run_url(ui, checkpoint.flow_run) in ckpt and task_run_url(ui, weights.producer.task_run_id) in ckpt
    assert f"git `{weights.producer.git_sha}`" in ckpt and f"host `{weights.producer.host}`" in ckpt
    dataset_link = f"tokenized [{store.key_of(dataset_node)}]({artifact_url(ui, str(page['tokenized'].id))})"
    for shard in checkpoint.data:  # its inputs, with hashes, linked to the dataset's page
        assert f"| `{shard.uri.rsplit('/', 1)[-1]}` | tokenized | {dataset_link} | `{shard.sha256}` |" in ckpt
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # the target, by sha256
        assert f"`{sha256_file(tiny_target / name)}`" in ckpt, name
    assert "| target-model |" in ckpt and "| tokenizer |" in ckpt
    fed = ckpt.split("### Fed", 1)[1]  # the later stages added their rows
    assert f"({artifact_url(ui, str(page['evaluation'].id))})" in fed
    assert f"({artifact_url(ui, str(page['export'].id))})" in fed
    edges = ckpt.split("### Lineage graph", 1)[1].split("###", 1)[0]
    assert _names_completions(edges) and "| → | checkpoint " in edges and "mermaid" not in ckpt

    data = page["tokenized"].data
    assert all(f"`{s.uri.rsplit('/', 1)[-1]}`" in data for s in tokenized.train_shards + tokenized.heldout_shards)
    assert f"`{sha256_file(tiny_target / 'tokenizer.json')}`" in data and _names_completions(data)
    assert f"({artifact_url(ui, str(page['checkpoint'].id))})" in data.split("### Fed", 1)[1]
    for name in ("evaluation", "export"):
        assert f"`{sha256_file(tiny_target / 'model.safetensors')}`" in page[name].data
        assert f"({artifact_url(ui, str(page['checkpoint'].id))})" in page[name].data  # its parent's page

    run = _artifacts([str(state.state_details.flow_run_id)])
    usage = run["s3-usage"].data
    assert "This run wrote" in usage and "| checkpoint |" in usage.split("## Written by this run", 1)[1]
    assert "A cleanup would reclaim" in usage and "Unmanifested:" in usage and "by run prefix" in usage
    assert run["s3-usage-by-kind"].data.startswith("data:image/png;base64,")
    summary = run["pipeline-summary"].data
    assert f"[lineage of {store.key_of(checkpoint.uri)}/]({artifact_url(ui, str(page['checkpoint'].id))})" in summary
    assert "| block |" in summary and flow_run_url(ui, checkpoint.flow_run) in summary
    assert any(r["uri"].endswith("/usage.json") for r in result.artifacts)


def test_in_sample_evaluation_is_asked_for_and_labelled(whole_run, store, settings, monkeypatch):
    """A stage alone from its form: evaluate takes the train result's URI and measures the training split."""
    from flows.evaluate import EvaluateParams, evaluate

    export_settings(monkeypatch, settings)
    trained = whole_run.result.training
    state = evaluate(EvaluateParams(checkpoint=trained.result_uri, split="train", num_prompts=2, max_new_tokens=4,
                                    modes=["block"]), return_state=True)
    assert state.is_completed(), state
    report = state.result()
    assert report.split == "train" and report.prompts == [trained.data[0].uri]
    assert json.loads(store.get_bytes(store.key_of(report.report)))["measured_on"].startswith("IN-SAMPLE")


def test_a_training_shard_holding_a_held_out_prompt_id_is_refused(prefect_server, store, env_settings,
                                                                  tiny_target):
    from flows.tokenize import TokenizeParams, tokenize
    from tasks.tokenize_inputs import HeldOutLeak

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
