"""flows/deployment_table.py is the one list of deployments: every entry loads, every pipeline stage
has one, names say what runs (tokenize, train-demo), the real pipeline's form carries no demo
defaults, schedules say UTC, descriptions say how to rerun a finished stage and survive the UI.

Run: `.venv/bin/python -m pytest -q tests/unit/test_deployments.py`
"""

from __future__ import annotations

import re


def test_every_stage_has_a_deployment_and_every_entrypoint_loads():
    from flows.deployment_table import DEPLOYMENTS, spec_for
    from flows.deployments import deployment_for, flow_name

    names = [spec.name for spec in DEPLOYMENTS]
    assert len(set(names)) == len(names)
    assert {flow_name(spec.entrypoint) for spec in DEPLOYMENTS} >= {"dflash-export", "dflash-tokenize"}
    assert {stage: spec_for(stage).name for stage in ("generate", "tokenize", "train", "evaluate", "export")} == {
        "generate": "generate", "tokenize": "tokenize", "train": "train", "evaluate": "evaluate", "export": "export"}
    assert deployment_for("export") == "dflash-export/export"
    assert deployment_for("pipeline") == "dflash-pipeline/pipeline"
    assert deployment_for("embedded-demo") == "dflash-pipeline/embedded-demo"


def test_the_demo_trains_with_train_demo_and_the_real_pipeline_has_no_demo_defaults():
    from flows.deployment_table import DEPLOYMENTS
    from flows.pipeline import PipelineParams, demo_pipeline
    from flows.train import TrainFlowParams

    specs = {spec.name: spec for spec in DEPLOYMENTS}
    demo = PipelineParams.model_validate(specs["embedded-demo"].parameters()["params"])
    assert demo == demo_pipeline()
    assert demo.train_deployment == "train-demo" and demo.training.config.data == []  # data: the tokenize result
    assert demo.evaluation.split == "heldout" and demo.generation.holdout.fraction > 0
    train_demo = TrainFlowParams.model_validate(specs["train-demo"].parameters()["params"])
    assert train_demo.config == demo.training.config
    assert specs["pipeline"].parameters is None and specs["train"].parameters is None
    real = PipelineParams()
    assert all(getattr(real, stage) is None for stage in ("generation", "tokenization", "training", "evaluation",
                                                          "export", "provision", "preserve", "audit"))
    assert "train-demo" in specs["train"].description and "20 CPU steps" in specs["train-demo"].description


def test_schedules_are_utc_and_say_so():
    from flows.deployment_table import DEPLOYMENTS

    scheduled = {spec.name: spec.schedule for spec in DEPLOYMENTS if spec.schedule}
    assert set(scheduled) == {"tokenize", "s3-audit"}
    assert all(schedule.slug.endswith("-utc") for schedule in scheduled.values())
    assert scheduled["tokenize"].active is False  # until a user points it at their completions
    assert scheduled["tokenize"].parameters()["params"]["completions"].endswith("/completions/demo/smollm2/")


def test_descriptions_say_how_to_rerun_and_hold_no_markup():
    """The UI renders descriptions as markdown: angle-bracketed text would vanish."""
    from flows.deployment_table import DEPLOYMENTS

    for spec in DEPLOYMENTS:
        assert not re.search(r"<[^>]*>", spec.description), spec.name
        if spec.module in ("generate", "tokenize", "train", "evaluate", "export", "pipeline"):
            assert "rerun" in spec.description, spec.name
        if spec.module in ("generate", "tokenize"):
            assert "refresh=true" in spec.description, spec.name


def test_the_real_run_example_fills_every_stage_of_the_pipeline_form():
    import json
    from pathlib import Path

    from flows.deployments import REPO_DIR
    from flows.pipeline import PipelineParams

    raw = json.loads((Path(REPO_DIR) / "infra/examples/qwen3.6-27b-4gpu.json").read_text())
    params = PipelineParams.model_validate(raw)
    assert all(getattr(params, stage) is not None for stage in ("provision", "generation", "tokenization", "training",
                                                                "evaluation", "export", "preserve", "audit"))
    assert params.training.config.data == [] and params.tokenization.completions is None  # the DAG fills them
    assert params.generation.engine.engine == "vllm" and params.training.nproc_per_node == 4


def test_the_four_node_example_generates_across_its_nodes_and_trains_on_the_first():
    import json
    from pathlib import Path

    from flows.deployments import REPO_DIR
    from flows.node_stages import queue_of
    from flows.pipeline import PipelineParams

    raw = json.loads((Path(REPO_DIR) / "infra/examples/qwen3.6-27b-4-nodes.json").read_text())
    params = PipelineParams.model_validate(raw)
    nodes = params.generation.nodes
    assert [spec.provision.node_name for spec in nodes] == ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
    assert {spec.num_instances for spec in nodes} == {4} and params.generation.engine.served_model_name
    assert params.training.config.target == "@node" and params.provision.node_name == "gpu-1"
    assert queue_of("generation", None, params.generation) is None
