"""Generation across two nodes from one pipeline run (generate's `nodes`, flows/generate_nodes.py): a local node and
an SSH node (tests/sshd_fixture.py, on loopback), each with its own work dir, its own worker (started by the
provision the generate run does) and its own `transformers serve` on the embedded SmolLM2. The prompt shards are
split between them; the SSH node is killed mid-generation (sshd, its worker, its generate run and its server),
its unanswered shards go to the local node, and the merged dataset answers every prompt exactly once, which the
tokenize stage after it confirms. A rerun after a shard is lost from the bucket finds the dead node unreachable
and has the live one answer that shard alone. A second run kills only the SSH node's worker (its run lives on, its
servers frozen): the generate run stops that run on the node, fences the shards it had not stored, and counts those
it had as its own. Against the session's real Prefect server, stage server and S3.

Run: `.venv/bin/python -m pytest -q -n 0 tests/integration/test_generate_across_nodes.py`
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from uuid import UUID

import pytest

from dflash_core.nodes import local_node
from dflash_core.nodes.worker import stop_node_worker
from tests.sshd_fixture import start_sshd
from tests.unit.conftest_tokenize import MODEL_CACHE

pytestmark = pytest.mark.slow

PROMPTS = 16
SHARD_SIZE = 2  # 7 training shards and 1 held-out shard: enough for each node to have several
NODE_TIMEOUT_S = 20.0


def _prompt_file(out: Path) -> str:
    path = out / "prompts.jsonl"
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"Count from {i} to {i + 9}."}]}
            for i in range(PROMPTS)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def _kill_node(work_dir: Path) -> list[int]:
    """SIGKILL every process of the node whose files live under `work_dir` (its worker and the flow runs it
    started carry DFLASH_WORK_DIR; its servers run in a dir of it): what a node that dies leaves behind."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if f"DFLASH_WORK_DIR={work_dir}".encode() in environ or cwd.startswith(str(work_dir)):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


def _ids(store, uri: str) -> list[str]:
    key = uri.split("/", 3)[3]
    return [json.loads(line)["id"] for line in store.get_bytes(key).splitlines() if line.strip()]


def test_a_generation_across_two_nodes_survives_one_dying(stage_server, store, env_settings, monkeypatch,
                                                          tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from dflash_core.embedded import embedded_model_dir
    from dflash_core.services.stages import result_store_env
    from flows.deployments import deployment_for
    from flows.generate import GenerateParams
    from flows.nodes import ProvisionParams
    from flows.pipeline import PipelineParams
    from tests.conftest import free_port
    from tests.integration.shared_runs import children, wait_final

    for key, value in result_store_env(env_settings).items():
        monkeypatch.setenv(key, value)
    (tmp_path / "sshd-home").mkdir()
    sshd_run = start_sshd(tmp_path / "sshd-home")
    sshd = next(sshd_run)
    tag = uuid.uuid4().hex[:6]
    local = local_node(tmp_path / "node-a", name=f"ga-{tag}")
    remote = sshd.node(name=f"gb-{tag}", work_dir=str(tmp_path / "node-b"))
    model_dir = str(embedded_model_dir(MODEL_CACHE))  # one path both nodes read: they answer alike
    lenient = {"max_short_fraction": 1.0, "max_degenerate_fraction": 1.0, "max_truncated_fraction": 1.0,
               "max_boilerplate_fraction": 1.0}
    generation = GenerateParams(
        dataset=f"across-{tag}", run="r1", prompt_sources=[{"path": _prompt_file(tmp_path), "name": "counting"}],
        shard_size=SHARD_SIZE, holdout={"count": 2}, canary_prompts=0, node_timeout_s=NODE_TIMEOUT_S,
        engine={"engine": "transformers", "model": model_dir},
        sampling={"max_tokens": 16, "temperature": 0.0, "enable_thinking": False},
        client={"concurrency": 2, "backoff_s": 0.1},
        nodes=[{"provision": ProvisionParams(node=node, worker_python=sys.executable).model_dump(mode="json"),
                "base_port": free_port()} for node in (local, remote)])
    params = PipelineParams(generation=generation, tokenization={"workers": 1, "gate": lenient,
                                                                 "tokenizer_dir": model_dir})
    form = {"params": params.model_dump(mode="json")}
    try:
        run = run_deployment(deployment_for("pipeline"), parameters=form, timeout=0, as_subflow=False)
        with get_client(sync_client=True) as client:
            remote_share = _wait_for_a_shard_of(client, store, run.id, remote.name, timeout_s=300)
            sshd_run.close()  # the node stops answering...
            killed = _kill_node(tmp_path / "node-b")  # ...and everything it ran dies with it
            assert killed, "nothing of the SSH node was running"
            run = wait_final(client, run.id, timeout_s=420)
            assert run.state.is_completed(), run.state
            stages = [r for r in children(client, run.id)]
            [generate_run] = [r for r in stages if client.read_deployment(r.deployment_id).name == "generate"]
            shares = _shares(client, generate_run.id)
        result = run.state.result()
        made = result.generation
        # every prompt answered exactly once across the merged shards, training and held-out
        ids = [id_ for shard in made.shards for id_ in _ids(store, shard.uri)]
        assert sorted(ids) == sorted(f"p{i}" for i in range(PROMPTS)), ids
        assert len({shard.uri for shard in made.shards}) == len(made.shards) == PROMPTS // SHARD_SIZE
        assert sorted(made.heldout_prompt_ids) == sorted(id_ for shard in made.shards if shard.split == "heldout"
                                                         for id_ in _ids(store, shard.uri))
        # the tokenize stage took the merged result whole: no duplicate, every sample
        tokenized = result.tokenization
        assert tokenized.overall["samples"] == PROMPTS and tokenized.overall["duplicate_ids"] == 0, tokenized.overall
        # who answered what: the dead node kept the shards it finished, the other took over the rest
        by_node = {share.node: share for share in made.by_node}
        assert set(by_node) == {local.name, remote.name}
        assert "lost" in (by_node[remote.name].lost or "") or "Crashed" in (by_node[remote.name].lost or ""), \
            by_node[remote.name]
        assert remote_share in by_node[remote.name].shards
        assert sorted(by_node[local.name].shards + by_node[remote.name].shards) == sorted(s.uri for s in made.shards)
        assert by_node[local.name].lost is None and by_node[local.name].outcomes["completed"] > 0
        # every prompt counted once, the dead node's own shards as its; it could not be reached to be stopped
        assert made.outcomes["completed"] == PROMPTS, made.outcomes
        assert by_node[remote.name].outcomes["completed"] == SHARD_SIZE * len(by_node[remote.name].shards)
        assert "could not be reached to stop its run" in by_node[remote.name].lost, by_node[remote.name].lost
        # the local node ran two shares (its own, then the dead node's leftovers); the dead one's run was crashed
        assert [name for name, state in shares if state == "Completed"].count(local.name) == 2, shares
        assert (remote.name, "Crashed") in shares, shares
        # the S3 usage and the run summary say it node by node
        [usage_uri] = [r["uri"] for r in result.artifacts if r["uri"].endswith("/usage.json")]
        usage = json.loads(store.get_bytes(usage_uri.split("/", 3)[3]))
        assert {r["node"]: r["shards"] for r in usage["generated_by_node"]} == \
            {name: len(share.shards) for name, share in by_node.items()}
        assert all(r["bytes"] > 0 for r in usage["generated_by_node"]), usage["generated_by_node"]
        summary = _summary(client_factory=get_client, run_id=run.id)
        assert "## Generation, by node" in summary and f"| {remote.name} | {len(by_node[remote.name].shards)} |" in summary

        # A rerun of the same form after one shard was lost from the bucket: the dead node does not answer, so
        # the live one answers that shard alone; every other shard is kept as it was
        lost_uri = by_node[remote.name].shards[0]
        store.delete_many([lost_uri.split("/", 3)[3], lost_uri.split("/", 3)[3] + ".manifest.json"])
        rerun_form = {"params": PipelineParams(generation=generation).model_dump(mode="json")}  # the same generation
        again = run_deployment(deployment_for("pipeline"), parameters=rerun_form, timeout=0, as_subflow=False)
        with get_client(sync_client=True) as client:
            again = wait_final(client, again.id, timeout_s=300)
        assert again.state.is_completed(), again.state
        rerun = again.state.result().generation
        kept = {s.uri: s.sha256 for s in made.shards if s.uri != lost_uri}
        assert {s.uri: s.sha256 for s in rerun.shards if s.uri != lost_uri} == kept
        assert sorted(id_ for shard in rerun.shards for id_ in _ids(store, shard.uri)) == \
            sorted(f"p{i}" for i in range(PROMPTS))
        assert rerun.outcomes["generated_now"] == SHARD_SIZE
        again_by_node = {share.node: share for share in rerun.by_node}
        assert (again_by_node[remote.name].lost or "").startswith("unreachable"), again_by_node[remote.name]
        assert lost_uri in again_by_node[local.name].shards
    finally:
        sshd_run.close()
        _kill_node(tmp_path / "node-b")
        with local.connect() as access:
            stop_node_worker(access, work_dir=access.path(local.work_dir))


def test_a_node_whose_worker_is_killed_is_stopped_fenced_and_counted(stage_server, store, env_settings, monkeypatch,
                                                                    tmp_path: Path) -> None:
    """The SSH node's worker is SIGKILLed after its run stored a shard, and its servers are frozen (SIGSTOP) so that
    its run, alive, cannot finish its share before the worker's silence gets its node declared lost. The generate
    run must then stop that run on the node (run and servers), fence its shards, count what it stored as its own,
    and refuse a late write of it."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from dflash_core.services.stages import result_store_env
    from flows.deployments import deployment_for
    from flows.pipeline import PipelineParams
    from tests.integration.shared_runs import children, wait_final

    for key, value in result_store_env(env_settings).items():
        monkeypatch.setenv(key, value)
    (tmp_path / "sshd-home").mkdir()
    sshd_run = start_sshd(tmp_path / "sshd-home")
    sshd = next(sshd_run)
    tag = uuid.uuid4().hex[:6]
    local = local_node(tmp_path / "node-a", name=f"wa-{tag}")
    remote = sshd.node(name=f"wb-{tag}", work_dir=str(tmp_path / "node-b"))
    generation = _two_node_generation(tmp_path, tag=tag, nodes=(local, remote))
    form = {"params": PipelineParams(generation=generation).model_dump(mode="json")}
    try:
        run = run_deployment(deployment_for("pipeline"), parameters=form, timeout=0, as_subflow=False)
        with get_client(sync_client=True) as client:
            _wait_for_a_shard_of(client, store, run.id, remote.name, timeout_s=300)
            [worker] = _pids(lambda pid: _cmdline(pid).endswith(f"--work-queue node-{remote.name} --no-register"))
            os.kill(worker, signal.SIGKILL)
            frozen = _pids(lambda pid: _cwd(pid).startswith(str(tmp_path / "node-b" / "servers")))
            assert frozen, "the SSH node runs no server"
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            run = wait_final(client, run.id, timeout_s=420)
            assert run.state.is_completed(), run.state
            [generate_run] = [r for r in children(client, run.id) if client.read_deployment(r.deployment_id).name
                              == "generate"]
            node_runs = {r.id: r for r in children(client, generate_run.id)
                         if ((r.parameters or {}).get("params") or {}).get("prompt_shards") is not None}
        made = run.state.result().generation
        by_node = {share.node: share for share in made.by_node}
        lost, kept = by_node[remote.name], by_node[local.name]
        [lost_run] = [node_runs[UUID(id_)] for id_ in lost.flow_runs]

        # stopped: nothing of its run is left on the node (its frozen servers included), and it says so
        assert not _pids(lambda pid: _environ_has(pid, f"PREFECT__FLOW_RUN_ID={lost_run.id}")), "its run still runs"
        assert lost_run.state.name == "Crashed" and re.search(r"stopped on the node: [1-9]\d* process", lost.lost), \
            lost.lost  # its frozen servers at least: they cannot have ended by themselves
        assert not any(_alive(pid) for pid in frozen), frozen
        # counted: every prompt once in the total, each node's completions its own shards' prompts, one run each
        assert made.outcomes["completed"] == PROMPTS, made.outcomes
        assert lost.outcomes["completed"] == SHARD_SIZE * len(lost.shards) > 0, lost
        assert kept.outcomes["completed"] == SHARD_SIZE * len(kept.shards), kept
        assert len(lost.flow_runs) == 1 and len(kept.flow_runs) == 2, (lost.flow_runs, kept.flow_runs)
        assert lost.completions_by_run == {str(lost_run.id): SHARD_SIZE * len(lost.shards)}, lost
        assert sum(kept.completions_by_run.values()) == kept.outcomes["completed"], kept
        # fenced: each shard stored once, by the share it is dealt to; a late write of the lost run is refused
        from dflash_core.serving.generation import ShardNotAssigned, assignment_of, stored_by

        keys = {shard.uri: store.key_of(shard.uri) for shard in made.shards}
        assert sorted(lost.shards + kept.shards) == sorted(keys), (lost.shards, kept.shards)
        assert all(stored_by(store, key) == assignment_of(store, key).deal for key in keys.values())
        assert {stored_by(store, keys[uri]) for uri in lost.shards} == {lost_run.idempotency_key}
        dealt = dict(zip(_output_keys(store, lost_run.parameters["params"]),
                         lost_run.parameters["params"]["prompt_shards"]))
        taken_over = [key for key in dealt if store.uri(key) not in lost.shards]
        assert taken_over and all(store.uri(key) in kept.shards for key in taken_over), (taken_over, kept.shards)
        with pytest.raises(ShardNotAssigned, match="declared lost"):
            _late_write(store, generation, lost_run, prompt_key=dealt[taken_over[0]], output_key=taken_over[0])
        assert {s.uri: store.head(k).sha256 for s in made.shards for k in [keys[s.uri]]} == \
            {s.uri: s.sha256 for s in made.shards}
        # the summary says the same: the generate stage's total, the node table, each run's own count
        summary = _summary(client_factory=get_client, run_id=run.id)
        assert f"{PROMPTS} completions (0 failed)" in summary, summary
        assert f"| {remote.name} | {len(lost.shards)} | {lost.outcomes['completed']} | 0 |" in summary, summary
        for node, share in by_node.items():
            for run_id, count in share.completions_by_run.items():
                assert f"node {node}: {count} completions" in summary, (node, run_id, summary)
    finally:
        for pid in _pids(lambda pid: _environ_has(pid, f"DFLASH_WORK_DIR={tmp_path / 'node-b'}")):
            os.kill(pid, signal.SIGKILL)
        sshd_run.close()
        with local.connect() as access:
            stop_node_worker(access, work_dir=access.path(local.work_dir))


def _two_node_generation(tmp_path: Path, *, tag: str, nodes):
    from dflash_core.embedded import embedded_model_dir
    from flows.generate import GenerateParams
    from flows.nodes import ProvisionParams
    from tests.conftest import free_port

    return GenerateParams(
        dataset=f"lost-{tag}", run="r1", prompt_sources=[{"path": _prompt_file(tmp_path), "name": "counting"}],
        shard_size=SHARD_SIZE, holdout={"count": 2}, canary_prompts=0, node_timeout_s=NODE_TIMEOUT_S,
        engine={"engine": "transformers", "model": str(embedded_model_dir(MODEL_CACHE))},
        sampling={"max_tokens": 16, "temperature": 0.0, "enable_thinking": False},
        client={"concurrency": 2, "backoff_s": 0.1},
        nodes=[{"provision": ProvisionParams(node=node, worker_python=sys.executable).model_dump(mode="json"),
                "base_port": free_port()} for node in nodes])


def _late_write(store, generation, lost_run, *, prompt_key: str, output_key: str) -> None:
    """What the lost run would do with a shard dealt to the other node since: write it, through the same writer."""
    from dflash_core.serving.generation import GenerationTarget, ShardAssignment, generate_shard

    share = lost_run.parameters["params"]
    target = GenerationTarget(urls=[], model=generation.engine.request_model, server=generation.engine.engine,
                              sampling=generation.sampling, client=generation.client)
    with tempfile.TemporaryDirectory() as scratch:
        generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target, scratch_dir=Path(scratch),
                       assignment=ShardAssignment(node=share["node"]["name"], deal=lost_run.idempotency_key))


def _pids(match) -> list[int]:
    """The live processes of this host (but this one) that `match(pid)`."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if pid != os.getpid() and _alive(pid) and match(pid)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _environ_has(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _wait_for_a_shard_of(client, store, pipeline_run_id, node_name: str, *, timeout_s: float) -> str:
    """The URI of the first completion shard a run on `node_name` stored, while that run still has shards to go."""
    from dflash_core.layout import manifest_key
    from dflash_core.lineage import read_manifest
    from tests.integration.shared_runs import children

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for stage in children(client, pipeline_run_id):
            for share in children(client, stage.id):
                params = (share.parameters or {}).get("params") or {}
                if (params.get("node") or {}).get("name") != node_name or not params.get("prompt_shards"):
                    continue
                # A shard counts once its manifest is there: the data object is stored first.
                done = [key for key in _output_keys(store, params) if store.exists(manifest_key(key))
                        and str(read_manifest(store, key).producer.flow_run_id) == str(share.id)]
                if done:
                    assert len(done) < len(params["prompt_shards"]), "the node finished its share before the kill"
                    return store.uri(done[0])
        time.sleep(0.5)
    raise TimeoutError(f"no run on {node_name} stored a shard within {timeout_s} s")


def _summary(*, client_factory, run_id) -> str:
    """The pipeline run's summary artifact (markdown)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from tasks.pipeline_report import SUMMARY_KEY

    with client_factory(sync_client=True) as client:
        [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[SUMMARY_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return artifact.data


def _output_keys(store, params: dict) -> list[str]:
    from dflash_core.layout import ArtifactKind, artifact_key, downstream_shard_name
    from dflash_core.settings import load_settings

    prefixes = load_settings().s3_prefixes
    return [artifact_key(prefixes, ArtifactKind.COMPLETIONS, params["dataset"], params["run"],
                         downstream_shard_name(key, suffix="jsonl")) for key in params["prompt_shards"]]


def _shares(client, generate_run_id) -> list[tuple[str, str]]:
    """(node, final state name) of every node share the generate run started."""
    from tests.integration.shared_runs import children

    found = []
    for run in children(client, generate_run_id):
        params = (run.parameters or {}).get("params") or {}
        if params.get("prompt_shards") is not None:
            found.append((params["node"]["name"], run.state.name))
    return found
