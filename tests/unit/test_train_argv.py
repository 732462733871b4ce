"""The training command on one node and on many (torchrun rendezvous flags), from the library, the CLI
and the flow's parameters; the pair layout's per-rank GPUs; the replica checksum.

Run: `.venv/bin/python -m pytest tests/unit/test_train_argv.py -q`
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dflash_core.train.config import TrainConfig
from dflash_core.train.devices import Distributed, TrainDevices, resolve_devices
from dflash_core.train.entry import Rendezvous, refuse_flex_off_gpu, training_argv, weights_checksum

ENTRY = ["-m", "dflash_core.train.entry", "--config", "run.yaml"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_one_process_runs_the_entry_directly() -> None:
    assert training_argv(Path("run.yaml"), nproc_per_node=1, resume=False) == [sys.executable, *ENTRY]
    assert training_argv(Path("run.yaml"), nproc_per_node=1, resume=True, extra=["--set=seed=1"]) == \
        [sys.executable, *ENTRY, "--set=seed=1", "--resume"]


def test_one_node_several_processes_is_standalone() -> None:
    assert training_argv(Path("run.yaml"), nproc_per_node=8, resume=True) == \
        [*TORCHRUN, "--standalone", "--nproc-per-node", "8", *ENTRY, "--resume"]


def test_c10d_rendezvous_is_the_same_command_on_every_node() -> None:
    rendezvous = Rendezvous(nnodes=4, endpoint="node0.cluster:29400", job_id="drafter-7")
    assert training_argv(Path("run.yaml"), nproc_per_node=8, resume=False, rendezvous=rendezvous) == \
        [*TORCHRUN, "--nnodes", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0.cluster:29400",
         "--rdzv-id", "drafter-7", "--nproc-per-node", "8", *ENTRY]


def test_static_rendezvous_names_the_node_rank_and_master() -> None:
    rendezvous = Rendezvous(nnodes=2, backend="static", endpoint="10.0.0.5:29500", node_rank=1)
    argv = training_argv(Path("run.yaml"), nproc_per_node=1, resume=False, rendezvous=rendezvous)
    assert argv == [*TORCHRUN, "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5",
                    "--master-port", "29500", "--nproc-per-node", "1", *ENTRY]
    assert "--standalone" not in argv


@pytest.mark.parametrize(("settings", "message"), [
    ({"nnodes": 2}, "endpoint"),
    ({"nnodes": 2, "endpoint": "host:29400"}, "job_id"),
    ({"nnodes": 2, "endpoint": "host:29500", "backend": "static"}, "node_rank"),
    ({"nnodes": 2, "endpoint": "host:29500", "backend": "static", "node_rank": 2}, "outside nnodes"),
    ({"nnodes": 2, "endpoint": "host-without-port", "job_id": "j"}, "pattern"),
])
def test_incomplete_rendezvous_is_refused(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        Rendezvous(**settings)


def test_cli_passes_the_rendezvous_to_torchrun(tmp_path, monkeypatch) -> None:
    from dflash_core import cli
    from dflash_core.train import supervise

    config = tmp_path / "run.yaml"
    config.write_text("target: tiny:llama\ndata: [shard.arrow]\nplacement: pair\n")
    launched = []
    monkeypatch.setattr(supervise, "run_tied", lambda argv: launched.append(argv) or 0)
    result = CliRunner().invoke(cli.app, ["train", "--config", str(config), "--nproc-per-node", "4", "--nnodes", "2",
                                          "--rdzv-endpoint", "head:29400", "--rdzv-id", "job1", "--pair-overlap",
                                          "--set", "optim.lr=1e-4"])
    assert result.exit_code == 0, result.output
    assert launched == [[*TORCHRUN, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400",
                         "--rdzv-id", "job1", "--nproc-per-node", "4", "-m", "dflash_core.train.entry", "--config",
                         str(config), "--set=optim.lr=1e-4", "--set=pair_overlap=true", "--resume"]]
    refused = CliRunner().invoke(cli.app, ["train", "--config", str(config), "--nnodes", "2"])
    assert refused.exit_code == 2 and "endpoint" in refused.output and len(launched) == 1


def test_flow_parameters_carry_the_rendezvous() -> None:
    from flows.train import TrainFlowParams

    params = TrainFlowParams.model_validate({
        "config": {"target": "tiny:llama", "data": ["shard.arrow"]}, "nproc_per_node": 8,
        "rendezvous": {"nnodes": 2, "endpoint": "head:29400", "job_id": "job1"}})
    argv = training_argv(Path("run.yaml"), nproc_per_node=params.nproc_per_node, resume=True,
                         rendezvous=params.rendezvous)
    assert argv[3:11] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400",
                          "--rdzv-id", "job1"]
    assert TrainFlowParams(config=params.config).rendezvous.torchrun_args() == ["--standalone"]


def test_pair_layout_gives_each_local_rank_its_own_gpu_pair(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    config = TrainConfig(target="tiny:llama", data=["shard.arrow"], placement="pair")
    devices = resolve_devices(config, Distributed(rank=3, world_size=4, local_rank=1))
    assert devices == TrainDevices(torch.device("cuda:2"), torch.device("cuda:3"))
    with pytest.raises(ValueError, match="local rank 2 needs cuda:4 and cuda:5"):
        resolve_devices(config, Distributed(rank=2, world_size=4, local_rank=2))
    colocated = TrainConfig(target="tiny:llama", data=["shard.arrow"])
    assert resolve_devices(colocated, Distributed(local_rank=1)) == TrainDevices(torch.device("cuda:1"),
                                                                                 torch.device("cuda:1"))
    explicit = TrainConfig(target="tiny:llama", data=["shard.arrow"], target_device="cuda", placement="pair",
                           drafter_device="cuda:3")
    assert resolve_devices(explicit, Distributed(local_rank=2)) == TrainDevices(torch.device("cuda:2"),
                                                                                torch.device("cuda:3"))


def test_weights_checksum_sees_one_bit() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    assert weights_checksum(a) == weights_checksum(b)
    with torch.no_grad():
        b.weight[2, 3] = torch.nextafter(b.weight[2, 3], torch.tensor(1.0))
    assert weights_checksum(a) != weights_checksum(b)


def test_only_the_node_of_global_rank_0_reports_a_checkpoint(tmp_path, monkeypatch) -> None:
    import logging

    import tasks.train as train_tasks

    config = TrainConfig(target="tiny:llama", data=["shard.arrow"], output_dir=tmp_path)
    (config.run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    for name in ("model.safetensors", "train_state.pt", "meta.json"):
        (config.run_dir / "checkpoints" / "step-000001" / name).write_text("x")
    monkeypatch.setattr(train_tasks, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(train_tasks, "create_progress_artifact", lambda **kwargs: None)
    launched = []

    def fake_argv(path, **kwargs):  # a node's torchrun output: rank 0 prints the final JSON line
        launched.append(kwargs["rendezvous"])
        final = '{"final_step": 1}' if kwargs["rendezvous"].node_rank == 0 else ""
        return [sys.executable, "-c", f"print('step 1/1'); print({final!r})"]

    monkeypatch.setattr(train_tasks, "training_argv", fake_argv)
    monkeypatch.setattr(train_tasks, "update_progress_artifact", lambda *args, **kwargs: None)
    nodes = [Rendezvous(nnodes=2, backend="static", endpoint="head:29500", node_rank=rank) for rank in (0, 1)]
    results = [train_tasks.run_training.fn(config, nproc_per_node=8, flow_run_id=None, rendezvous=node)
               for node in nodes]
    assert results == [str(config.run_dir / "checkpoints" / "step-000001"), None]
    assert launched == nodes
    assert train_tasks.run_training.fn(config, nproc_per_node=1, flow_run_id=None) is not None  # one node


def test_flex_attention_off_a_gpu_is_refused_by_name_before_the_target_loads() -> None:
    cpu = TrainDevices(torch.device("cpu"), torch.device("cpu"))
    config = TrainConfig(target="embedded", data=["x"], attention_backend="flex")
    with pytest.raises(SystemExit, match=r"^error: attention_backend: flex trains on a CUDA GPU only .* set "
                                         r"attention_backend: auto"):
        refuse_flex_off_gpu(config, cpu)
    for backend in ("auto", "sdpa"):  # auto takes the dense path off a GPU
        refuse_flex_off_gpu(config.model_copy(update={"attention_backend": backend}), cpu)
