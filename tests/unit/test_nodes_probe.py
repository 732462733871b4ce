"""Node probes on captured command output, and the node inventory's validation.

Run: `.venv/bin/python -m pytest tests/unit/test_nodes_probe.py -q`
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_core.nodes import load_inventory
from dflash_core.nodes.probe import (
    is_network_fs, mount_of, parse_cuda_version, parse_df, parse_gpu_query, parse_meminfo_total, parse_mounts,
)

MOUNTS = """\
overlay / overlay rw,relatime 0 0
/dev/nvme0n1p1 /data ext4 rw 0 0
fileserver:/export/home /home nfs4 rw,vers=4.2 0 0
fileserver:/export/home/shared /home/shared/local\\040disk xfs rw 0 0
sshfs#me@host: /mnt/remote fuse.sshfs rw 0 0
fuse-overlayfs /var/lib/containers fuse.fuse-overlayfs rw 0 0
mgs@tcp:/lustre /lustre lustre rw 0 0
tmpfs /dev/shm tmpfs rw 0 0
"""


@pytest.mark.parametrize(("path", "mount_point", "network"), [
    ("/home/alice/.venv", "/home", True),
    ("/home", "/home", True),
    ("/homework/venv", "/", False),  # a prefix of the name is not a parent directory
    ("/home/shared/local disk/venv", "/home/shared/local disk", False),  # \040 unescaped; deepest mount wins
    ("/mnt/remote/x", "/mnt/remote", True),
    ("/var/lib/containers/venv", "/var/lib/containers", False),
    ("/lustre/models/qwen", "/lustre", True),
    ("/data/venv/../venv", "/data", False),
    ("/dev/shm/dflash-models", "/dev/shm", False),
])
def test_the_mount_holding_a_path_and_whether_it_is_remote(path: str, mount_point: str, network: bool) -> None:
    mount = mount_of(path, parse_mounts(MOUNTS))
    assert (mount.mount_point, mount.is_network) == (mount_point, network)


def test_network_types_and_relative_paths() -> None:
    assert all(is_network_fs(t) for t in ("nfs", "cifs", "fuse.s3fs", "fuse.juicefs", "beegfs", "fuse"))
    assert not any(is_network_fs(t) for t in ("ext4", "xfs", "overlay", "tmpfs", "btrfs", "fuse.lxcfs"))
    with pytest.raises(ValueError, match="not an absolute path"):
        mount_of("venv", parse_mounts(MOUNTS))


def test_gpu_disk_and_memory_parsers() -> None:
    gpus = parse_gpu_query("0, NVIDIA H200, 143771, 570.124.06\n1, NVIDIA H200, 143771, 570.124.06\n")
    assert [(g.index, g.name, g.memory_mib, g.driver) for g in gpus] == [(0, "NVIDIA H200", 143771, "570.124.06"),
                                                                      (1, "NVIDIA H200", 143771, "570.124.06")]
    assert parse_cuda_version("| NVIDIA-SMI 570.124.06   Driver Version: 570.124.06   CUDA Version: 12.8  |") == "12.8"
    assert parse_cuda_version("no header") is None
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_gpu_query("0, H200\n")
    df = ("Filesystem     Type  1024-blocks      Used Available Capacity Mounted on\n"
          "/dev/vda       ext4    264212084  30000000  76000000      28% /\n"
          "tmpfs          tmpfs    24684092        32  24684060       1% /dev/shm\n")
    disks = parse_df(df, ["/opt/x", "/dev/shm"])
    assert [(d.path, d.fs_type, d.mount_point) for d in disks] == [("/opt/x", "ext4", "/"), ("/dev/shm", "tmpfs", "/dev/shm")]
    assert disks[1].free_bytes == 24684060 * 1024
    assert parse_meminfo_total("MemTotal:       131072000 kB\nMemFree: 1 kB\n") == 131072000 * 1024


def test_inventory_loads_nodes_and_refuses_passwords_and_bad_entries(tmp_path: Path) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text("nodes:\n  gpu-1: {host: 10.0.0.5, user: ubuntu, key_path: ~/.ssh/id, gpus: 8}\n"
                    "  here: {backend: local, work_dir: /tmp/n}\n")
    nodes = load_inventory(path)
    assert nodes["gpu-1"].host == "10.0.0.5" and nodes["gpu-1"].gpus == 8 and nodes["here"].backend == "local"
    path.write_text("nodes:\n  gpu-1: {host: h, password: hunter2}\n")
    with pytest.raises(ValueError, match=r"node 'gpu-1'.*passwords are never read from config") as error:
        load_inventory(path)
    assert "hunter2" not in str(error.value)
    path.write_text("nodes:\n  gpu-2: {user: u}\n")
    with pytest.raises(ValueError, match="node 'gpu-2'.*backend ssh needs a host"):
        load_inventory(path)
    path.write_text("nodes:\n  gpu-3: {host: h, prot: 22}\n")
    with pytest.raises(ValueError, match=r"gpu-3.*prot: Extra inputs are not permitted"):
        load_inventory(path)
    path.write_text("- just a list\n")
    with pytest.raises(ValueError, match="top-level `nodes:` mapping"):
        load_inventory(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_inventory(tmp_path / "missing.yaml")


def test_node_cli_names_what_is_missing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dflash_core import cli

    runner = CliRunner()
    neither = runner.invoke(cli.app, ["node", "provision"], env={"COLUMNS": "200"})
    assert neither.exit_code == 2 and "--local (this machine) or --node NAME" in neither.output
    missing = runner.invoke(cli.app, ["node", "provision", "--node", "gpu-1", "--inventory", str(tmp_path / "n.yaml")],
                            env={"COLUMNS": "200"})
    assert missing.exit_code == 2 and "does not exist" in missing.output
    (tmp_path / "n.yaml").write_text("nodes:\n  gpu-2: {host: h}\n")
    unknown = runner.invoke(cli.app, ["node", "preserve", "--node", "gpu-1", "--inventory", str(tmp_path / "n.yaml")],
                            env={"COLUMNS": "200"})
    assert unknown.exit_code == 2 and "node 'gpu-1' is not in" in unknown.output and "gpu-2" in unknown.output


def test_gpu_extra_is_read_pinned_from_pyproject() -> None:
    from dflash_core.nodes.provision import gpu_extra_requirements

    requirements = gpu_extra_requirements()
    assert requirements and all("==" in r for r in requirements)
    assert any(r.startswith("flash-linear-attention==") for r in requirements)
