"""A whole real run from one form, on a CPU: the `pipeline` flow over the suite's SSH test node (a real
OpenSSH server on loopback) with a real `transformers serve` and a tiny real model: provision ->
generate -> tokenize -> train -> evaluate (held-out split) -> export -> preserve -> S3 audit, each
stage's input the previous stage's result.

The target is a tiny random 4-layer Llama with the SmolLM2 tokenizer (tests/tiny_models.py): the same
code path as SmolLM2 or Qwen3.6-27B, minutes faster. Skips where sshd is missing (tests/sshd_fixture.py).

Run: `.venv/bin/python -m pytest -q tests/integration/test_real_run.py`
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.conftest import free_port
from tests.sshd_fixture import Sshd, start_sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    yield from start_sshd(tmp_path_factory.mktemp("sshd"))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tests.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("real-run-target"), num_layers=4)


def _prompt_file(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"Say something about the number {i}."}]}
            for i in range(12)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_one_form_runs_the_whole_dag_over_an_ssh_node(sshd: Sshd, prefect_server, store, env_settings, tiny_target,
                                                      tmp_path):
    from dflash_core.nodes import ProvisionConfig
    from flows.evaluate import EvaluateParams
    from flows.export import ExportParams
    from flows.generate import GenerateParams
    from flows.nodes import PreserveParams, ProvisionParams
    from flows.pipeline import PipelineParams, pipeline
    from flows.s3 import S3AuditParams
    from flows.tokenize import TokenizeParams
    from flows.train import TrainFlowParams

    name = f"real-{uuid.uuid4().hex[:6]}"
    node = sshd.node(name=name, work_dir=f"{sshd.home}/{name}")
    lenient = {"max_short_fraction": 1.0, "max_degenerate_fraction": 1.0, "max_truncated_fraction": 1.0,
               "max_boilerplate_fraction": 1.0}
    params = PipelineParams(
        provision=ProvisionParams(node=node, provision=ProvisionConfig()),
        generation=GenerateParams(
            dataset=name, run="r1", prompt_sources=[{"path": _prompt_file(tmp_path), "name": "numbers"}],
            shard_size=6, holdout={"count": 2}, base_port=free_port(), node=node,
            engine={"engine": "transformers", "model": str(tiny_target)},
            sampling={"max_tokens": 12, "temperature": 0.0, "enable_thinking": False},
            client={"concurrency": 4, "backoff_s": 0.1}, canary_prompts=0),
        tokenization=TokenizeParams(tokenizer_dir=str(tiny_target), workers=1, gate=lenient),
        training=TrainFlowParams(node=node, config={
            "run_name": name, "target": str(tiny_target), "output_dir": str(tmp_path / "runs"), "token_budget": 96,
            "max_steps": 2, "checkpoint_every": 2, "log_every": 1, "validate_capture_batches": 1,
            # selector_rank 8: the default 256 gives 2 x 49,152 x 256 codebook weights, a 290 MB checkpoint
            "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0,
                        "selector_rank": 8}}),
        evaluation=EvaluateParams(num_prompts=2, max_new_tokens=4, modes=["block"]),
        export=ExportParams(formats=["native"]),
        preserve=PreserveParams(node=node),
        audit=S3AuditParams(prefix=f"completions/{name}/", verify_hashes=False))
    state = pipeline(params, return_state=True)
    assert state.is_completed(), state
    result = state.result()

    assert result.provision["node"] == name and result.provision["actions"]
    generation, tokenized, checkpoint = result.generation, result.tokenization, result.training
    assert generation.outcomes["completed"] == 12 and len(generation.heldout_prompt_ids) == 2
    assert tokenized.completions == generation.result_uri  # each stage took the result before it
    assert checkpoint.dataset.result_uri == tokenized.result_uri
    assert [s.sha256 for s in checkpoint.data] == [s.sha256 for s in tokenized.train_shards]
    assert result.evaluation.checkpoint == checkpoint.uri and result.evaluation.split == "heldout"
    assert result.evaluation.prompts == [s.uri for s in tokenized.heldout_shards]
    assert result.export.checkpoint == checkpoint.uri
    assert result.preserve["prefix"].startswith(store.uri(f"node-backups/{name}/"))
    assert result.audit["objects"] > 0
    stored = {record["uri"] for record in result.artifacts}
    assert generation.result_uri in stored and result.evaluation.report in stored and result.report in stored

    # The stage table `dflash run pipeline` prints (shown with -s), read back from the Prefect server.
    from rich.console import Console

    from dflash_core import run_summary

    stages = run_summary.read_stage_runs(env_settings.prefect_api_url, str(state.state_details.flow_run_id))
    assert [s.stage for s in stages] == ["pipeline", "provision", "generate", "tokenize", "train", "evaluate", "export",
                                         "preserve", "s3-audit"]
    assert all(s.state == "Completed" for s in stages)
    Console(width=200).print(run_summary.stage_table(result.model_dump(mode="json"), stages, title="real run (CPU)"))
