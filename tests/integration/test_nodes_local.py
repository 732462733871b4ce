"""Provision and preserve on the local backend (this machine), preserve uploading to the real S3 server.

Run: `.venv/bin/python -m pytest tests/integration/test_nodes_local.py -q`
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import uuid
import zipfile
from pathlib import Path

import pytest

from typer.testing import CliRunner

from dflash_core import cli
from dflash_core.lineage import build_lineage, read_manifest, verify_artifact
from dflash_core.nodes import (
    PROCESS_DIR, PreserveConfig, ProvisionConfig, ProvisionError, local_node, preserve, provision, write_node_record,
)
from dflash_core.nodes.local import LocalAccess
from dflash_core.nodes.record import NodeRecord


def build_wheel(dest: Path, name: str = "dflash_probe_pkg", version: str = "0.1.0") -> Path:
    """A minimal pure-Python wheel, written directly (no build backend, no network)."""
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: dflash-test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join([*record, f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


@pytest.fixture
def ram_disk():
    path = Path(f"/dev/shm/dflash-test-{uuid.uuid4().hex[:8]}")
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow  # venvs and pip installs
def test_provision_twice_second_run_changes_nothing(tmp_path: Path, ram_disk: Path) -> None:
    build_wheel(tmp_path / "wheelhouse")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(os.urandom(2_000_000))
    node = local_node(tmp_path / "node")
    # Any measured speed is "slow" at this threshold: the model must go to the RAM disk.
    config = ProvisionConfig(packages=["dflash_probe_pkg==0.1.0"], find_links=[str(tmp_path / "wheelhouse")],
                             no_index=True, model_dir=str(model), ram_disk=str(ram_disk), ram_disk_below_mb_s=1e12,
                             read_sample_mb=1)
    with node.connect() as access:
        first = provision(access, node, config)
        node_state, ram_state = _tree_state(tmp_path / "node"), _tree_state(ram_disk)
        second = provision(access, node, config)
        unchanged = _tree_state(tmp_path / "node") == node_state and _tree_state(ram_disk) == ram_state
        record_path = write_node_record(access, node.work_dir, second)
    assert [a.split()[0] for a in first.actions] == ["created", "created", "installed", "copied"]
    assert second.actions == [], "a rerun with the same config must change nothing"
    assert unchanged, "a rerun must not touch a file of the node's work dir or the RAM disk"
    assert "dflash_probe_pkg==0.1.0" in second.venv.freeze
    assert subprocess.run([f"{second.venv.path}/bin/python", "-c", "import dflash_probe_pkg"]).returncode == 0
    placed = Path(second.model.placed_at)
    assert second.model.on_ram_disk and placed.parent.parent == ram_disk
    assert (placed / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert second.model.read_mb_s > 0 and second.model.bytes == 2_000_002 and second.model.num_files == 2
    assert "copied earlier" in second.model.reason
    assert {d.path for d in second.disks} >= {str(tmp_path / "node"), second.venv.path, str(ram_disk)}
    assert second.gpus.gpus or second.gpus.note  # no GPU here: the record says why
    assert NodeRecord.model_validate_json(Path(record_path).read_text()) == second

    # A new wheel in the wheelhouse is a different install; a fast home keeps the model where it is.
    build_wheel(tmp_path / "wheelhouse", version="0.2.0")
    third_config = config.model_copy(update={"packages": ["dflash_probe_pkg==0.2.0"], "ram_disk_below_mb_s": 1e-6,
                                             "ram_disk": str(ram_disk / "elsewhere")})
    with node.connect() as access:
        third = provision(access, node, third_config)
    assert third.actions == [f"installed dflash_probe_pkg==0.2.0 into {third.venv.path}"]
    assert not third.model.on_ram_disk and third.model.placed_at == str(model) and "stays" in third.model.reason


class _NfsHome(LocalAccess):
    """This machine, but /proc/mounts also shows an NFS mount at `nfs_root` (none can be mounted here)."""

    def __init__(self, nfs_root: Path):
        super().__init__("nfs-test")
        self.nfs_root = nfs_root

    def read_text(self, path: str, *, timeout_s: float = 60) -> str:
        text = super().read_text(path, timeout_s=timeout_s)
        if path == "/proc/mounts":
            text += f"fileserver:/export {self.nfs_root} nfs4 rw,vers=4.2 0 0\n"
        return text


def test_provision_refuses_a_venv_on_a_network_mount(tmp_path: Path) -> None:
    node = local_node(tmp_path / "node")
    with pytest.raises(ProvisionError, match=r"venv_dir .*/shared/venv is on a network filesystem \(nfs4"):
        provision(_NfsHome(tmp_path / "shared"), node, ProvisionConfig(venv_dir=str(tmp_path / "shared" / "venv")))
    assert not (tmp_path / "shared" / "venv").exists()
    with pytest.raises(ProvisionError, match="should have 8 GPU"):
        provision(LocalAccess(), local_node(tmp_path / "node", gpus=8), ProvisionConfig())


@pytest.mark.slow  # a venv and pip
def test_preserve_stops_only_ours_and_uploads_everything_with_manifests(store, settings, tmp_path: Path) -> None:
    name = f"node-{uuid.uuid4().hex[:8]}"
    work = tmp_path / "node"
    node = local_node(work, name=name)
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "serve.sh").write_text("#!/bin/sh\nexec vllm serve\n")
    (work / "configs").mkdir()
    (work / "configs" / "run.yaml").write_text("lr: 1e-4\n")
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)  # not ours: must survive
    try:
        with node.connect() as access:
            ours = [access.start_detached(f"server-{i}", f"echo serving {i}; exec sleep 300",
                                          log_path=f"{work}/logs/server-{i}.log", record_dir=f"{work}/{PROCESS_DIR}")
                    for i in range(2)]
            cli_run = CliRunner().invoke(cli.app, ["node", "provision", "--local", "--work-dir", str(work),
                                                   "--no-upload", "--json", "--record-out", str(tmp_path / "r.json")])
            assert cli_run.exit_code == 0, cli_run.output
            assert NodeRecord.model_validate_json(cli_run.output).venv.path == f"{work}/venv"
            before = _tree_state(work)
            result = preserve(access, node, store, settings.s3_prefixes, PreserveConfig(logs=["logs", "missing.log"]),
                              timestamp="20261130T120000Z")
            assert all(not access.is_running(record) for record in ours)
        assert stranger.poll() is None, "preserve must stop only the processes it recorded"
    finally:
        stranger.kill()
        stranger.wait()
    assert [(p.name, p.outcome) for p in result.stopped] == [("server-0", "stopped"), ("server-1", "stopped")]
    assert {k: v for k, v in _tree_state(work).items() if k in before} == before, "nothing on the node changes"
    prefix = f"node-backups/{name}/20261130T120000Z/"
    assert result.prefix_uri == store.uri(prefix)
    keys = sorted(info.key.removeprefix(prefix) for info in store.list(prefix))
    names = ["NOTE.md", "configs.tar.gz", "inventory.json", "logs.tar.gz", "pip-freeze.txt", "records.tar.gz",
             "scripts.tar.gz"]
    assert keys == sorted([*names, *(n + ".manifest.json" for n in names)])
    for item in names:
        manifest = read_manifest(store, prefix + item)
        assert manifest.kind == "node-backup" and verify_artifact(store, manifest) == []
    with tarfile.open(fileobj=io.BytesIO(store.get_bytes(prefix + "logs.tar.gz"))) as archive:
        assert archive.extractfile("logs/server-1.log").read() == b"serving 1\n"
    with tarfile.open(fileobj=io.BytesIO(store.get_bytes(prefix + "records.tar.gz"))) as archive:
        assert {"node-record.json", f"{PROCESS_DIR}/server-0.json"} <= set(archive.getnames())
    note = store.get_bytes(prefix + "NOTE.md").decode()
    assert note == result.note_markdown
    for saved in result.saved:
        assert f"`{saved.uri}`" in note
    assert "server-0 (pid" in note and f"{work}/missing.log" in note and result.missing == [f"{work}/missing.log"]
    graph = build_lineage(store, prefix)
    assert graph.inputs_of(store.uri(prefix + "NOTE.md")) == {s.uri for s in result.saved}


@pytest.mark.slow  # venvs and pip installs
def test_provision_without_ensurepip_fills_the_venv_with_the_outer_pip(tmp_path: Path) -> None:
    """Images without python3-venv (no ensurepip): the venv is made --without-pip and filled by `pip --python`."""
    import sys

    build_wheel(tmp_path / "wheelhouse")
    fake = tmp_path / "python-without-ensurepip"
    fake.write_text(f"""#!/bin/sh
case " $* " in
  *" -m venv "*) case " $* " in *" --without-pip "*) ;; *)
    echo "The virtual environment was not created successfully because ensurepip is not available." >&2; exit 1;;
  esac;;
esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    node = local_node(tmp_path / "node")
    config = ProvisionConfig(python=str(fake), packages=["dflash_probe_pkg==0.1.0"],
                             find_links=[str(tmp_path / "wheelhouse")], no_index=True)
    with node.connect() as access:
        record = provision(access, node, config)
        again = provision(access, node, config)
    assert not (Path(record.venv.path) / "bin" / "pip").exists()
    assert "dflash_probe_pkg==0.1.0" in record.venv.freeze and again.actions == []
    assert subprocess.run([f"{record.venv.path}/bin/python", "-c", "import dflash_probe_pkg"]).returncode == 0


def test_a_venv_made_from_an_image_venv_sees_the_image_venvs_packages(tmp_path: Path) -> None:
    """GPU images install torch into a venv of their own (/opt/torch/.venv): --system-site-packages alone shows
    the base interpreter's packages, not that venv's, so the pipeline's venv found no torch, yaml or regex there
    (the first H200 run). Provision points a .pth at the image venv's site-packages, after the new venv's own."""
    import subprocess
    import sys

    image = tmp_path / "image-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(image)], check=True)
    site = Path(subprocess.run([str(image / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
    (site / "dflash_image_only.py").write_text("WHERE = 'image venv'\n")
    node = local_node(tmp_path / "node")
    config = ProvisionConfig(python=str(image / "bin" / "python"), system_site_packages=True)
    record = provision(LocalAccess(), node, config)
    seen = subprocess.run([f"{record.venv.path}/bin/python", "-c", "import dflash_image_only, sys; "
                           "print(dflash_image_only.WHERE); print(sys.path.index(next(p for p in sys.path if "
                           "p.endswith('site-packages'))) < sys.path.index(str(__import__('pathlib').Path("
                           "dflash_image_only.__file__).parent)))"], capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split() == ["image", "venv", "True"]  # found, and the node venv's own come first
    assert provision(LocalAccess(), node, config).actions == []  # a rerun changes nothing
