"""The runs that tests/integration/conftest.py makes once per session for several modules to check:
`run_whole_dag` (test_real_run, test_dag) and `retry_a_failed_pipeline` (test_stage_deployments,
test_ui_browser). Each returns what its readers assert on; the runs themselves assert nothing beyond
what they need to go on. Both start early, beside other tests (tests/early.py): the whole DAG in a process
of its own (`run_whole_dag_in_a_process`), the retried pipeline, whose work the stage server does, from a
thread (`retry_a_failed_pipeline_here`).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import free_port
from tests.integration.test_tokenize_flow import put_shards, shard
from tests.unit.conftest_tokenize import MODEL_CACHE

# selector_rank 8: the default 256 gives 2 x 49,152 x 256 codebook weights, a 290 MB checkpoint
TINY_DRAFTER = {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_gamma": 4.0, "selector_rank": 8}
TRAIN_STEPS = 2


def export_settings(patch, settings, *, result_store: bool = False) -> None:
    """The session settings as DFLASH_* variables (flows resolve Settings from the environment); with
    result_store also what reads and writes Prefect results in the bucket."""
    from dflash_core.services.stages import result_store_env, settings_env

    for name, value in {**settings_env(settings), **(result_store_env(settings) if result_store else {})}.items():
        patch.setenv(name, value)


def train_config(run_name: str, target: Path, out: Path) -> dict[str, Any]:
    return {"run_name": run_name, "target": str(target), "output_dir": str(out / "runs"), "token_budget": 96,
            "max_steps": TRAIN_STEPS, "checkpoint_every": TRAIN_STEPS, "log_every": 1, "validate_capture_batches": 1,
            "drafter": TINY_DRAFTER}


@dataclass
class WholeRun:
    name: str
    node: Any  # the SSH node it ran over, or None
    state: Any  # the pipeline's final state
    result: Any  # its PipelineResult


def _prompt_file(out: Path) -> str:
    path = out / "prompts.jsonl"
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"Say something about the number {i}."}]}
            for i in range(12)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def run_whole_dag_in_a_process(settings, target: Path, out: Path, sshd_home: Path, base_env: dict[str, str]) -> WholeRun:
    """`run_whole_dag` in a child process, over the SSH test node where sshd is installed (else on this host,
    without the provision and preserve stages); its flows run in that process as a notebook's would. What it
    returns comes back pickled."""
    from dflash_core.services.local import prefect_client_env
    from dflash_core.services.stages import settings_env
    from tests.sshd_fixture import SSHD, start_sshd

    name = f"real-{uuid.uuid4().hex[:6]}"
    sshd = start_sshd(sshd_home) if SSHD.exists() else None
    try:
        node = None
        if sshd is not None:
            handle = next(sshd)
            node = handle.node(name=name, work_dir=f"{handle.home}/{name}")
        request, answer, log = out / "whole-run-request.pkl", out / "whole-run.pkl", out / "whole-run.log"
        request.write_bytes(pickle.dumps((str(target), str(out), name, node)))
        env = {**base_env, **settings_env(settings), **prefect_client_env(settings)}
        with open(log, "wb") as output:
            code = subprocess.run([sys.executable, "-m", "tests.integration.shared_runs", str(request), str(answer)],
                                  env=env, stdout=output, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
                                  timeout=600).returncode
        if code != 0:
            raise RuntimeError(f"the whole DAG's process exited {code}; its output ({log}):\n"
                               f"{log.read_text(errors='replace')[-6000:]}")
        return pickle.loads(answer.read_bytes())
    finally:
        if sshd is not None:
            sshd.close()


def run_whole_dag(store, settings, target: Path, out: Path, *, name: str, node) -> WholeRun:
    """One form: provision -> generate (a real `transformers serve`) -> tokenize -> train -> evaluate (held-out
    split) -> export -> preserve -> S3 audit; provision and preserve only with an SSH node."""
    from dflash_core.nodes import ProvisionConfig
    from flows.evaluate import EvaluateParams
    from flows.export import ExportParams
    from flows.generate import GenerateParams
    from flows.nodes import PreserveParams, ProvisionParams
    from flows.pipeline import PipelineParams, pipeline
    from flows.s3 import S3AuditParams
    from flows.tokenize import TokenizeParams
    from flows.train import TrainFlowParams

    lenient = {"max_short_fraction": 1.0, "max_degenerate_fraction": 1.0, "max_truncated_fraction": 1.0,
               "max_boilerplate_fraction": 1.0}
    params = PipelineParams(
        # No worker of the node's own: these stages run in the test's process (test_node_worker.py tests that part).
        provision=ProvisionParams(node=node, provision=ProvisionConfig(), start_worker=False) if node else None,
        generation=GenerateParams(
            dataset=name, run="r1", prompt_sources=[{"path": _prompt_file(out), "name": "numbers"}],
            shard_size=6, holdout={"count": 2}, base_port=free_port(), node=node,
            engine={"engine": "transformers", "model": str(target)},
            sampling={"max_tokens": 12, "temperature": 0.0, "enable_thinking": False},
            client={"concurrency": 4, "backoff_s": 0.1}, canary_prompts=0),
        tokenization=TokenizeParams(tokenizer_dir=str(target), workers=1, gate=lenient),
        training=TrainFlowParams(node=node, config=train_config(name, target, out)),
        evaluation=EvaluateParams(num_prompts=2, max_new_tokens=4, modes=["block"]),
        export=ExportParams(formats=["native"]),
        preserve=PreserveParams(node=node) if node else None,
        audit=S3AuditParams(prefix=f"completions/{name}/", verify_hashes=False))
    state = pipeline(params, return_state=True)
    return WholeRun(name=name, node=node, state=state, result=state.result() if state.is_completed() else None)


@dataclass
class RetriedPipeline:
    dataset: str
    tokenization: Any  # the form's TokenizeParams
    first: Any  # the pipeline run's first attempt, finished
    first_stage: Any  # its tokenize stage, finished
    retried_stage: Any  # that stage after its own Retry
    after_stage_retry: Any  # the pipeline run once its stage was retried
    completed: Any  # the pipeline run after its own Retry
    children: list  # its stage runs, by start time
    result: Any  # its PipelineResult


def wait_final(client, flow_run_id, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(0.25)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout_s} s")


def children(client, parent_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))


def retry_a_failed_pipeline_here(store, settings, target: Path, out: Path) -> RetriedPipeline:
    """`retry_a_failed_pipeline` from a thread of its own: Prefect's settings context is per thread. Its `result`
    is left to `with_result`, which needs the result store's settings exported."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: settings.prefect_api_url}):
        return retry_a_failed_pipeline(store, settings, target, out)


def with_result(run: RetriedPipeline) -> RetriedPipeline:
    """`run` with its PipelineResult, read from the result store."""
    run.result = run.completed.state.result() if run.completed.state.is_completed() else None
    return run


def retry_a_failed_pipeline(store, settings, target: Path, out: Path) -> RetriedPipeline:
    """The pipeline as `dflash demo` starts it (a run of its deployment, on the stage server) before its
    completions exist; then the fix, a Retry of the failed stage alone, and a Retry of the pipeline."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from dflash_core.embedded import embedded_tokenizer_dir
    from dflash_core.tokenize import GateThresholds
    from flows.deployments import deployment_for, retry_flow_run
    from flows.pipeline import PipelineParams
    from flows.tokenize import TokenizeParams
    from flows.train import TrainFlowParams

    dataset = f"stages-{uuid.uuid4().hex[:8]}"
    tokenization = TokenizeParams(completions=f"s3://{store.bucket}/completions/{dataset}/run-a/",
                                  tokenizer_dir=str(embedded_tokenizer_dir(MODEL_CACHE)),
                                  workers=1, gate=GateThresholds(max_skipped_fraction=0.1))
    params = PipelineParams(tokenization=tokenization,
                            training=TrainFlowParams(config=train_config(dataset, target, out)))
    with get_client(sync_client=True) as client:
        run = run_deployment(deployment_for("pipeline"), parameters={"params": params.model_dump(mode="json")},
                             timeout=0, as_subflow=False)
        first = wait_final(client, run.id)
        [first_stage] = children(client, first.id)  # no completions yet: the first stage fails
        put_shards(store, settings, dataset, [shard(0), shard(1)])  # the fix
        retry_flow_run(client, first_stage.id)  # the stage alone
        retried_stage = wait_final(client, first_stage.id)
        after_stage_retry = client.read_flow_run(first.id)
        retry_flow_run(client, first.id)
        completed = wait_final(client, first.id, timeout_s=400)
        stages = sorted(children(client, first.id), key=lambda stage: stage.start_time)
    return RetriedPipeline(dataset=dataset, tokenization=tokenization, first=first, first_stage=first_stage,
                           retried_stage=retried_stage, after_stage_retry=after_stage_retry, completed=completed,
                           children=stages, result=None)


if __name__ == "__main__":  # run_whole_dag_in_a_process's child: settings and the Prefect server from the environment
    from dflash_core.settings import load_settings
    from dflash_core.storage import ObjectStore
    from tests.integration import shared_runs  # this module by its name: what it returns unpickles in the parent

    request_file, answer_file = sys.argv[1:3]
    target_dir, out_dir, run_name, run_node = pickle.loads(Path(request_file).read_bytes())
    session_settings = load_settings()
    whole = shared_runs.run_whole_dag(ObjectStore.from_settings(session_settings), session_settings, Path(target_dir),
                          Path(out_dir), name=run_name, node=run_node)
    Path(answer_file).write_bytes(pickle.dumps(whole))
