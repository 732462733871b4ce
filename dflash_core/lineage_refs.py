"""Input refs for what lives outside the bucket: a target model's and its tokenizer's files by sha256
(hashes of large weights cached per host by size and modification time), or a target built in code
by its spec and seed."""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable
from pathlib import Path

from dflash_core.lineage import TARGET_MODEL, TOKENIZER, InputRef
from dflash_core.storage import sha256_bytes, sha256_file


# ---- inputs outside the bucket: the target model and its tokenizer, by file ----------------------

# The files that make a model dir what it is (its weights and config) and those that make its tokenizer.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
BUILT_IN_CODE = ("tiny:", "random:")  # targets built from a config in code and a seed: no files


class DigestCache:
    """sha256 of local files by (path, size, mtime), in one JSON file: a model's weights are hashed once per
    change, not by every stage that names them. A lost update (two writers) only costs a re-hash."""

    def __init__(self, path: Path | None):
        self.path = path

    def sha256(self, file: Path) -> str:
        stat = file.stat()
        stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
        known = self._load()
        entry = known.get(str(file))
        if entry and entry.get("stamp") == stamp:
            return entry["sha256"]
        digest = sha256_file(file)
        if self.path is not None:
            known[str(file)] = {"stamp": stamp, "sha256": digest}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            tmp.replace(self.path)
        return digest

    def _load(self) -> dict[str, dict[str, str]]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            return json.loads(self.path.read_text())
        except ValueError:  # a torn write: start over
            return {}


def directory_refs(directory: Path, *, role: str, patterns: Iterable[str],
                   digests: DigestCache | None = None) -> list[InputRef]:
    """Each file of `directory` whose name matches one of `patterns`, as an input (file:// URI, sha256), by name."""
    directory = Path(directory).resolve()
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory: a model or tokenizer dir is needed to name it as an input")
    digests = digests or DigestCache(None)
    names = sorted(path.name for path in directory.iterdir()
                   if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns))
    return [InputRef(uri=(directory / name).as_uri(), sha256=digests.sha256(directory / name), role=role)
            for name in names]


def tokenizer_refs(directory: Path, *, digests: DigestCache | None = None) -> list[InputRef]:
    """The tokenizer of `directory` (its tokenizer files and chat template) as inputs."""
    return directory_refs(directory, role=TOKENIZER, patterns=TOKENIZER_FILES, digests=digests)


def target_refs(target: str, *, seed: int, models_dir: Path, digests: DigestCache | None = None) -> list[InputRef]:
    """The target model as inputs: its config and weights, then its tokenizer files, by sha256 (a model dir, or
    `embedded`: the converted SmolLM2 under `models_dir`). A target built in code has no files: it is its spec
    and seed (`tiny:qwen3?seed=3`, hashed as that text), which with the producer's git SHA rebuild it."""
    if target.startswith(BUILT_IN_CODE):
        spec = f"{target}?seed={seed}"
        return [InputRef(uri=spec, sha256=sha256_bytes(spec.encode()), role=TARGET_MODEL)]
    if target == "embedded":
        from dflash_core.embedded import embedded_model_dir

        directory = embedded_model_dir(models_dir)
    else:
        directory = Path(target)
    return [*directory_refs(directory, role=TARGET_MODEL, patterns=MODEL_FILES, digests=digests),
            *tokenizer_refs(directory, digests=digests)]
