"""The command that starts a training run (`training_argv`) and torchrun's multi-node settings (`Rendezvous`), apart
from dflash_core/train/entry.py so that the processes that only launch a run (the training flow, the pipeline, the
CLI) import no torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from dflash_core.strict import StrictModel


class Rendezvous(StrictModel):
    """torchrun's multi-node settings; one node needs none of them (`--standalone`). Every node runs
    the same command. With the c10d backend torchrun assigns node ranks at rendezvous (every node
    gets identical settings); with static each node names its own rank and node 0 is the master."""

    nnodes: int = Field(1, ge=1, description="Nodes in the job.")
    backend: Literal["c10d", "static"] = Field("c10d", description="c10d: ranks assigned at rendezvous; "
                                                "static: --node-rank and a master address.")
    endpoint: str | None = Field(None, pattern=r"^[^\s:]+:\d+$", description=(
        "host:port every node reaches: the c10d store (run on any one node, e.g. node 0, port 29400) "
        "or, for static, the master (node 0, e.g. port 29500)."))
    job_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$",
                               description="c10d: the same id on every node of one job.")
    node_rank: int | None = Field(None, ge=0, description="static: this node's rank, 0 on the master.")

    @model_validator(mode="after")
    def _complete(self) -> Rendezvous:
        if self.nnodes > 1 and self.endpoint is None:
            raise ValueError(f"nnodes={self.nnodes} needs a rendezvous endpoint (host:port) that every node reaches")
        if self.endpoint is not None and self.backend == "c10d" and self.job_id is None:
            raise ValueError("the c10d rendezvous needs a job_id, the same on every node")
        if self.endpoint is not None and self.backend == "static" and self.node_rank is None:
            raise ValueError("the static rendezvous needs node_rank (0 on the master node)")
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is outside nnodes {self.nnodes}")
        return self

    def torchrun_args(self) -> list[str]:
        if self.endpoint is None:
            return ["--standalone"]
        if self.backend == "c10d":
            return ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                    "--rdzv-id", self.job_id]
        host, port = self.endpoint.rsplit(":", 1)
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--master-addr", host,
                "--master-port", port]


def training_argv(config_path: Path, *, nproc_per_node: int, resume: bool, extra: list[str] = (),
                  rendezvous: Rendezvous | None = None) -> list[str]:
    """The command that runs a training run: this module directly (one process on one node), else
    under torchrun (`python -m torch.distributed.run`, the same program as the `torchrun` script)."""
    rendezvous = rendezvous or Rendezvous()
    entry = ["-m", "dflash_core.train.entry", "--config", str(config_path), *extra] + (["--resume"] if resume else [])
    if nproc_per_node == 1 and rendezvous.nnodes == 1 and rendezvous.endpoint is None:
        return [sys.executable, *entry]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous.torchrun_args(),
            "--nproc-per-node", str(nproc_per_node), *entry]
