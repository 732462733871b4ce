"""What a node has: mounts and their filesystem types, GPUs, disks, CPU and memory.

Parsers of command output (pure, tested on captured text) and one function per question that runs
the command through a `NodeAccess`.
"""

from __future__ import annotations

import re
import shlex
from posixpath import normpath

from pydantic import BaseModel

from dflash_core.nodes.access import NodeAccess

# Mount types whose reads cross a network: a venv or a model there is what hung imports for minutes.
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph", "cephfs", "afs",
    "9p", "wekafs", "panfs", "ocfs2", "gfs2", "davfs", "sshfs", "orangefs", "quobyte",
})
# FUSE mounts are network filesystems (sshfs, s3fs, gcsfuse, juicefs, ...) except these local ones.
LOCAL_FUSE_TYPES = frozenset({"fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.portal", "fuse.gvfsd-fuse"})


class Mount(BaseModel):
    device: str
    mount_point: str
    fs_type: str

    @property
    def is_network(self) -> bool:
        return is_network_fs(self.fs_type)


class Gpu(BaseModel):
    index: int
    name: str
    memory_mib: int
    driver: str


class GpuReport(BaseModel):
    gpus: list[Gpu] = []
    cuda_version: str | None = None
    note: str = ""


class Disk(BaseModel):
    path: str
    filesystem: str
    fs_type: str
    mount_point: str
    total_bytes: int
    free_bytes: int


def is_network_fs(fs_type: str) -> bool:
    fs_type = fs_type.lower()
    if fs_type in NETWORK_FS_TYPES:
        return True
    return (fs_type == "fuse" or fs_type.startswith("fuse.")) and fs_type not in LOCAL_FUSE_TYPES


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    """/proc/mounts lines: device, mount point (octal-escaped), type, options, dump, pass."""
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            mounts.append(Mount(device=_unescape(parts[0]), mount_point=_unescape(parts[1]), fs_type=parts[2]))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount:
    """The mount that holds absolute `path`: the longest mount point that is a prefix of it (the last one
    mounted wins when two share a point, as the kernel shows the top of the stack)."""
    path = normpath(path)
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point.rstrip("/") or "/"
        if path == point or path.startswith(point if point == "/" else point + "/"):
            if best is None or len(point) >= len(best.mount_point.rstrip("/") or "/"):
                best = mount
    if best is None:
        raise ValueError(f"no mount in /proc/mounts holds {path}")
    return best


def parse_gpu_query(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise ValueError(f"unexpected nvidia-smi line {line!r} (want index, name, memory.total, driver)")
        gpus.append(Gpu(index=int(fields[0]), name=fields[1], memory_mib=int(float(fields[2])), driver=fields[3]))
    return gpus


def parse_cuda_version(text: str) -> str | None:
    """The `CUDA Version: 12.8` of plain `nvidia-smi` output (what the driver supports)."""
    match = re.search(r"CUDA Version:\s*([0-9.]+)", text)
    return match.group(1) if match else None


def parse_df(text: str, paths: list[str]) -> list[Disk]:
    """`df -PkT PATH...` output (header, then one line per path, in order)."""
    lines = [line.split() for line in text.strip().splitlines()[1:]]
    disks = []
    for path, parts in zip(paths, lines, strict=False):
        if len(parts) < 7:
            raise ValueError(f"unexpected df line {' '.join(parts)!r}")
        disks.append(Disk(path=path, filesystem=parts[0], fs_type=parts[1], total_bytes=int(parts[2]) * 1024,
                          free_bytes=int(parts[4]) * 1024, mount_point=" ".join(parts[6:])))
    return disks


def parse_meminfo_total(text: str) -> int | None:
    match = re.search(r"^MemTotal:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def parse_cpu_model(text: str) -> str | None:
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


# ---- questions asked of a node ---------------------------------------------------------------


def mounts(access: NodeAccess) -> list[Mount]:
    return parse_mounts(access.read_text("/proc/mounts"))


def resolve(access: NodeAccess, path: str) -> str:
    """The canonical absolute path on the node (symlinks followed; the path need not exist yet)."""
    return access.run(["realpath", "-m", access.path(path)], timeout_s=30).stdout.strip()


def filesystem_of(access: NodeAccess, path: str) -> Mount:
    return mount_of(resolve(access, path), mounts(access))


def gpus(access: NodeAccess) -> GpuReport:
    query = access.run("nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits",
                       check=False, timeout_s=60)
    if query.returncode == 127 or "not found" in query.stderr:
        return GpuReport(note="nvidia-smi not found: no NVIDIA driver on this node")
    if query.returncode != 0:
        return GpuReport(note=f"nvidia-smi failed ({query.returncode}): {query.stderr.strip()[-300:]}")
    header = access.run("nvidia-smi", check=False, timeout_s=60).stdout
    return GpuReport(gpus=parse_gpu_query(query.stdout), cuda_version=parse_cuda_version(header))


def disks(access: NodeAccess, paths: list[str]) -> list[Disk]:
    """Free and total space of the filesystems holding `paths` (each must exist)."""
    resolved = [access.path(p) for p in paths]
    text = access.run("df -PkT " + " ".join(shlex.quote(p) for p in resolved), timeout_s=60).stdout
    return parse_df(text, resolved)
