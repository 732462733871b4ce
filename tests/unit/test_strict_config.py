"""A typo in what a user writes (run.yaml, `--set`, flow parameters, the pipeline file) is an error naming the
key and its nearest valid field, never a run on the defaults; the CLI ends every bad input in one `error:`
line with a non-zero exit, no traceback. Stage records stay lenient (an older result must still read).

Run: `.venv/bin/python -m pytest tests/unit/test_strict_config.py -q -n 0`
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest
from pydantic import BaseModel, ValidationError
from typer.testing import CliRunner

from dflash_core.data.holdout import HoldoutSpec
from dflash_core.nodes import PreserveConfig, ProvisionConfig
from dflash_core.s3audit import Retention
from dflash_core.serving.canary import CanaryThresholds
from dflash_core.serving.client import ClientConfig, SamplingParams
from dflash_core.serving.profiles import SglangProfile, TransformersProfile, VllmProfile
from dflash_core.settings import load_settings
from dflash_core.stage_results import TokenizedDataset, parse_result
from dflash_core.strict import StrictModel
from dflash_core.tokenize.config import TokenizeConfig
from dflash_core.tokenize.gate import GateThresholds
from dflash_core.tokenize.io import arrow_bytes
from dflash_core.train.config import DrafterSettings, OptimSettings, TrainConfig
from dflash_core.train.launch_argv import Rendezvous
from tests.train_fixtures import synthetic_shard

CONFIG_MODELS = [TrainConfig, DrafterSettings, OptimSettings, Rendezvous, TokenizeConfig, GateThresholds,
                 SamplingParams, ClientConfig, CanaryThresholds, VllmProfile, SglangProfile, TransformersProfile,
                 HoldoutSpec, Retention, ProvisionConfig, PreserveConfig]


def _flow_params() -> list[type[BaseModel]]:
    from flows.evaluate import EvaluateParams
    from flows.export import ExportParams
    from flows.generate_params import GenerateParams, PromptSourceParam
    from flows.nodes import PreserveParams, ProvisionParams
    from flows.pipeline import PipelineParams
    from flows.s3 import S3AuditParams, S3CleanupParams
    from flows.tokenize import TokenizeParams
    from flows.train import TrainFlowParams

    return [PipelineParams, TrainFlowParams, TokenizeParams, GenerateParams, PromptSourceParam, EvaluateParams,
            ExportParams, S3AuditParams, S3CleanupParams, ProvisionParams, PreserveParams]


def _unknown_key_errors(model: type[BaseModel], raw: dict) -> list[dict]:
    with pytest.raises(ValidationError) as error:
        model.model_validate(raw)
    return [e for e in error.value.errors(include_url=False) if e["type"] == "extra_forbidden"]


def test_a_run_config_typo_names_the_key_and_its_nearest_field(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("target: tiny:llama\ndata: [shard.arrow]\nmax_step: 5\n")
    with pytest.raises(ValueError) as error:
        TrainConfig.from_yaml(config)
    assert str(error.value) == f"{config}: max_step: unknown field of TrainConfig; did you mean 'max_steps'?"
    with pytest.raises(ValueError) as nested:
        TrainConfig.from_yaml(tmp_path / "run.yaml", overrides=["max_step=1000", "drafter.num_layer=2",
                                                                "optim.lr=-1", "optim.warmup_step=5"])
    message = str(nested.value)
    assert message.startswith(f"{config}: ") and "\n" not in message
    for problem in ("max_step: unknown field of TrainConfig; did you mean 'max_steps'?",
                    "drafter.num_layer: unknown field of DrafterSettings; did you mean 'num_layers'?",
                    "optim.lr: Input should be greater than 0",
                    "optim.warmup_step: unknown field of OptimSettings; did you mean 'warmup_steps'?"):
        assert problem in message, message


def test_a_key_close_to_no_field_lists_the_fields() -> None:
    [error] = _unknown_key_errors(Rendezvous, {"zzzz": 1})
    assert error["msg"] == ("unknown field of Rendezvous; its fields are nnodes, backend, endpoint, job_id, "
                            "node_rank")


@pytest.mark.parametrize("model", CONFIG_MODELS + _flow_params(), ids=lambda model: model.__name__)
def test_every_model_a_user_writes_refuses_a_typo(model) -> None:
    assert issubclass(model, StrictModel)
    field = max(model.model_fields, key=len)  # the longest name: its typo is closest to it alone
    typo = field[:-1]
    errors = _unknown_key_errors(model, {typo: None})
    assert [(e["loc"], e["msg"]) for e in errors] == [
        ((typo,), f"unknown field of {model.__name__}; did you mean {field!r}?")]


def test_the_pipeline_file_names_a_typo_deep_in_a_stage() -> None:
    from flows.demo import demo_stages
    from flows.pipeline import PipelineParams

    raw = PipelineParams(**demo_stages()).model_dump(mode="json")
    raw["training"]["config"]["drafter"]["num_layer"] = 2
    raw["tokenization"]["gate"] = {"max_short_fractio": 0.5}
    errors = _unknown_key_errors(PipelineParams, raw)
    assert {(".".join(map(str, e["loc"])), e["msg"]) for e in errors} == {
        ("training.config.drafter.num_layer", "unknown field of DrafterSettings; did you mean 'num_layers'?"),
        ("tokenization.gate.max_short_fractio", "unknown field of GateThresholds; did you mean 'max_short_fraction'?")}


def test_a_flow_run_with_a_typo_in_its_parameters_is_refused_before_it_runs() -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.train import train

    with pytest.raises(ParameterTypeError, match=r"max_step.*did you mean 'max_steps'"):
        train.validate_parameters({"params": {"config": {"target": "tiny:llama", "max_step": 5}}})


def test_stage_records_stay_lenient_and_a_filled_form_validates_again() -> None:
    """An older result.json with a field since removed still reads; the pipeline fills a stage's input with
    model_copy (no validation), and the stage's run validates the dump again."""
    from flows.demo import demo_stages
    from flows.pipeline import PipelineParams
    from flows.train import TrainFlowParams

    dataset = TokenizedDataset(dataset="d", run="r", train_shards=[{"uri": "s3://b/t/shard-00000.arrow", "sha256": "a"}],
                               dataset_manifest="s3://b/t/dataset.json", quality_gate="passed")
    older = {**json.loads(dataset.to_json_bytes()), "a_field_since_removed": 1}
    stored = parse_result(json.dumps(older).encode(), TokenizedDataset, name="result.json")
    assert stored == dataset
    training = PipelineParams(**demo_stages()).training.model_copy(update={"dataset": stored})
    again = TrainFlowParams.model_validate(json.loads(json.dumps(training.model_dump(mode="json"))))
    assert again.dataset == dataset


def _cli(*args: str):
    from dflash_core import cli

    return CliRunner().invoke(cli.app, list(args))


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output, output
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, output
    return errors[0]


@pytest.mark.parametrize(("config_text", "sets", "expected"), [
    ("target: tiny:llama\nmax_step: 5\n", [], "max_step: unknown field of TrainConfig; did you mean 'max_steps'?"),
    ("target: tiny:llama\n", ["=5"], "--set '=5': expected key=value"),
    ("target: tiny:llama\n", ["optim=3", "optim.lr=1"], "--set 'optim.lr=1': optim is 3, not a section"),
    ("target: tiny:llama\n", ["drafter.num_layer=2"], "drafter.num_layer: unknown field of DrafterSettings"),
    ("target: tiny:llama\n", ["seed=[1"], "--set 'seed=[1': the value is not YAML"),
    ("- target\n- tiny:llama\n", [], "a run config is a mapping of field: value"),
], ids=["typo", "empty-key", "section-then-field", "nested-typo", "bad-yaml-value", "yaml-list"])
def test_dflash_train_ends_a_bad_config_in_one_error_line(tmp_path, monkeypatch, config_text, sets,
                                                           expected) -> None:
    from dflash_core.train import supervise

    monkeypatch.setattr(supervise, "run_tied", lambda argv: pytest.fail(f"launched {argv}"))
    config = tmp_path / "run.yaml"
    config.write_text(config_text)
    result = _cli("train", "--config", str(config), *(arg for item in sets for arg in ("--set", item)))
    assert result.exit_code == 2
    assert expected in _one_error_line(result.output)


@pytest.mark.parametrize(("model_config", "expected"), [
    ([1, 2], "a JSON array, not a transformers config.json"),
    ({"hidden_size": 8, "text_config": ["hidden_size"]}, "its text_config is a JSON array"),
    ({"hidden_size": 8, "text_config": 5}, "its text_config is a JSON number"),
    ({"hidden_size": "wide"}, "hidden_size: Input should be a valid integer"),
], ids=["list", "list-text-config", "number-text-config", "bad-hidden-size"])
def test_dflash_plan_ends_a_bad_model_config_in_one_error_line(tmp_path, model_config, expected) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model_config))
    result = _cli("plan", "--model-config", str(path))
    assert result.exit_code == 2
    assert expected in _one_error_line(result.output)


def test_dflash_train_ends_unusable_data_in_one_error_line(tmp_path) -> None:
    """The real command and the training process it starts: a shard with no quality-gate verdict."""
    shard = synthetic_shard(tmp_path / "data" / "shard-00000.arrow", num_samples=8, min_len=12, max_len=24)
    table = pa.ipc.open_file(shard).read_all()
    shard.write_bytes(arrow_bytes(table.replace_schema_metadata(None)))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"target": "tiny:llama", "data": [str(shard)], "output_dir": str(tmp_path / "runs"),
                                  "upload_checkpoints": False}))
    completed = subprocess.run([sys.executable, "-m", "dflash_core.cli", "train", "--config", str(config)],
                               capture_output=True, text=True, cwd=tmp_path, timeout=300,
                               env={**_env(), "DFLASH_WORK_DIR": str(tmp_path / "work")})
    assert completed.returncode != 0
    line = _one_error_line(completed.stdout + completed.stderr)
    assert line.startswith("error: training data refused: 1 of 1 shard(s) did not pass the quality gate; "
                           f"{shard}: no quality-gate verdict"), line


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}


def test_the_entry_itself_refuses_a_typo_with_one_error_line(tmp_path) -> None:
    from dflash_core.train import entry

    config = tmp_path / "run.yaml"
    config.write_text("target: tiny:llama\ndata: [x.arrow]\nmax_step: 5\n")
    with pytest.raises(SystemExit) as stopped:
        entry.main(["--config", str(config)])
    assert stopped.value.code == (f"error: run config: {config}: max_step: unknown field of TrainConfig; did you "
                                  f"mean 'max_steps'?")


def test_the_strict_base_keeps_other_errors_as_pydantic_states_them() -> None:
    with pytest.raises(ValidationError) as error:
        TrainConfig.model_validate({"target": "t", "max_steps": 0, "drafter": {"num_layers": "x"}, "seeed": 1})
    assert {(".".join(map(str, e["loc"])), e["type"]) for e in error.value.errors()} == {
        ("max_steps", "greater_than_equal"), ("drafter.num_layers", "int_parsing"), ("seeed", "extra_forbidden")}
    assert TrainConfig(target="t").output_dir == load_settings().work_path("runs")


LATIN_1 = "café".encode("latin-1")  # what an editor set to Latin-1 or Windows-1252 saves


@pytest.mark.parametrize(("command", "flag", "name", "text"), [
    (["train"], "--config", "run.yaml", b"target: tiny:llama\nrun_name: " + LATIN_1 + b"\n"),
    (["plan"], "--model-config", "config.json", b'{"hidden_size": 8, "model_type": "' + LATIN_1 + b'"}'),
    (["run", "train"], "--params", "params.json", b'{"config": {"target": "' + LATIN_1 + b'"}}'),
], ids=["train-config", "plan-model-config", "run-params-file"])
def test_a_file_that_is_not_utf8_is_named_in_one_error_line(tmp_path, monkeypatch, command, flag, name, text) -> None:
    monkeypatch.setenv("DFLASH_WORK_DIR", str(tmp_path / "work"))  # `dflash run` reads the file before any service
    path = tmp_path / name
    path.write_bytes(text)
    result = _cli(*command, flag, str(path))
    assert result.exit_code == 2
    line = _one_error_line(result.output)
    assert line.startswith(f"error: {flag} {path}: not UTF-8 text (byte 0xe9 at offset "), line
