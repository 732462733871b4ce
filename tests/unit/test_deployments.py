"""flows/deployment_table.py is the one list of deployments: every entry loads, every pipeline stage
(export included) has one, names are unique, train offers the full job and the demo run, schedules say
UTC.

Run: `.venv/bin/python -m pytest -q tests/unit/test_deployments.py`
"""

from __future__ import annotations


def test_every_stage_has_a_deployment_and_every_entrypoint_loads():
    from flows.deployment_table import DEPLOYMENTS, STAGE_MODULES, spec_for
    from flows.deployments import deployment_for, flow_name

    names = [spec.name for spec in DEPLOYMENTS]
    assert len(set(names)) == len(names)
    assert {flow_name(spec.entrypoint) for spec in DEPLOYMENTS} >= {"dflash-export", "dflash-tokenize"}
    assert {stage: spec_for(stage).name for stage in STAGE_MODULES} == {
        "generate": "generate", "tokenize": "tokenize-nightly", "train": "train", "evaluate": "evaluate",
        "export": "export"}
    assert deployment_for("export") == "dflash-export/export"


def test_train_offers_the_full_job_and_the_demo_run():
    from flows.deployment_table import DEPLOYMENTS
    from flows.pipeline import demo_training
    from flows.train import TrainFlowParams

    specs = {spec.name: spec for spec in DEPLOYMENTS}
    demo = TrainFlowParams.model_validate(specs["train-demo"].parameters()["params"])
    assert demo.config == demo_training().config
    full = TrainFlowParams.model_validate(specs["train"].parameters()["params"])
    assert full.config.max_steps == 1000 and full.config.data == demo.config.data
    assert "train-demo" in specs["train"].description and "1,000" in specs["train-demo"].description


def test_schedules_are_utc_and_say_so():
    from flows.deployment_table import DEPLOYMENTS

    scheduled = [spec for spec in DEPLOYMENTS if spec.cron_utc]
    assert {spec.name for spec in scheduled} == {"tokenize-nightly", "s3-audit-weekly"}
    assert all("UTC" in spec.description for spec in scheduled)
