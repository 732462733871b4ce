"""What provision found and did on a node (the node record) and a node's system inventory."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, Field

from dflash_core.nodes.probe import Disk, GpuReport


class VenvState(BaseModel):
    path: str
    fs_type: str
    mount_point: str
    python: str = ""
    system_site_packages: bool = False
    packages: list[str] = Field(default_factory=list, description="Requested requirement specs.")
    find_links: list[str] = Field(default_factory=list)
    install_stamp: str | None = None
    freeze: list[str] = Field(default_factory=list, description="`pip freeze` of the venv after provisioning.")


class ModelPlacement(BaseModel):
    source: str
    source_fs_type: str
    source_is_network: bool
    bytes: int
    num_files: int
    read_mb_s: float
    read_sample_bytes: int
    placed_at: str = Field(description="Where servers should load the model from.")
    on_ram_disk: bool
    reason: str


class NodeRecord(BaseModel):
    node: str
    hostname: str
    provisioned_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    work_dir: str
    venv: VenvState
    gpus: GpuReport
    disks: list[Disk]
    model: ModelPlacement | None = None
    actions: list[str] = Field(default_factory=list, description="What this run changed (empty: a no-op rerun).")
    seconds: float = 0.0


class SystemInventory(BaseModel):
    node: str
    hostname: str
    kernel: str
    cpu_model: str | None
    num_cpus: int | None
    mem_total_bytes: int | None
    gpus: GpuReport
    disks: list[Disk]
    python: str
    pip_freeze: list[str]
    captured_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
