"""flows/node_stages.py: a form names the target once (`provision.provision.model_dir`), each stage field that
loads it says `@node`, and the pipeline fills those fields with provision's placement, hands generate and train
the node, and sends every stage to the node's own work queue. No servers: the pipeline's stage calls go to a
recorder.

Run: `.venv/bin/python -m pytest -q -n 0 tests/unit/test_node_stages.py`
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from dflash_core.nodes import Node
from dflash_core.stage_results import MODEL_FROM_NODE, Checkpoint, ProvisionedNode

EXAMPLE = Path(__file__).resolve().parents[2] / "infra" / "examples" / "smollm2-1gpu.json"
PLACED = "/dev/shm/dflash-models/smollm2-135m-instruct"  # where provision put the model (its RAM-disk copy)
# (form section, the model field inside it): every field of the example form that says @node
MODEL_PATHS = [("generation", ("engine", "model")), ("tokenization", ("tokenizer_dir",)),
               ("training", ("config", "target")), ("served", ("target",))]


def _example() -> dict:
    return json.loads(EXAMPLE.read_text())


def _set(form: dict, section: str, path: tuple[str, ...], value) -> dict:
    form = copy.deepcopy(form)
    inner = form[section]
    for name in path[:-1]:
        inner = inner[name]
    inner[path[-1]] = value
    return form


def _refusal(form: dict) -> str:
    from flows.pipeline import PipelineParams

    with pytest.raises(ValidationError) as caught:
        PipelineParams.model_validate(form)
    return str(caught.value)


def _provisioned(*, model: str | None = PLACED) -> ProvisionedNode:
    node = Node(name="gpu-local", backend="local", work_dir="/tmp/dflash-node", gpus=1)
    return ProvisionedNode(node=node.model_dump(mode="json"), hostname="h", work_dir="/tmp/dflash-node",
                           venv="/tmp/dflash-node/venv", model=model, num_gpus=1, work_queue="node-gpu-local")


def test_the_example_form_names_the_model_once_and_validates():
    from flows.pipeline import PipelineParams

    params = PipelineParams.model_validate(_example())
    assert params.provision.provision.model_dir == "/tmp/dflash-node/models/smollm2-135m-instruct"
    assert (params.generation.engine.model, params.tokenization.tokenizer_dir, params.training.config.target) == \
        (MODEL_FROM_NODE,) * 3
    assert params.evaluation.target is None  # the checkpoint names its target: allowed beside a provisioned model


@pytest.mark.parametrize(("section", "path"), MODEL_PATHS, ids=[s for s, _ in MODEL_PATHS])
def test_a_second_model_path_is_refused_naming_its_field(section, path):
    message = _refusal(_set(_example(), section, path, "/models/another-copy"))
    name = ".".join((section, *path))
    assert f"{name} is '/models/another-copy'" in message and "provision.provision.model_dir" in message
    assert message.count(" is '") == 1, "only the field that names a second model is refused"


def test_a_generation_without_an_engine_is_refused_beside_a_provisioned_model():
    """No engine is the embedded SmolLM2: another model than the one provision placed."""
    form = _example()
    del form["generation"]["engine"]
    message = _refusal(form)
    assert "generation.engine.model is None" in message and repr(MODEL_FROM_NODE) in message


@pytest.mark.parametrize("without", ["provision", "model_dir"])
def test_at_node_without_a_provisioned_model_is_refused_for_every_field(without):
    form = _example()
    if without == "provision":
        del form["provision"]
    else:
        del form["provision"]["provision"]["model_dir"]
    message = _refusal(form)
    for section, path in MODEL_PATHS:
        assert f"{'.'.join((section, *path))} is '{MODEL_FROM_NODE}', but no provision stage" in message


def test_evaluation_and_export_targets_are_checked_like_the_others_when_set():
    from flows.pipeline import PipelineParams

    form = _example()
    form["evaluation"]["target"] = form["export"]["target"] = MODEL_FROM_NODE
    PipelineParams.model_validate(form)
    form["evaluation"]["target"], form["export"]["target"] = "embedded", "/models/another-copy"
    message = _refusal(form)
    assert "evaluation.target is 'embedded'" in message and "export.target is '/models/another-copy'" in message


def test_model_field_problems_without_a_provision_accepts_named_models():
    from flows.node_stages import model_field_problems
    from flows.pipeline import PipelineParams

    form = _example()
    del form["provision"]
    for section, path in MODEL_PATHS:
        form = _set(form, section, path, "/models/smollm2")
    params = PipelineParams.model_validate(form)
    assert model_field_problems(params, node_model=False) == []
    assert len(model_field_problems(params, node_model=True)) == 4  # the same form beside a provisioned model


def test_on_node_fills_the_model_and_the_node():
    from flows.node_stages import on_node
    from flows.pipeline import PipelineParams

    params = PipelineParams.model_validate(_example())
    node = _provisioned()
    generation = on_node("generation", params.generation, node)
    assert generation.engine.model == PLACED  # the rest of the engine kept
    assert generation.engine.python == params.generation.engine.python == "/tmp/dflash-node/vllm-venv/bin/python"
    assert generation.node == Node.model_validate(node.node)
    training = on_node("training", params.training, node)
    assert training.config.target == PLACED and training.node.name == "gpu-local"
    assert on_node("tokenization", params.tokenization, node).tokenizer_dir == PLACED
    assert on_node("evaluation", params.evaluation, node).target is None  # left to the checkpoint
    assert on_node("evaluation", params.evaluation.model_copy(update={"target": MODEL_FROM_NODE}), node).target == PLACED
    assert params.generation.engine.model == MODEL_FROM_NODE, "the form itself is not changed"
    # a node the form names already is kept; without a provision stage nothing changes
    mine = Node(name="mine", backend="local", work_dir="/tmp/elsewhere")
    assert on_node("training", params.training.model_copy(update={"node": mine}), node).node == mine
    assert on_node("generation", params.generation, None) is params.generation


def test_on_node_refuses_at_node_when_provision_placed_no_model():
    from flows.node_stages import on_node
    from flows.pipeline import PipelineParams

    params = PipelineParams.model_validate(_example())
    with pytest.raises(ValueError, match="tokenization.tokenizer_dir is '@node', but provision placed no model"):
        on_node("tokenization", params.tokenization, _provisioned(model=None))


def test_queue_of_sends_the_node_stages_to_the_node_queue():
    from flows.node_stages import ON_NODE_STAGES, queue_of

    node = _provisioned()
    assert {field: queue_of(field, node) for field in ON_NODE_STAGES} == {field: "node-gpu-local"
                                                                          for field in ON_NODE_STAGES}
    assert queue_of("audit", node) is None and queue_of("generation", None) is None


def test_the_pipeline_sends_each_stage_to_the_node_with_its_model(monkeypatch):
    """flows.pipeline._run_stages through stage_runner: what each stage's run is asked for."""
    import flows.pipeline
    from dflash_core.stage_results import PipelineResult
    from flows.pipeline import PipelineParams

    params = PipelineParams.model_validate(_example())
    calls = []

    def recorder(deployment, stage_params, *, work_queue=None, **kwargs):
        calls.append((deployment, stage_params, work_queue))
        if deployment == "train":
            return Checkpoint(uri="s3://b/checkpoints/r/step-000010", run_name="r", step=10, target=PLACED)
        return f"result of {deployment}"

    monkeypatch.setattr(flows.pipeline, "run_stage", recorder)
    result = PipelineResult(report="s3://b/report.json", sha256="0" * 64, fits=[], provision=_provisioned())
    flows.pipeline._run_stages(params, result)
    assert [(deployment, queue) for deployment, _, queue in calls] == [
        ("generate", "node-gpu-local"), ("tokenize", "node-gpu-local"), ("train", "node-gpu-local"),
        ("evaluate", "node-gpu-local"), ("export", "node-gpu-local"), ("served", "node-gpu-local")]
    generate, tokenize, train, evaluate, export, served = (stage_params for _, stage_params, _ in calls)
    assert generate.engine.model == tokenize.tokenizer_dir == train.config.target == PLACED
    assert generate.node.name == train.node.name == "gpu-local"
    assert tokenize.completions == "result of generate" and train.dataset == "result of tokenize"
    assert evaluate.checkpoint == export.checkpoint == result.training
    assert served.export == "result of export" and served.evaluation == "result of evaluate"
    assert served.target == PLACED and served.python.endswith("vllm-venv/bin/python")


def test_without_a_provision_stage_the_stages_go_to_the_default_queue(monkeypatch):
    import flows.pipeline
    from dflash_core.stage_results import PipelineResult
    from flows.pipeline import PipelineParams

    form = _example()
    del form["provision"]
    for section, path in MODEL_PATHS:
        form = _set(form, section, path, "/models/smollm2")
    for stage in ("training", "evaluation", "export", "served"):
        del form[stage]
    params = PipelineParams.model_validate(form)
    calls = []
    monkeypatch.setattr(flows.pipeline, "run_stage", lambda deployment, stage_params, *, work_queue=None, **kw:
                        calls.append((deployment, stage_params, work_queue)) or deployment)
    flows.pipeline._run_stages(params, PipelineResult(report="r", sha256="0" * 64, fits=[]))
    assert [(d, q) for d, _, q in calls] == [("generate", None), ("tokenize", None)]
    assert calls[0][1].engine.model == "/models/smollm2" and calls[0][1].node is None
