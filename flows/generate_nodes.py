"""Generation across several nodes from one generate run (its `nodes`): the run that holds the form imports the
prompts once, provisions every node (which starts the node's own worker, on its queue `node-<name>`), deals
the unanswered prompt shards among the nodes in proportion to their server instances
(dflash_core/serving/shares.py) and starts one `generate-node` run per node on that node's queue, each with
its own Retry, all at once. The results merge into one `CompletionsDataset` (flows/generate.py).

A node drops out of the run, and its unanswered shards go to the nodes still in it in the next wave, when
    - it does not answer before provisioning (unreachable), or its provision fails;
    - its run fails or crashes (the node's worker reports that);
    - its worker has not been heard from for `node_timeout_s` (the node died with its worker): its run is
      marked Crashed, saying so.
A node declared lost is stopped at once: the shards it has not stored are dealt to no node (a write of them
from its run is refused: dflash_core/serving/generation.py `fenced_for`), and every process of its run on the
node (the run and its servers) is killed, when the node can be reached. The shards it stored before count as its
own. A shard's answers so far are in S3 (`<shard>.partial`, every 64 answers), so the node that takes it over
resumes there; a shard a lost node's write stored after it was dealt again is answered again by its new node and
left out of the merge. Every shard already answered with the same prompts, model and sampling is kept; a rerun or
a Retry checks each shard again, probes each node again and deals only what is left, so no shard is answered
twice and no finished one is redone (a Retry first stops the node runs an earlier attempt left running).
Shards whose prompts failed within `max_failed_fraction` stay as they are until a rerun retries those
prompts, as on one node.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from prefect import get_run_logger
from prefect.runtime import flow_run

from dflash_core.nodes import Node
from dflash_core.nodes.worker import node_queue
from dflash_core.serving.generation import (
    GenerationTarget, ShardAssignment, assign_shard, revoke_shard, shard_is_done, stored_by, stored_by_another,
    stored_outcome,
)
from dflash_core.serving.profiles import EngineProfile
from dflash_core.serving.shares import check_shares, split_by_weight
from dflash_core.services.stages import WORK_POOL
from dflash_core.settings import Settings
from dflash_core.stage_results import MODEL_FROM_NODE, CompletionsDataset, NodeShare, ProvisionedNode
from dflash_core.storage import ObjectStore
from flows.deployments import StageFailed, StartedStage, stage_result, start_stage
from flows.generate_params import GenerateParams, GenerationNode

NODE_DEPLOYMENT = "generate-node"
HEARTBEAT_CHECK_S = 5.0  # how often the waiting run asks the server when each node's worker was last heard from
POLL_S = 1.0


class NodesLost(RuntimeError):
    """Every node dropped out while shards were still unanswered."""


def answer_across_nodes(settings: Settings, params: GenerateParams, *, prompt_keys: list[str],
                        output_keys: list[str]) -> list[NodeShare]:
    """Answer every prompt shard on the form's nodes (waves until none is left); what each node answered. When
    every shard is already answered (and the model is named without `@node`), no node is needed."""
    from prefect.runtime import deployment

    if not deployment.id:
        raise RuntimeError("a generation across nodes runs as a deployment run (`dflash run generate`, the pipeline "
                           "deployment or the UI): each node's share is a run that the node's own worker picks up")
    logger = get_run_logger()
    store = ObjectStore.from_settings(settings)
    attempt = flow_run.run_count or 1
    resolved = {_named(spec, settings): spec for spec in params.nodes}
    shares = {name: NodeShare(node=name) for name in resolved}
    if attempt > 1:  # a Retry: an earlier attempt's node runs may outlive it (its process died, theirs did not)
        stopped = stop_earlier_shares(str(flow_run.id), timeout_s=params.node_timeout_s)
        if stopped:
            logger.info("stopped %d node run(s) of an earlier attempt before dealing again: %s", len(stopped),
                        ", ".join(stopped))
    output_of = dict(zip(prompt_keys, output_keys))
    finished: set[str] = set()  # answered by a run that completed in this attempt (failed prompts wait for a rerun)

    def pending(planned: GenerationTarget) -> list[str]:
        return [key for key in prompt_keys if stored_by_another(store, output_of[key]) or (key not in finished
                and not shard_is_done(store, prompt_key=key, output_key=output_of[key], target=planned))]

    declared = {name: spec.engine or params.engine for name, spec in resolved.items()}
    if all(engine.model != MODEL_FROM_NODE for engine in declared.values()):
        if not pending(_planned(params, _same_work(declared))):
            logger.info("every shard is already generated with this model and sampling: no node needed")
            return list(shares.values())
    live = _provisioned(settings, resolved, shares, attempt=attempt)
    if not live:
        raise NodesLost(_none_left(shares, "the prompt shards are"))
    engines = {name: _engine(params, resolved[name], node) for name, node in live.items()}
    planned = _planned(params, _same_work(engines))
    for wave in range(len(resolved) + 1):
        left = pending(planned)
        if not left:
            break
        if not live:
            raise NodesLost(_none_left(shares, f"{len(left)} prompt shard(s) are"))
        split = split_by_weight(left, {name: resolved[name].num_instances for name in live})
        check_shares(left, split)
        logger.info("wave %d: %s", wave, ", ".join(f"{name} {len(keys)} shard(s)" for name, keys in split.items()))
        dealt = {name: _deal(store, name, [output_of[key] for key in keys], key=f"generate-{name}-attempt-{attempt}-"
                             f"wave-{wave}") for name, keys in split.items() if keys}
        started = {name: start_stage(NODE_DEPLOYMENT, _share_params(params, resolved[name], live[name], split[name],
                                                                     engines[name]),
                                     key=deal.key, work_queue=live[name].work_queue) for name, deal in dealt.items()}
        stopped: dict[str, str] = {}

        def on_final(name: str, state) -> None:
            if not state.is_completed():
                stopped[name] = _stop_lost(settings, store, resolved[name], dealt[name], started[name])

        _wait_all(started, silent=lambda client, name: _silent(client, name, params.node_timeout_s), on_final=on_final)
        for name, stage in started.items():
            try:
                made: CompletionsDataset = stage_result(stage)
            except StageFailed as failed:
                shares[name].lost = f"{failed} {stopped.get(name, '')}".strip()
                del live[name]
                _add(shares[name], _stored_outcomes(store, dealt[name]), run_id=str(stage.run_id))
                logger.warning("node %s dropped out; its unanswered shards go to the others: %s", name,
                               shares[name].lost)
                continue
            finished.update(split[name])
            _add(shares[name], made.outcomes, run_id=str(stage.run_id))
    return list(shares.values())


@dataclass(frozen=True)
class _Deal:
    """The shards (completion keys) one wave deals to one node, under its share run's idempotency key."""

    node: str
    key: str  # the share's stage key
    deal: str  # start_stage's idempotency key for it: what its run writes under
    output_keys: list[str]

    def assignment(self) -> ShardAssignment:
        return ShardAssignment(node=self.node, deal=self.deal)


def _deal(store: ObjectStore, node: str, output_keys: list[str], *, key: str) -> _Deal:
    """Deal `output_keys` to `node`'s share started with stage key `key`: its assignment in each shard, written
    before the share starts so that its first write already finds it."""
    deal = _Deal(node=node, key=key, deal=f"{flow_run.id}:{key}", output_keys=output_keys)  # as start_stage keys it
    for output_key in output_keys:
        assign_shard(store, output_key, deal.assignment())
    return deal


def _stop_lost(settings: Settings, store: ObjectStore, spec: GenerationNode, deal: _Deal, stage: StartedStage) -> str:
    """Fence and stop the run of a node that dropped out: the shards it has not stored are dealt to nobody (its
    later writes are refused), then every process of its run on the node is killed. What was done, in words."""
    for output_key in deal.output_keys:
        if stored_by(store, output_key) != deal.deal:
            revoke_shard(store, output_key)
    try:
        with spec.provision.resolve(settings).connect() as access:
            killed = access.run(_KILL_RUN.format(run_id=shlex.quote(str(stage.run_id))), timeout_s=60).stdout.split()
    except Exception as error:  # noqa: BLE001 - a node we cannot reach is fenced, not stopped
        return f"(its unstored shards are fenced off; the node could not be reached to stop its run: {error})"
    return f"(its unstored shards are fenced off; stopped on the node: {len(killed)} process(es) of its run)"


# Every process of one flow run on a node: the run's own (Prefect's process worker gives it PREFECT__FLOW_RUN_ID)
# and the servers it started (they inherit its environment). SIGTERM (and SIGCONT, for a frozen one), SIGKILL what
# still runs after 10 s; their PIDs.
_KILL_RUN = """
pids=$(grep -lsaF PREFECT__FLOW_RUN_ID={run_id} /proc/[0-9]*/environ | cut -d/ -f3)
[ -n "$pids" ] || exit 0
alive() {{ for p in $pids; do st=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f1)
           [ -n "$st" ] && [ "$st" != Z ] && return 0; done; return 1; }}
kill -TERM $pids 2>/dev/null; kill -CONT $pids 2>/dev/null; i=0
while alive && [ $i -lt 50 ]; do sleep 0.2; i=$((i+1)); done
kill -KILL $pids 2>/dev/null; echo $pids
"""


def _stored_outcomes(store: ObjectStore, deal: _Deal) -> dict[str, int]:
    """What a run that never reported stored under `deal`, by outcome, from its shards' manifests."""
    outcomes: dict[str, int] = {}
    for output_key in deal.output_keys:
        if stored_by(store, output_key) == deal.deal:
            made = stored_outcome(store, output_key)
            for name in ("completed", "failed", "generated_now", "completion_tokens_now"):
                outcomes[name] = outcomes.get(name, 0) + getattr(made, name)
    return outcomes


def _none_left(shares: dict[str, NodeShare], what: str) -> str:
    lost = "; ".join(f"{share.node}: {share.lost}" for share in shares.values() if share.lost)
    return (f"{what} unanswered and no node is left to answer them ({lost}). Bring a node back (or add one to "
            f"nodes), then rerun: answered shards are kept.")


def _planned(params: GenerateParams, work: tuple[str, str]) -> GenerationTarget:
    """What makes a shard done (the engine kind and the model in requests, with the run's sampling)."""
    engine, model = work
    return GenerationTarget(urls=[], model=model, server=engine, sampling=params.sampling, client=params.client)


def _named(spec: GenerationNode, settings: Settings) -> str:
    return spec.provision.resolve(settings).name


def _provisioned(settings: Settings, resolved: dict[str, GenerationNode], shares: dict[str, NodeShare], *,
                 attempt: int) -> dict[str, ProvisionedNode]:
    """Provision every node that answers (each its own run, all at once, again on each attempt: it is
    idempotent, and a Retry must find out which nodes are still there); the ones that did, by name."""
    started: dict[str, StartedStage] = {}
    for name, spec in resolved.items():
        problem = _unreachable(spec.provision.resolve(settings))
        if problem:
            shares[name].lost = problem
            get_run_logger().warning("node %s left out: %s", name, problem)
            continue
        started[name] = start_stage("provision", spec.provision, key=f"provision-{name}-attempt-{attempt}")
    _wait_all(started)
    live = {}
    for name, stage in started.items():
        try:
            live[name] = stage_result(stage)
        except StageFailed as failed:
            shares[name].lost = f"provision failed: {failed}"
            get_run_logger().warning("node %s left out: %s", name, shares[name].lost)
    return live


def _unreachable(node: Node) -> str | None:
    """Why `node` cannot be used now (it does not answer a command), or None."""
    try:
        with node.connect() as access:
            access.run("true", timeout_s=node.connect_timeout_s + 20)
    except Exception as error:  # noqa: BLE001 - any failure to reach it means the node is out of this run
        return f"unreachable: {error}"
    return None


def _engine(params: GenerateParams, spec: GenerationNode, node: ProvisionedNode) -> EngineProfile:
    engine = spec.engine or params.engine
    if engine.model == MODEL_FROM_NODE:
        if not node.model:
            raise ValueError(f"node {node.node['name']}'s engine model is {MODEL_FROM_NODE!r}, but its provision "
                             f"placed no model: set its provision.provision.model_dir")
        engine = engine.model_copy(update={"model": node.model})
    return engine


def _same_work(engines: dict[str, EngineProfile]) -> tuple[str, str]:
    """The one (engine kind, model in requests) every node serves; ValueError when they differ."""
    kinds = {name: (engine.engine, engine.request_model) for name, engine in engines.items()}
    if len(set(kinds.values())) != 1:
        raise ValueError(f"the nodes would not answer alike (node: (engine, model in requests)): {kinds}. Serve one "
                         f"model under one name everywhere (the same path on every node, or served_model_name with "
                         f"vLLM or SGLang), so a shard one node answered counts as done for the others.")
    return next(iter(kinds.values()))


def _share_params(params: GenerateParams, spec: GenerationNode, node: ProvisionedNode, keys: list[str],
                  engine: EngineProfile) -> GenerateParams:
    return type(params).model_validate({
        **params.model_dump(mode="json", exclude={"nodes", "prompt_sources", "num_instances", "devices", "base_port",
                                                  "node", "engine", "prompt_shards"}),
        "prompt_shards": keys, "engine": engine.model_dump(mode="json"), "num_instances": spec.num_instances,
        "devices": spec.devices, "base_port": spec.base_port, "node": node.node})


def _wait_all(started: dict[str, StartedStage], *, silent: Callable[[object, str], str | None] | None = None,
              on_final: Callable[[str, object], None] | None = None) -> None:
    """Wait until every started run is final; a run whose node `silent` says is gone is marked Crashed. `on_final`
    (name, state) as soon as each is final, before the others are."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    waiting = {name: stage for name, stage in started.items() if stage.state is None}
    if not waiting:  # run in-process, or nothing started
        return
    last_check = time.monotonic()
    with get_client(sync_client=True) as client:
        while waiting:
            check = silent is not None and time.monotonic() - last_check >= HEARTBEAT_CHECK_S
            for name, stage in list(waiting.items()):
                state = client.read_flow_run(stage.run_id).state
                reason = silent(client, name) if check and not (state and state.is_final()) else None
                if reason:
                    client.set_flow_run_state(stage.run_id, Crashed(message=reason), force=True)
                    state = client.read_flow_run(stage.run_id).state
                if state is not None and state.is_final():
                    stage.state = state
                    del waiting[name]
                    if on_final is not None:
                        on_final(name, state)
            if check:
                last_check = time.monotonic()
            if waiting:
                time.sleep(POLL_S)


def stop_earlier_shares(parent_id: str, *, timeout_s: float, poll_s: float = POLL_S) -> list[str]:
    """Cancel every node share of `parent_id` that is not final yet and wait until each is; one still not final
    after `timeout_s` (its node is gone, so no worker ends it) is marked Crashed. Otherwise a share dealt again
    would be answered twice, by its old node and its new one. The names of the runs stopped."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelling, Crashed

    with get_client(sync_client=True) as client:
        runs = [run for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
                if ((run.parameters or {}).get("params") or {}).get("prompt_shards") is not None
                and not (run.state and run.state.is_final())]
        for run in runs:
            client.set_flow_run_state(run.id, Cancelling(message="a Retry of the generation deals its shards again"),
                                      force=True)
        deadline = time.monotonic() + timeout_s
        waiting = list(runs)
        while waiting and time.monotonic() < deadline:
            time.sleep(poll_s)
            waiting = [run for run in waiting if not client.read_flow_run(run.id).state.is_final()]
        for run in waiting:
            client.set_flow_run_state(run.id, Crashed(message=f"not stopped within {timeout_s:.0f} s of a Retry's "
                                                              f"cancel: its node is gone"), force=True)
    return [run.name for run in runs]


def _silent(client, name: str, timeout_s: float) -> str | None:
    """Why node `name` counts as gone (its worker silent for `timeout_s`), or None."""
    queue = node_queue(name)
    beats = [w.last_heartbeat_time for w in client.read_workers_for_work_pool(WORK_POOL)
             if w.name.endswith(f"-{queue}") and w.last_heartbeat_time is not None]
    if not beats:
        return None  # never heard from: provision waits for its first heartbeat, so this is not a node of ours yet
    age = (datetime.now(UTC) - max(beats)).total_seconds()
    if age <= timeout_s:
        return None
    return (f"node {name} lost: its worker (queue {queue}) has not been heard from for {age:.0f} s (node_timeout_s "
            f"{timeout_s:.0f}); its unanswered shards go to the other nodes")


def _add(share: NodeShare, outcomes: dict[str, int], *, run_id: str) -> None:
    for name, count in outcomes.items():
        share.outcomes[name] = share.outcomes.get(name, 0) + count
    share.flow_runs.append(run_id)
    share.completions_by_run[run_id] = outcomes.get("completed", 0)


def merged_shards(store: ObjectStore, output_keys: list[str]) -> list[str]:
    """The stored shards of `output_keys` that the merge takes: each stored by the node share it is dealt to (or
    by a run outside any deal); one a lost node stored after it was dealt again is left out."""
    stored = [key for key in output_keys if store.exists(key)]
    foreign = [key for key in stored if stored_by_another(store, key)]
    if foreign:
        get_run_logger().warning("left out of the merge, stored by a node they were no longer dealt to: %s",
                                 ", ".join(store.uri(key) for key in foreign))
    return [key for key in stored if key not in foreign]


def credit_shards(store: ObjectStore, shares: list[NodeShare], shard_keys: list[str]) -> list[NodeShare]:
    """`shares` with each stored shard credited to the node whose run wrote it (its manifest's producer, a
    `generate-node` run of this run or an earlier one): a node that dropped out keeps the shards it finished
    first, and a rerun with nothing left to answer still says who answered what."""
    from dflash_core.lineage import read_manifest

    producers = {key: read_manifest(store, key).producer for key in shard_keys}
    node_of = _node_of_runs({str(p.flow_run_id) for p in producers.values() if p is not None and p.flow_run_id})
    named = {share.node: share for share in shares}
    for key, producer in producers.items():
        name = node_of.get(str(producer.flow_run_id)) if producer is not None else None
        if name is None:
            continue
        share = named.setdefault(name, NodeShare(node=name))
        if store.uri(key) not in share.shards:
            share.shards.append(store.uri(key))
    return list(named.values())


def _node_of_runs(run_ids: set[str]) -> dict[str, str]:
    """flow run id -> the node it answered on, for those of `run_ids` that are node shares (`params.node`)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = {}
    with get_client(sync_client=True) as client:
        for run_id in sorted(run_ids):
            try:
                run = client.read_flow_run(run_id)
            except (ObjectNotFound, ValueError):  # deleted from the server, or not a run id
                continue
            params = (run.parameters or {}).get("params") or {}
            node = params.get("node") if isinstance(params, dict) else None
            if isinstance(node, dict) and node.get("name") and params.get("prompt_shards") is not None:
                found[run_id] = node["name"]
    return found
