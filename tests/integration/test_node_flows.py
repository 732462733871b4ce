"""The provision and preserve flows on the local node, and the hook that preserves a node when a flow run
that was given one fails.

Run: `.venv/bin/python -m pytest tests/integration/test_node_flows.py -q`
"""

from __future__ import annotations

import uuid
from pathlib import Path

from prefect import flow
from pydantic import BaseModel

from dflash_core.lineage import read_manifest
from dflash_core.nodes import Node, NodeRecord, ProvisionConfig, local_node
from dflash_core.storage import ObjectStore


class _WorkParams(BaseModel):
    node: Node | None = None


def test_provision_flow_then_a_failing_run_preserves_its_node(prefect_server, store: ObjectStore, env_settings,
                                                              tmp_path: Path) -> None:
    from flows.nodes import ProvisionParams, preserve_on_failure, provision

    node = local_node(tmp_path / "node", name=f"flow-{uuid.uuid4().hex[:8]}")
    first = provision(ProvisionParams(node=node, provision=ProvisionConfig(), start_worker=False))
    again = provision(ProvisionParams(node=node, provision=ProvisionConfig(), start_worker=False))
    assert first.actions and again.actions == []
    assert first.work_queue is None  # no worker of its own: its stages would go to the default queue
    record = NodeRecord.model_validate_json(store.get_bytes(again.record_uri.removeprefix(store.uri(""))))
    assert record.node == node.name and read_manifest(store, again.record_uri.removeprefix(store.uri("")))

    (tmp_path / "node" / "logs").mkdir()
    (tmp_path / "node" / "logs" / "train.log").write_text("step 10 loss nan\n")

    @flow(name="dflash-hook-probe", on_failure=[preserve_on_failure])
    def work(params: _WorkParams) -> None:
        raise RuntimeError("training diverged")

    state = work(_WorkParams(node=node), return_state=True)
    assert state.is_failed()
    prefix = f"node-backups/{node.name}/"
    keys = {info.key.rsplit("/", 1)[-1] for info in store.list(prefix)}
    assert {"logs.tar.gz", "NOTE.md", "inventory.json", "node-record.json"} <= keys


def test_generate_and_train_flows_preserve_their_node_on_failure() -> None:
    """The real stage flows carry the hook the probe above exercises, and take a `node` parameter."""
    from flows.generate import GenerateParams, generate
    from flows.nodes import preserve_on_failure
    from flows.train import TrainFlowParams, train

    for stage in (generate, train):
        for hooks in (stage.on_failure_hooks, stage.on_cancellation_hooks, stage.on_crashed_hooks):
            assert preserve_on_failure in hooks, stage.name
    assert GenerateParams.model_fields["node"].default is None
    assert TrainFlowParams.model_fields["node"].default is None
