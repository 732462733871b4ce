"""`dflash run` checks a flow's parameters against the flow's own parameter model before it submits anything: a typo
(at any depth, inline or in a params file), JSON that is not an object, or an unknown flow ends in one `error:` line
naming the key's dotted path and the nearest valid field, with a non-zero exit, and no flow run is created. The
real command on the real stage server and Prefect server.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_launch_params.py`
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

TARGET = {"target": "tiny:llama"}


@pytest.mark.parametrize(("flow", "params", "expected"), [
    ("train", {"datset": "s3://b/r/result.json", "config": TARGET},
     "datset: unknown field of TrainFlowParams; did you mean 'dataset'?"),
    ("train", {"config": {**TARGET, "max_step": 5}},
     "config.max_step: unknown field of TrainConfig; did you mean 'max_steps'?"),
    ("served", {"export": "s3://b/e/result.json", "concurency": [1]},
     "concurency: unknown field of ServedParams; did you mean 'concurrency'?"),
    ("pipeline", "file:{\"sampels\": 10}", "sampels: unknown field of PipelineParams; did you mean 'samples'?"),
    ("train", "{bad json", "--params is not JSON"),
    ("train", "[1,2]", "--params must be a JSON object (TrainFlowParams's fields), not a list"),
    ("nosuchflow", {}, "no deployment named 'nosuchflow'"),
], ids=["top-level-typo", "nested-typo", "served-typo", "params-file-typo", "bad-json", "json-array", "unknown-flow"])
def test_bad_parameters_end_in_one_error_line_before_any_run(stage_server, env_settings, tmp_path, capfd, flow,
                                                             params, expected):
    from dflash_core import cli

    if isinstance(params, str) and params.startswith("file:"):
        path = tmp_path / "params.json"
        path.write_text(params.removeprefix("file:"))
        params = str(path)
    elif not isinstance(params, str):
        params = json.dumps(params)
    result = CliRunner().invoke(cli.app, ["run", flow, "--params", params])
    captured = capfd.readouterr()
    output = result.output + captured.out + captured.err
    assert result.exit_code != 0, output
    assert "Traceback" not in output, output
    assert "flow run" not in output, output  # nothing was submitted
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], output
