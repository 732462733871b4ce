"""Node flows: provision a node (idempotent), preserve it before shutdown, and a hook that preserves
the node a generate or train flow run was given when that run fails, crashes or is cancelled.

Run: `python -m flows.nodes provision --params '{"node": {"name": "gpu-1", "host": "10.0.0.5", "user": "ubuntu"}}'`
     `python -m flows.nodes preserve --params '{"node_name": "gpu-1", "inventory": "nodes.yaml"}'`
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import Field

from dflash_core.layout import ArtifactKind
from dflash_core.nodes import Node, NodeRecord, PreserveConfig, ProvisionConfig, find_node, local_node
from dflash_core.nodes.preserve import preserve
from dflash_core.nodes.worker import node_queue
from dflash_core.settings import Settings, load_settings
from dflash_core.stage_results import ProvisionedNode
from dflash_core.storage import ObjectStore
from dflash_core.strict import StrictModel
from dflash_core.units import binary_bytes
from flows.command_line import run_chosen_from_command_line
from tasks.artifacts import artifact_record, stored_record
from tasks.nodes import preserve_node, provision_node, register_node_record, start_node_worker
from tasks.store import check_store


class NodeChoice(StrictModel):
    node: Node | None = Field(None, description="The node, inline (host, user, key_path, work_dir, gpus).")
    node_name: str | None = Field(None, description="Or: a node name from the inventory file.")
    inventory: str | None = Field(None, description="Node inventory YAML (with node_name).")

    def resolve(self, settings: Settings) -> Node:
        if self.node is not None and self.node_name is not None:
            raise ValueError("pass node or node_name (with inventory), not both")
        if self.node is not None:
            return self.node
        if self.node_name is not None:
            if not self.inventory:
                raise ValueError(f"node_name {self.node_name!r} needs inventory (a nodes YAML file)")
            return find_node(Path(self.inventory), self.node_name)
        return local_node(settings.work_path("node"))


class ProvisionParams(NodeChoice):
    provision: ProvisionConfig = Field(default_factory=ProvisionConfig)
    upload: bool = Field(True, description="Register the node record in S3 (`node-backups/<node>/<time>/`).")
    start_worker: bool = Field(True, description=(
        "Start the node's own stage worker (polling the work queue `node-NAME` of the dflash pool), so the "
        "pipeline's stages run on this node; off: provision only."))
    repo_dir: str | None = Field(None, description=(
        "The project's checkout on the node, where its worker runs the stages' flows; None: this checkout's path "
        "(the same path on the node: a local node, or a node that mounts or clones it there)."))
    worker_python: str | None = Field(None, description=(
        "Interpreter of the node's worker; None: the provisioned venv's bin/python."))


class PreserveParams(NodeChoice):
    preserve: PreserveConfig = Field(default_factory=PreserveConfig)


def record_markdown(record: NodeRecord, uri: str | None) -> str:
    gpus = "\n".join(f"| GPU {g.index} | {g.name}, {g.memory_mib:,} MiB, driver {g.driver} |" for g in record.gpus.gpus) \
        or f"| GPUs | {record.gpus.note} |"
    disks = "\n".join(f"| disk `{d.path}` | {d.fs_type} at `{d.mount_point}`: {binary_bytes(d.free_bytes)} free of "
                      f"{binary_bytes(d.total_bytes)} |" for d in record.disks)
    model = (f"| model | `{record.model.source}` reads {record.model.read_mb_s:,.0f} MB/s -> `{record.model.placed_at}` "
             f"({record.model.reason}) |") if record.model else "| model | none given |"
    return "\n".join([
        f"## Node {record.node} ({record.hostname})", "",
        "| what | value |", "|---|---|",
        f"| changed | {'; '.join(record.actions) or 'nothing (already provisioned)'} |",
        f"| venv | `{record.venv.path}` ({record.venv.fs_type}), Python {record.venv.python}, "
        f"{len(record.venv.freeze)} packages |",
        gpus, f"| CUDA (driver) | {record.gpus.cuda_version or '-'} |", disks, model,
        f"| record | {uri or 'not uploaded'} |",
    ]) + "\n"


@flow(name="dflash-provision", log_prints=True)
def provision(params: ProvisionParams = ProvisionParams()) -> ProvisionedNode:
    """Provision the node, start its stage worker, and hand the stages what is where (`ProvisionedNode`)."""
    settings = load_settings()
    node = params.resolve(settings)
    if params.upload:
        check_store(settings)
    record = provision_node(node, params.provision)
    manifest = register_node_record(settings, record) if params.upload else None
    uri = manifest.uri if manifest else None
    queue = node_queue(node.name) if params.start_worker else None  # no worker there: stages use the default queue
    if params.start_worker:
        worker = start_node_worker(settings, node, record, repo_dir=params.repo_dir, python=params.worker_python)
        print(f"{node.name}: stage worker {'started' if worker.started else 'already running'} (pid {worker.pid}, "
              f"queue {worker.queue}, log {worker.log_path})")
    create_markdown_artifact(record_markdown(record, uri), key=f"node-record-{_artifact_key(node.name)}",
                             description=f"provision of {node.name}")
    create_table_artifact([d.model_dump() for d in record.disks], key=f"node-disks-{_artifact_key(node.name)}")
    print(f"{node.name}: {'; '.join(record.actions) or 'already provisioned, nothing changed'}")
    return ProvisionedNode(
        node=node.model_dump(mode="json"), hostname=record.hostname, work_dir=record.work_dir, venv=record.venv.path,
        model=record.model.placed_at if record.model else None, num_gpus=len(record.gpus.gpus), work_queue=queue,
        actions=record.actions, record_uri=uri, flow_run=str(flow_run.id or ""),
        artifacts=[artifact_record(manifest)] if manifest else [])


@flow(name="dflash-preserve", log_prints=True)
def preserve_flow(params: PreserveParams = PreserveParams()) -> dict:
    settings = load_settings()
    node = params.resolve(settings)
    check_store(settings)
    result = preserve_node(settings, node, params.preserve)
    create_markdown_artifact(result.note_markdown, key=f"node-backup-{_artifact_key(node.name)}",
                             description=f"what was saved from {node.name} and where")
    print(f"saved {len(result.saved)} objects under {result.prefix_uri}; stopped {len(result.stopped)} process(es)")
    return {"prefix": result.prefix_uri, "note": result.note_uri, "saved": [s.uri for s in result.saved],
            "stopped": [s.model_dump() for s in result.stopped], "missing": result.missing,
            "artifacts": [stored_record(s.uri, kind=ArtifactKind.NODE_BACKUP, sha256=s.sha256) for s in result.saved]}


def preserve_on_failure(flow_obj, flow_run_obj, state) -> None:
    """Flow hook (on_failure / on_cancellation / on_crashed): preserve the node in the run's `params.node`,
    if it was given one. Never raises: a failed backup is logged, the run's own failure stays the story."""
    raw = (flow_run_obj.parameters or {}).get("params") or {}
    node_data = raw.get("node") if isinstance(raw, dict) else getattr(raw, "node", None)
    if node_data:
        preserve_after(lambda settings: node_data if isinstance(node_data, Node) else Node.model_validate(node_data),
                       state)


def preserve_after(resolve_node, state) -> None:
    """Preserve the node `resolve_node(settings)` names after a run ended in `state`; never raises."""
    logger = get_run_logger() if _has_run_context() else None
    try:
        settings = load_settings()
        node = resolve_node(settings)
        store = ObjectStore.from_settings(settings)
        with node.connect() as access:
            result = preserve(access, node, store, settings.s3_prefixes, PreserveConfig())
        message = f"preserved {node.name} after {state.name}: {result.prefix_uri} (note {result.note_uri})"
    except Exception as error:  # noqa: BLE001 - a hook must not hide the run's own failure
        message = f"could not preserve the node after {state.name}: {error}"
    if logger:
        logger.warning(message)
    else:
        print(message, file=sys.stderr)


def _has_run_context() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def _artifact_key(name: str) -> str:
    return "".join(c if c.isalnum() or c == "-" else "-" for c in name.lower())


if __name__ == "__main__":
    run_chosen_from_command_line({"provision": (provision, ProvisionParams), "preserve": (preserve_flow, PreserveParams)})
