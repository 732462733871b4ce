"""Preserve a node before it is shut down: stop our servers, save what is worth keeping, say where.

1. Stop the processes recorded under `<work_dir>/pids/` (only ours: PID and start time must match).
2. Archive scripts, logs, configs and the records (node record, PID records), one tar.gz each.
3. Capture a system inventory (GPUs, CUDA, CPU, RAM, disks, `pip freeze`).
4. Upload all of it with manifests under `node-backups/<node>/<timestamp>/`, and a markdown note of
   what was saved and where (its inputs are the other uploads, so lineage ties them together).

Nothing on the node is deleted; the only file removed is the temporary archive this module wrote.
"""

from __future__ import annotations

import shlex
import tarfile
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.nodes import probe
from dflash_core.nodes.access import NodeAccess
from dflash_core.nodes.node import Node
from dflash_core.nodes.provision import RECORD_NAME
from dflash_core.nodes.record import SystemInventory
from dflash_core.strict import StrictModel
from dflash_core.units import binary_bytes

if TYPE_CHECKING:  # the S3 side is imported in preserve(): the rest runs on a node image without boto3
    from dflash_core.lineage import Manifest
    from dflash_core.provenance import Producer
    from dflash_core.storage import ObjectStore

PROCESS_DIR = "pids"  # under the node's work_dir: records of processes started with NodeAccess.start_detached


class PreserveConfig(StrictModel):
    scripts: list[str] = Field(default_factory=lambda: ["scripts"], description="Paths (relative to work_dir, or "
                                                                                "absolute) of scripts to save.")
    logs: list[str] = Field(default_factory=lambda: ["logs"], description="Log files or dirs to save.")
    configs: list[str] = Field(default_factory=lambda: ["configs"], description="Config files or dirs to save.")
    stop_servers: bool = Field(True, description="Stop the processes recorded under `<work_dir>/pids` first.")
    stop_timeout_s: float = Field(30.0, gt=0, description="SIGTERM grace before SIGKILL, per process.")
    archive_timeout_s: float = Field(1800.0, gt=0)


class StoppedProcess(BaseModel):
    name: str
    pid: int
    outcome: str


class SavedItem(BaseModel):
    name: str
    uri: str
    bytes: int
    sha256: str
    num_files: int
    sources: list[str]


class PreserveResult(BaseModel):
    node: str
    timestamp: str
    prefix_uri: str
    stopped: list[StoppedProcess]
    saved: list[SavedItem]
    missing: list[str] = Field(description="Configured paths that did not exist on the node.")
    note_uri: str
    note_markdown: str


def backup_timestamp(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")


def capture_inventory(access: NodeAccess, node: Node) -> SystemInventory:
    work_dir = probe.resolve(access, node.work_dir)
    venv_python = f"{work_dir}/venv/bin/python"
    python = venv_python if access.exists(venv_python) else "python3"
    freeze = access.run([python, "-m", "pip", "freeze", "--disable-pip-version-check"], check=False, timeout_s=120)
    nproc = access.run("nproc", check=False, timeout_s=30).stdout.strip()
    disk_paths = [p for p in (work_dir, "/", "/dev/shm", "/tmp") if access.exists(p)]
    return SystemInventory(
        node=node.name, hostname=access.run("hostname", timeout_s=30).stdout.strip(),
        kernel=access.run("uname -srvm", timeout_s=30).stdout.strip(),
        cpu_model=probe.parse_cpu_model(access.run("cat /proc/cpuinfo", check=False, timeout_s=30).stdout),
        num_cpus=int(nproc) if nproc.isdigit() else None,
        mem_total_bytes=probe.parse_meminfo_total(access.run("cat /proc/meminfo", check=False, timeout_s=30).stdout),
        gpus=probe.gpus(access), disks=probe.disks(access, disk_paths),
        python=access.run([python, "-c", "import sys; print(sys.version)"], check=False, timeout_s=60).stdout.strip(),
        pip_freeze=freeze.stdout.split() if freeze.returncode == 0 else [f"(pip freeze failed: {freeze.stderr[-300:]})"],
    )


def stop_our_processes(access: NodeAccess, work_dir: str, *, timeout_s: float) -> list[StoppedProcess]:
    return [StoppedProcess(name=r.name, pid=r.pid, outcome=access.stop_detached(r, timeout_s=timeout_s))
            for r in access.recorded_processes(f"{work_dir}/{PROCESS_DIR}")]


def preserve(access: NodeAccess, node: Node, store: ObjectStore, prefixes: dict[ArtifactKind, str],
             config: PreserveConfig, *, producer: Producer | None = None, timestamp: str | None = None) -> PreserveResult:
    from dflash_core.lineage import InputRef, write_artifact

    timestamp = timestamp or backup_timestamp()
    work_dir = probe.resolve(access, node.work_dir)
    stopped = stop_our_processes(access, work_dir, timeout_s=config.stop_timeout_s) if config.stop_servers else []
    inventory = capture_inventory(access, node)

    def key(name: str) -> str:
        return artifact_key(prefixes, ArtifactKind.NODE_BACKUP, node.name, timestamp, name)

    saved: list[SavedItem] = []
    manifests: list[Manifest] = []
    missing: list[str] = []
    categories = {"scripts": config.scripts, "logs": config.logs, "configs": config.configs,
                  "records": [RECORD_NAME, PROCESS_DIR]}
    with tempfile.TemporaryDirectory(prefix="dflash-preserve-") as tmp:
        for category, paths in categories.items():
            present = [p for p in paths if access.exists(_on_node(work_dir, p))]
            missing += [_on_node(work_dir, p) for p in paths if p not in present and category != "records"]
            if not present:
                continue
            local = Path(tmp) / f"{category}.tar.gz"
            _fetch_archive(access, work_dir, present, local, timeout_s=config.archive_timeout_s)
            with tarfile.open(local) as archive:
                num_files = sum(1 for member in archive.getmembers() if member.isfile())
            sources = [_on_node(work_dir, p) for p in present]
            manifest = write_artifact(store, key(f"{category}.tar.gz"), local, kind=ArtifactKind.NODE_BACKUP,
                                      config={"node": node.name, "category": category, "sources": sources,
                                              "num_files": num_files}, producer=producer)
            manifests.append(manifest)
            saved.append(SavedItem(name=f"{category}.tar.gz", uri=manifest.uri, bytes=manifest.bytes,
                                   sha256=manifest.sha256, num_files=num_files, sources=sources))
    for name, payload in (("inventory.json", inventory.model_dump_json(indent=2).encode()),
                          ("pip-freeze.txt", ("\n".join(inventory.pip_freeze) + "\n").encode())):
        manifest = write_artifact(store, key(name), payload, kind=ArtifactKind.NODE_BACKUP,
                                  config={"node": node.name, "category": "inventory"}, producer=producer)
        manifests.append(manifest)
        saved.append(SavedItem(name=name, uri=manifest.uri, bytes=manifest.bytes, sha256=manifest.sha256,
                               num_files=1, sources=[f"captured from {inventory.hostname}"]))
    prefix_uri = store.uri(artifact_key(prefixes, ArtifactKind.NODE_BACKUP, node.name, timestamp)) + "/"
    note = preserve_note(node, timestamp, prefix_uri, inventory, stopped, saved, missing)
    note_manifest = write_artifact(store, key("NOTE.md"), note.encode(), kind=ArtifactKind.NODE_BACKUP,
                                   inputs=[InputRef(uri=m.uri, sha256=m.sha256) for m in manifests],
                                   config={"node": node.name, "category": "note"}, producer=producer)
    return PreserveResult(node=node.name, timestamp=timestamp, prefix_uri=prefix_uri, stopped=stopped, saved=saved,
                          missing=missing, note_uri=note_manifest.uri, note_markdown=note)


def preserve_note(node: Node, timestamp: str, prefix_uri: str, inventory: SystemInventory,
                  stopped: list[StoppedProcess], saved: list[SavedItem], missing: list[str]) -> str:
    gpus = ", ".join(f"{g.name} ({g.memory_mib:,} MiB)" for g in inventory.gpus.gpus) or \
        (inventory.gpus.note or "none")
    lines = [
        f"# Node backup: {node.name} at {timestamp}",
        "",
        f"Everything below is in `{prefix_uri}`, each object with a `.manifest.json` beside it. "
        "Nothing was deleted on the node.",
        "",
        f"- host: {inventory.hostname} ({inventory.kernel})",
        f"- CPU: {inventory.cpu_model or '?'} x {inventory.num_cpus or '?'}; RAM "
        f"{binary_bytes(inventory.mem_total_bytes) if inventory.mem_total_bytes else '?'}",
        f"- GPUs: {gpus}; CUDA (driver) {inventory.gpus.cuda_version or '-'}",
        "- disks: " + "; ".join(f"{d.mount_point} {d.fs_type} {binary_bytes(d.free_bytes)} free of "
                                 f"{binary_bytes(d.total_bytes)}" for d in inventory.disks),
        "",
        "## Saved",
        "",
        "| object | bytes | files | from |",
        "|---|---:|---:|---|",
        *[f"| `{s.uri}` | {s.bytes:,} | {s.num_files} | {', '.join(s.sources)} |" for s in saved],
        "",
        "## Servers stopped",
        "",
        *([f"- {p.name} (pid {p.pid}): {p.outcome}" for p in stopped] or ["- none recorded"]),
    ]
    if missing:
        lines += ["", "## Not found on the node (nothing saved for these)", "", *[f"- `{m}`" for m in missing]]
    return "\n".join(lines) + "\n"


def _on_node(work_dir: str, path: str) -> str:
    return path if path.startswith("/") else f"{work_dir}/{path}"


def _fetch_archive(access: NodeAccess, work_dir: str, paths: list[str], local: Path, *, timeout_s: float) -> None:
    members = " ".join(f"-C / {shlex.quote(p.lstrip('/'))}" if p.startswith("/") else
                       f"-C {shlex.quote(work_dir)} {shlex.quote(p)}" for p in paths)
    remote = access.run("mktemp -t dflash-preserve.XXXXXX", timeout_s=30).stdout.strip()
    try:
        access.run(f"tar czf {shlex.quote(remote)} {members}", timeout_s=timeout_s)
        access.get(remote, local)
    finally:
        access.run(["rm", "-f", remote], check=False, timeout_s=30)
