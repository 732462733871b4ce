"""infra/prefect.yaml is the one list of deployments: every entry loads, every pipeline stage has
one, and the train-demo deployment's defaults are the demo's training run.

Run: `.venv/bin/python -m pytest -q tests/unit/test_deployments.py`
"""

from __future__ import annotations


def test_every_stage_has_a_deployment_and_every_entrypoint_loads():
    from flows.deployments import STAGE_FLOWS, STAGES, deployment_specs, flow_name

    specs = deployment_specs()
    registered = {f"{flow_name(spec['entrypoint'])}/{spec['name']}" for spec in specs}
    assert set(STAGES.values()) <= registered
    assert set(STAGE_FLOWS) == set(STAGES)
    assert len({spec["name"] for spec in specs}) == len(specs)


def test_train_demo_defaults_are_the_demo_run():
    from flows.deployments import deployment_specs
    from flows.pipeline import demo_training
    from flows.train import TrainFlowParams

    [spec] = [s for s in deployment_specs() if s["name"] == "train-demo"]
    assert TrainFlowParams.model_validate(spec["parameters"]["params"]).config == demo_training().config


def test_runner_deployments_carry_the_git_sha_and_utc_schedules():
    from dflash_core.provenance import git_sha
    from flows.serve import runner_deployments

    deployments = {d.name: d for d in runner_deployments()}
    assert {d.version for d in deployments.values()} == {git_sha()}
    [schedule] = deployments["tokenize-nightly"].schedules
    assert schedule.schedule.timezone == "UTC" and "UTC" in deployments["tokenize-nightly"].description
