"""Where a training run keeps its checkpoints and shard cache by default: `output_dir` under the work dir
(DFLASH_WORK_DIR, `.dflash` by default), never relative to the process's cwd (a stage's worker runs in the checkout,
so 1.6 GB of checkpoints landed inside it); a stage sent to a provisioned node writes under the node's work dir.

Run: `.venv/bin/python -m pytest -q -n 0 tests/unit/test_train_output_dir.py`
"""

from __future__ import annotations

from pathlib import Path

from dflash_core.train.config import TrainConfig


def test_checkpoints_and_the_shard_cache_default_to_the_work_dir_not_the_cwd(tmp_path, monkeypatch):
    work, checkout = tmp_path / "work", tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("DFLASH_WORK_DIR", str(work))
    config = TrainConfig(target="tiny:llama", run_name="r")
    assert config.output_dir == work.resolve() / "runs"
    assert not config.run_dir.resolve().is_relative_to(checkout)


def test_without_a_work_dir_set_the_default_is_dot_dflash_as_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_WORK_DIR", raising=False)
    assert TrainConfig(target="tiny:llama").output_dir == (tmp_path / ".dflash" / "runs").resolve()


def test_a_training_stage_on_a_node_writes_under_the_nodes_work_dir_unless_told(tmp_path, monkeypatch):
    """The pipeline's form is read where the pipeline runs, whose work dir is not the node's."""
    from dflash_core.nodes import Node
    from dflash_core.stage_results import ProvisionedNode
    from flows.node_stages import on_node
    from flows.train import TrainFlowParams

    monkeypatch.setenv("DFLASH_WORK_DIR", str(tmp_path / "controller"))
    node = ProvisionedNode(node=Node(name="gpu", backend="local", work_dir="/tmp/dflash-node").model_dump(mode="json"),
                           work_dir="/tmp/dflash-node", venv="/tmp/dflash-node/venv", work_queue="node-gpu")
    form = TrainFlowParams.model_validate({"config": {"target": "tiny:llama"}})
    assert on_node("training", form, node).config.output_dir == Path("/tmp/dflash-node/runs")
    told = TrainFlowParams.model_validate({"config": {"target": "tiny:llama", "output_dir": "/scratch/runs"}})
    assert on_node("training", told, node).config.output_dir == Path("/scratch/runs")
