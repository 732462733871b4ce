"""The node the pipeline provisions is the node its stages use: the provision flow starts the node's own stage
worker (`python -m flows.serve --work-queue node-<name> --no-register`, dflash_core/nodes/worker.py), a second
provision leaves it alone, and a stage sent to the node's queue (`run_stage(..., work_queue=)`, what the
pipeline does through flows/node_stages.py) runs in that worker, not in the stage server that polls the pool's
default queue. On a local node and over SSH (tests/sshd_fixture.py; skipped where sshd is missing), against the
session's real Prefect server, stage server and S3.

Run: `.venv/bin/python -m pytest -q -n 0 tests/integration/test_node_worker.py`
"""

from __future__ import annotations

import stat
import sys
import uuid
from pathlib import Path

import pytest
from prefect import flow

from dflash_core.nodes import Node, ProvisionConfig, local_node
from dflash_core.stage_results import MODEL_FROM_NODE, ProvisionedNode, TokenizedDataset
from dflash_core.nodes.worker import WORKER_DIR, WORKER_NAME, ensure_node_worker, stop_node_worker
from flows.deployments import run_stage
from flows.node_stages import stage_runner
from flows.tokenize import TokenizeParams
from tests.integration.shared_runs import children
from tests.integration.test_tokenize_flow import put_shards, shard
from tests.sshd_fixture import Sshd, start_sshd
from tests.unit.conftest_tokenize import MODEL_CACHE

STAGE_TIMEOUT_S = 180  # a stage's flow run: picked up within a second, then a process that imports the stage


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    yield from start_sshd(tmp_path_factory.mktemp("sshd"))


@pytest.fixture
def node_workers():
    """Stops, at the end of the test, the worker of every node appended (even when the test failed)."""
    nodes: list[Node] = []
    yield nodes
    for node in nodes:
        with node.connect() as access:
            stop_node_worker(access, work_dir=access.path(node.work_dir))


@flow(name="dflash-node-queue-probe")
def _parent(node_result: ProvisionedNode, stage: TokenizeParams) -> TokenizedDataset:
    """A pipeline's stage call on the provisioned node (flows/pipeline.py `_run_stages`)."""
    return stage_runner(run_stage, node_result)("tokenization", "tokenize", stage, timeout_s=STAGE_TIMEOUT_S)


def _provision_params(node: Node, **config):
    from flows.nodes import ProvisionParams

    # the node's venv stays bare (no packages); the worker runs on this checkout's interpreter
    return ProvisionParams(node=node, provision=ProvisionConfig(**config), worker_python=sys.executable)


def _recorded_worker(access, work_dir: str):
    [record] = [r for r in access.recorded_processes(f"{work_dir}/{WORKER_DIR}") if r.name == WORKER_NAME]
    return record


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _registered_workers(queue: str) -> list[str]:
    from prefect.client.orchestration import get_client

    from flows.deployment_table import WORK_POOL

    with get_client(sync_client=True) as client:
        return [w.name for w in client.read_workers_for_work_pool(WORK_POOL) if w.name.endswith(f"-{queue}")]


def _assert_worker_runs_on_its_queue(access, provisioned, pid: int) -> None:
    queue = f"node-{provisioned.node['name']}"
    assert provisioned.work_queue == queue
    assert access.is_running(_recorded_worker(access, provisioned.work_dir))
    assert _argv(pid)[-4:] == ["flows.serve", "--work-queue", queue, "--no-register"]
    assert _argv(pid)[0] == sys.executable
    # the server heard from it (provision waits for that): stages-<host>-<pid>-<queue>, flows/serve.py
    assert [name for name in _registered_workers(queue) if name.endswith(f"-{pid}-{queue}")], _registered_workers(queue)
    worker_dir = Path(provisioned.work_dir) / WORKER_DIR  # the loopback SSH node's files are on this host too
    env_file = worker_dir / "worker.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600 and stat.S_IMODE(worker_dir.stat().st_mode) == 0o700
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    assert environ["PREFECT_HOME"] == f"{provisioned.work_dir}/{WORKER_DIR}/prefect"
    assert environ["DFLASH_WORK_DIR"] == provisioned.work_dir
    assert "DFLASH_STAGES_READY_FILE" not in environ and not [k for k in environ if k.startswith("PREFECT__")]
    secret = environ["DFLASH_S3_SECRET_ACCESS_KEY"]
    assert secret not in " ".join(_argv(pid)), "the settings reach the worker by file, never on its command line"


def test_provision_starts_the_local_node_worker_and_the_node_queue_runs_there(
        stage_server, store, env_settings, node_workers, monkeypatch, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client

    from dflash_core.embedded import embedded_tokenizer_dir
    from dflash_core.services.stages import result_store_env
    from flows.nodes import provision

    name = f"wk-{uuid.uuid4().hex[:8]}"
    node = local_node(tmp_path / "node", name=name)
    node_workers.append(node)
    # provision places the model: the tokenizer dir stands in for it (no RAM disk here, so it stays in its home)
    model_dir = str(embedded_tokenizer_dir(MODEL_CACHE))
    params = _provision_params(node, model_dir=model_dir, ram_disk=str(tmp_path / "no-ram-disk"), read_sample_mb=1)
    # as in a flow run of the stage server (the pipeline's provision stage): the worker must inherit neither
    ready_file = tmp_path / "stage-server-ready.json"
    monkeypatch.setenv("DFLASH_STAGES_READY_FILE", str(ready_file))
    monkeypatch.setenv("PREFECT__DEPLOYMENT_NAME", "provision")
    first = provision(params)
    monkeypatch.delenv("DFLASH_STAGES_READY_FILE")
    monkeypatch.delenv("PREFECT__DEPLOYMENT_NAME")
    assert isinstance(first, ProvisionedNode) and first.model == model_dir and first.flow_run
    with node.connect() as access:
        pid = _recorded_worker(access, first.work_dir).pid
        _assert_worker_runs_on_its_queue(access, first, pid)
        again = provision(params)
        assert again.work_queue == first.work_queue and again.actions == []
        assert _recorded_worker(access, first.work_dir).pid == pid, "a second provision leaves the worker alone"
        assert ensure_node_worker(access, node_name=name, work_dir=first.work_dir, python=sys.executable,
                                  repo_dir="/nowhere", env={}).started is False
    assert not ready_file.exists(), "the node's worker wrote the stage server's ready file"

    # A stage sent to the node's queue the way the pipeline sends it (run_stage from a deployment run of the
    # parent: mocked here through Prefect's runtime variable), with its model field filled from provision.
    for key, value in result_store_env(env_settings).items():  # the stage's result comes back from the bucket
        monkeypatch.setenv(key, value)
    dataset = f"wk-{uuid.uuid4().hex[:8]}"
    put_shards(store, env_settings, dataset, [shard(0)])
    tokenization = TokenizeParams(completions=f"s3://{store.bucket}/completions/{dataset}/run-a/",
                                  tokenizer_dir=MODEL_FROM_NODE, workers=1)

    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", str(uuid.uuid4()))
    state = _parent(again, tokenization, return_state=True)
    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__ID")
    assert state.is_completed(), state
    result = state.result()
    with get_client(sync_client=True) as client:
        [stage_run] = children(client, state.state_details.flow_run_id)
        deployment = client.read_deployment(stage_run.deployment_id)
    assert deployment.name == "tokenize" and stage_run.state.is_completed()
    assert stage_run.work_queue_name == f"node-{name}"
    assert result.flow_run == str(stage_run.id) and len(result.train_shards) == 1
    assert f"{Path(model_dir).resolve().as_uri()}/tokenizer.json" in _input_uris(store, result), \
        "tokenize read the tokenizer provision placed"
    # it ran in the node's worker: that worker submitted it (its log), the stage server did not
    log = Path(first.work_dir, WORKER_DIR, "worker.log").read_text(errors="replace")
    assert str(stage_run.id) in log, log[-3000:]
    assert str(stage_run.id) not in stage_server.log_path.read_text(errors="replace")


def _input_uris(store, result) -> list[str]:
    """The inputs of the dataset's manifest: its shards and the tokenizer files that made them."""
    from dflash_core.lineage import read_manifest

    return [ref.uri for ref in read_manifest(store, result.dataset_manifest.removeprefix(store.uri(""))).inputs]


def test_provision_over_ssh_starts_the_node_worker_once(stage_server, store, env_settings, sshd: Sshd,
                                                        node_workers) -> None:
    from flows.nodes import provision

    name = f"wk-ssh-{uuid.uuid4().hex[:6]}"
    node = sshd.node(name=name, work_dir=f"{sshd.home}/{name}")
    node_workers.append(node)
    first = provision(_provision_params(node))
    assert first.node["backend"] == "ssh" and first.venv == f"{sshd.home}/{name}/venv"
    with node.connect() as access:
        pid = _recorded_worker(access, first.work_dir).pid
        _assert_worker_runs_on_its_queue(access, first, pid)  # the loopback node's processes are this host's
        again = provision(_provision_params(node))
        assert _recorded_worker(access, first.work_dir).pid == pid and access.is_running(
            _recorded_worker(access, first.work_dir))
        assert stop_node_worker(access, work_dir=first.work_dir) == [f"{WORKER_NAME} {pid}: stopped"]
        assert again.work_queue == first.work_queue


def test_a_worker_that_cannot_start_fails_the_provision_with_its_log(stage_server, store, env_settings,
                                                                     node_workers, tmp_path: Path) -> None:
    """The default worker interpreter is the node's venv, here bare (no Prefect): provision says so, instead of
    reporting a worker that exits at once and leaving the node's stages Scheduled for ever."""
    from flows.nodes import ProvisionParams, provision

    node = local_node(tmp_path / "node", name=f"wk-bare-{uuid.uuid4().hex[:6]}")
    node_workers.append(node)
    state = provision(ProvisionParams(node=node, upload=False), return_state=True)
    assert state.is_failed()
    message = str(state.message) + repr(state.result(raise_on_failure=False))
    assert "the stage worker" in message and "exited" in message and "No module named" in message, message
    with node.connect() as access:
        assert not access.is_running(_recorded_worker(access, access.path(node.work_dir)))


def test_the_pipeline_runs_its_stages_on_the_node_it_provisioned(stage_server, store, env_settings, node_workers,
                                                                 monkeypatch, tmp_path: Path) -> None:
    """One pipeline deployment run (as `dflash run pipeline` starts it): provision (on the stage server) places
    the embedded SmolLM2 and starts the node's worker; generate, tokenize and train, each `@node`, run in that
    worker with the model provision placed."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from dflash_core.embedded import embedded_model_dir
    from dflash_core.services.stages import result_store_env, stage_server_ready
    from flows.deployments import deployment_for
    from flows.generate import GenerateParams
    from flows.pipeline import PipelineParams
    from flows.train import TrainFlowParams
    from tests.conftest import free_port
    from tests.integration.shared_runs import _prompt_file, train_config, wait_final

    for key, value in result_store_env(env_settings).items():
        monkeypatch.setenv(key, value)
    model_dir = str(embedded_model_dir(MODEL_CACHE))
    name = f"wk-pipe-{uuid.uuid4().hex[:6]}"
    node = local_node(tmp_path / "node", name=name)
    node_workers.append(node)
    lenient = {"max_short_fraction": 1.0, "max_degenerate_fraction": 1.0, "max_truncated_fraction": 1.0,
               "max_boilerplate_fraction": 1.0}
    params = PipelineParams(
        provision=_provision_params(node, model_dir=model_dir, ram_disk=str(tmp_path / "no-ram-disk"),
                                    read_sample_mb=1),
        generation=GenerateParams(
            dataset=name, run="r1", prompt_sources=[{"path": _prompt_file(tmp_path), "name": "numbers"}],
            total_prompts=4, shard_size=4, holdout={"count": 1}, base_port=free_port(), canary_prompts=0,
            engine={"engine": "transformers", "model": MODEL_FROM_NODE},
            sampling={"max_tokens": 8, "temperature": 0.0, "enable_thinking": False},
            client={"concurrency": 3, "backoff_s": 0.1}),
        tokenization={"tokenizer_dir": MODEL_FROM_NODE, "workers": 1, "gate": lenient},
        training=TrainFlowParams(config={**train_config(name, Path(model_dir), tmp_path), "target": MODEL_FROM_NODE}))
    run = run_deployment(deployment_for("pipeline"), parameters={"params": params.model_dump(mode="json")},
                         timeout=0, as_subflow=False)
    with get_client(sync_client=True) as client:
        run = wait_final(client, run.id, timeout_s=420)
        stages = {client.read_deployment(r.deployment_id).name: r for r in children(client, run.id)}
    assert run.state.is_completed(), run.state
    assert set(stages) == {"provision", "generate", "tokenize", "train"}
    assert stages["provision"].work_queue_name == "default"  # provision runs where the pipeline runs
    queue = f"node-{name}"
    assert {d: r.work_queue_name for d, r in stages.items() if d != "provision"} == \
        {"generate": queue, "tokenize": queue, "train": queue}
    log = Path(tmp_path, "node", WORKER_DIR, "worker.log").read_text(errors="replace")
    for deployment in ("generate", "tokenize", "train"):
        assert str(stages[deployment].id) in log, f"{deployment} did not run in the node's worker"
    result = run.state.result()
    assert result.provision.model == model_dir and result.training.target == model_dir
    # the node's worker, started from the stage server's flow run, left the stage server's ready file alone
    assert stage_server_ready(env_settings, stage_server)
