"""Provision a node, idempotently: a rerun with the same config changes nothing.

1. The venv goes on local disk: a venv on a network filesystem (nfs, cifs, fuse.*, lustre, ...) is
   refused, because imports from one hung for minutes in the field.
2. The venv gets the requested packages (optionally only from a wheelhouse, `--find-links` +
   `--no-index`, for nodes without internet); a stamp of what was asked skips a repeat install.
3. GPUs (nvidia-smi: model, memory, driver, CUDA) and disks are checked.
4. The target model is copied to a RAM disk when its home reads slowly (measured with the page cache
   dropped for the sampled files) and it fits there, leaving a reserve.
5. A node record says what is where, with the measured speeds.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
import tomllib
from pathlib import Path
from posixpath import basename

from typing import TYPE_CHECKING

from pydantic import Field

from dflash_core.nodes import probe
from dflash_core.nodes.access import NodeAccess, NodeError
from dflash_core.nodes.node import Node
from dflash_core.nodes.record import ModelPlacement, NodeRecord, VenvState
from dflash_core.strict import StrictModel

if TYPE_CHECKING:  # S3 only for upload_node_record: provision itself runs on a bare GPU image without boto3
    from dflash_core.layout import ArtifactKind
    from dflash_core.lineage import Manifest
    from dflash_core.provenance import Producer
    from dflash_core.storage import ObjectStore

INSTALL_STAMP = ".dflash-provisioned"
RECORD_NAME = "node-record.json"

_READ_PROBE = r"""
import os, sys, time
root, budget = sys.argv[1], int(sys.argv[2])
files = []
for d, _, names in os.walk(root):
    for n in names:
        p = os.path.join(d, n)
        if os.path.isfile(p) and not os.path.islink(p):
            files.append((os.path.getsize(p), p))
done, start = 0, time.perf_counter()
for _, path in sorted(files, reverse=True):
    if done >= budget:
        break
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            os.fdatasync(fd)  # dirty pages (a file just written) cannot be dropped from the cache
        except OSError:
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # measure the storage, not the page cache
        while done < budget:
            chunk = os.read(fd, 8 << 20)
            if not chunk:
                break
            done += len(chunk)
    finally:
        os.close(fd)
print(done, time.perf_counter() - start)
"""


class ProvisionError(NodeError):
    """The node cannot be provisioned as asked (a clear error: retrying will not help)."""


class ProvisionConfig(StrictModel):
    venv_dir: str | None = Field(None, description="Venv path on the node; default `<work_dir>/venv`. Never on a "
                                                   "network filesystem.")
    python: str = Field("python3", description="Interpreter on the node that creates the venv.")
    system_site_packages: bool = Field(False, description="Let the venv see the image's packages (e.g. its CUDA "
                                                          "torch).")
    packages: list[str] = Field(default_factory=list, description="pip requirement specs to install; empty (and "
                                                                  "no gpu_extra): venv only.")
    gpu_extra: bool = Field(False, description="Also install the project's `gpu` extra, as pinned in pyproject.toml.")
    requirements: list[str] = Field(default_factory=list, description=(
        "Requirement files on the node (pip -r), e.g. the offline wheelhouse's requirements.txt."))
    editable: list[str] = Field(default_factory=list, description=(
        "Project checkouts on the node installed editable (pip -e; without build isolation when no_index: the "
        "image's setuptools builds it), so the venv runs the checkout's code as it changes."))
    find_links: list[str] = Field(default_factory=list, description="Wheelhouse dirs on the node (pip --find-links).")
    no_index: bool = Field(False, description="Install only from find_links (a node without internet).")
    no_deps: bool = Field(False, description="pip --no-deps (the wheelhouse holds exactly what is needed).")
    install_timeout_s: float = Field(1800.0, gt=0)
    model_dir: str | None = Field(None, description="The target model's directory on the node.")
    ram_disk: str = Field("/dev/shm", description="RAM disk the model is copied to when its home is slow.")
    ram_disk_below_mb_s: float = Field(1500.0, gt=0, description="Copy when the model's home reads slower "
                                                                 "than this (MB/s).")
    ram_disk_reserve: float = Field(0.25, ge=0, lt=1, description="Fraction of the RAM disk left free after "
                                                                  "the copy.")
    read_sample_mb: int = Field(512, ge=1, description="MB read to measure the model home's speed.")
    copy_timeout_s: float = Field(3600.0, gt=0)


def provision(access: NodeAccess, node: Node, config: ProvisionConfig) -> NodeRecord:
    start = time.monotonic()
    actions: list[str] = []
    work_dir = probe.resolve(access, node.work_dir)
    if not access.exists(work_dir):
        access.run(["mkdir", "-p", work_dir])
        actions.append(f"created work dir {work_dir}")
    gpus = probe.gpus(access)
    if node.gpus is not None and len(gpus.gpus) < node.gpus:
        raise ProvisionError(f"node {node.name} should have {node.gpus} GPU(s) but shows {len(gpus.gpus)}"
                             f"{': ' + gpus.note if gpus.note else ''}")
    venv = _ensure_venv(access, config, probe.resolve(access, config.venv_dir or f"{work_dir}/venv"), actions)
    model = _place_model(access, config, actions) if config.model_dir else None
    disk_paths = [work_dir, venv.path] + ([config.ram_disk] if access.exists(config.ram_disk) else [])
    disk_paths += [model.source] if model else []
    hostname = access.run("hostname", timeout_s=30).stdout.strip()
    return NodeRecord(node=node.name, hostname=hostname, work_dir=work_dir, venv=venv, gpus=gpus,
                      disks=probe.disks(access, disk_paths), model=model, actions=actions,
                      seconds=round(time.monotonic() - start, 2))


def write_node_record(access: NodeAccess, work_dir: str, record: NodeRecord) -> str:
    """Write the record to `<work_dir>/node-record.json` on the node; return that path."""
    path = f"{probe.resolve(access, work_dir)}/{RECORD_NAME}"
    access.write_text(path, record.model_dump_json(indent=2))
    return path


def upload_node_record(store: ObjectStore, prefixes: dict[ArtifactKind, str], record: NodeRecord, *,
                       producer: Producer | None = None) -> Manifest:
    """The record as an artifact with its manifest: node-backups/<node>/<time>/node-record.json."""
    from dflash_core.layout import ArtifactKind, artifact_key
    from dflash_core.lineage import write_artifact

    stamp = record.provisioned_at.strftime("%Y%m%dT%H%M%SZ")
    key = artifact_key(prefixes, ArtifactKind.NODE_BACKUP, record.node, stamp, RECORD_NAME)
    return write_artifact(store, key, record.model_dump_json(indent=2).encode(), kind=ArtifactKind.NODE_BACKUP,
                          config={"node": record.node, "category": "provision"}, producer=producer)


def gpu_extra_requirements() -> list[str]:
    """The pinned requirements of the project's `gpu` extra: from the checkout's pyproject.toml (a bare GPU
    image runs from a checkout), else from the installed package's metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        return list(tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["gpu"])
    from importlib import metadata

    return [r.split(";")[0].strip() for r in metadata.requires("dflash-pipeline") or [] if 'extra == "gpu"' in r]


def _ensure_venv(access: NodeAccess, config: ProvisionConfig, path: str, actions: list[str]) -> VenvState:
    mount = probe.mount_of(path, probe.mounts(access))
    if mount.is_network:
        raise ProvisionError(
            f"venv_dir {path} is on a network filesystem ({mount.fs_type} mounted at {mount.mount_point}): "
            "imports from a network mount hang for minutes. Choose a local disk path (e.g. /opt/dflash/venv "
            "or /tmp/dflash-venv)")
    python = f"{path}/bin/python"
    cfg = access.run(["cat", f"{path}/pyvenv.cfg"], check=False, timeout_s=30)
    wanted_site = "true" if config.system_site_packages else "false"
    has_site = f"include-system-site-packages = {wanted_site}" in cfg.stdout
    if cfg.returncode != 0 or not access.exists(python) or not has_site:
        argv = [config.python, "-m", "venv", *(["--system-site-packages"] if config.system_site_packages else []),
                *(["--clear"] if cfg.returncode == 0 else []), path]
        made = access.run(argv, timeout_s=600, check=False)
        if made.returncode != 0 and "ensurepip" in made.stdout + made.stderr:
            # Debian/Ubuntu images without python3-venv: a venv without pip, filled by the outer pip (--python).
            access.run([*argv[:-1], "--without-pip", "--clear", path], timeout_s=600)
        elif made.returncode != 0:
            access.run(argv, timeout_s=600)  # raises with the output
        actions.append(f"{'recreated' if cfg.returncode == 0 else 'created'} venv {path}")
    if config.system_site_packages:
        _see_the_creators_venv(access, config.python, python)
    version = access.run([python, "-c", "import sys; print(sys.version.split()[0])"], timeout_s=60).stdout.strip()
    has_pip = access.run([python, "-m", "pip", "--version"], check=False, timeout_s=60).returncode == 0
    pip = [python, "-m", "pip"] if has_pip else [config.python, "-m", "pip", "--python", python]
    packages = [*config.packages, *(gpu_extra_requirements() if config.gpu_extra else [])]
    packages += [*(f"-r {access.path(f)}" for f in config.requirements), *(f"-e {access.path(d)}" for d in config.editable)]
    state = VenvState(path=path, fs_type=mount.fs_type, mount_point=mount.mount_point, python=version,
                      system_site_packages=config.system_site_packages, packages=packages,
                      find_links=list(config.find_links))
    if packages:
        state.install_stamp = _install_stamp(access, config, packages)
        stamp_path = f"{path}/{INSTALL_STAMP}"
        current = access.run(["cat", stamp_path], check=False, timeout_s=30).stdout.strip()
        if current != state.install_stamp:
            common = [*pip, "install", "--disable-pip-version-check", "--no-input", "--quiet",
                      *(["--no-index"] if config.no_index else []), *(["--no-deps"] if config.no_deps else []),
                      *[arg for link in config.find_links for arg in ("--find-links", access.path(link))]]
            wanted = [arg for spec in packages if not spec.startswith("-e ")
                      for arg in (spec.split(" ", 1) if spec.startswith("-r ") else [spec])]
            if wanted:
                access.run([*common, *wanted], timeout_s=config.install_timeout_s)
            if config.editable:  # after the rest: its build may need a setuptools that the step above installs
                access.run([*common, *(["--no-build-isolation"] if config.no_index else []),
                            *[arg for d in config.editable for arg in ("-e", access.path(d))]],
                           timeout_s=config.install_timeout_s)
            access.write_text(stamp_path, state.install_stamp)
            actions.append(f"installed {' '.join(packages)} into {path}")
    state.freeze = access.run([*pip, "freeze", "--disable-pip-version-check"], timeout_s=120).stdout.split()
    return state


_SITE_OF = "import site, sys; print(sys.prefix != sys.base_prefix); print(*site.getsitepackages(), sep=chr(10))"
IMAGE_PTH = "_dflash_image_site.pth"


def _see_the_creators_venv(access: NodeAccess, creator: str, python: str) -> None:
    """--system-site-packages shows the base interpreter's packages; when the image's python3 is itself a venv's
    (GPU images install torch into one), point a .pth at that venv's site-packages too, after the new venv's own."""
    creator_lines = access.run([creator, "-c", _SITE_OF], timeout_s=60).stdout.split()
    if not creator_lines or creator_lines[0] != "True":
        return
    own = access.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     timeout_s=60).stdout.strip()
    access.write_text(f"{own}/{IMAGE_PTH}", "\n".join(creator_lines[1:]) + "\n")


def _install_stamp(access: NodeAccess, config: ProvisionConfig, packages: list[str]) -> str:
    """A hash of what was asked for, including the wheelhouse contents (a new wheel means a new install)."""
    wheelhouse = ""
    for link in config.find_links:
        wheelhouse += access.run(f"ls -l {shlex.quote(access.path(link))} 2>/dev/null || true", timeout_s=60).stdout
    asked = {"packages": packages, "find_links": config.find_links, "no_index": config.no_index,
             "no_deps": config.no_deps, "wheelhouse": wheelhouse}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def _file_listing(access: NodeAccess, path: str) -> str:
    return access.run(f"cd {shlex.quote(path)} && find . -type f -printf '%P\\t%s\\n' | LC_ALL=C sort",
                      timeout_s=300).stdout


def _place_model(access: NodeAccess, config: ProvisionConfig, actions: list[str]) -> ModelPlacement:
    source = probe.resolve(access, config.model_dir or "")
    if not access.exists(source):
        raise ProvisionError(f"model_dir {source} does not exist on {access.name}")
    listing = _file_listing(access, source)
    sizes = [int(line.rsplit("\t", 1)[1]) for line in listing.splitlines() if line]
    total = sum(sizes)
    mount = probe.mount_of(source, probe.mounts(access))
    read = access.run([config.python, "-c", _READ_PROBE, source, str(config.read_sample_mb * 2**20)],
                      timeout_s=900).stdout.split()
    sampled, seconds = int(read[0]), float(read[1])
    mb_s = round(sampled / 1e6 / max(seconds, 1e-9), 1)
    placement = dict(source=source, source_fs_type=mount.fs_type, source_is_network=mount.is_network, bytes=total,
                     num_files=len(sizes), read_mb_s=mb_s, read_sample_bytes=sampled)
    dest = f"{config.ram_disk.rstrip('/')}/dflash-models/{basename(source)}"
    if source == dest or source.startswith(config.ram_disk.rstrip("/") + "/"):
        return ModelPlacement(**placement, placed_at=source, on_ram_disk=True, reason="already on the RAM disk")
    if access.exists(dest) and _file_listing(access, dest) == listing:
        return ModelPlacement(**placement, placed_at=dest, on_ram_disk=True,
                              reason=f"copied earlier (same files and sizes at {dest})")
    slow = mb_s < config.ram_disk_below_mb_s or mount.is_network
    why_slow = (f"{mount.fs_type} network filesystem" if mount.is_network else "") or \
        f"reads at {mb_s:,.0f} MB/s < {config.ram_disk_below_mb_s:,.0f} MB/s"
    if not slow:
        return ModelPlacement(**placement, placed_at=source, on_ram_disk=False,
                              reason=f"home reads at {mb_s:,.0f} MB/s (>= {config.ram_disk_below_mb_s:,.0f}): stays")
    if not access.exists(config.ram_disk):
        return ModelPlacement(**placement, placed_at=source, on_ram_disk=False,
                              reason=f"home is slow ({why_slow}) but there is no RAM disk at {config.ram_disk}")
    ram = probe.disks(access, [config.ram_disk])[0]
    usable = ram.free_bytes - config.ram_disk_reserve * ram.total_bytes
    if total > usable:
        return ModelPlacement(**placement, placed_at=source, on_ram_disk=False,
                              reason=f"home is slow ({why_slow}) but {total:,} bytes do not fit the RAM disk "
                                     f"({ram.free_bytes:,} free, {config.ram_disk_reserve:.0%} kept in reserve)")
    partial = f"{dest}.partial"
    access.run(f"rm -rf {shlex.quote(partial)} {shlex.quote(dest)} && mkdir -p {shlex.quote(partial)} && "
               f"cp -a {shlex.quote(source)}/. {shlex.quote(partial)}/ && mv {shlex.quote(partial)} {shlex.quote(dest)}",
               timeout_s=config.copy_timeout_s)
    actions.append(f"copied model {source} -> {dest} ({total:,} bytes)")
    return ModelPlacement(**placement, placed_at=dest, on_ram_disk=True, reason=f"home is slow ({why_slow}); fits")
