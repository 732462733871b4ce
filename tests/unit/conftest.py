"""The tokenizers the tokenization tests share, built once per session (what each one is:
tests/unit/conftest_tokenize.py), and `bench`, bench/bench_acceptance.py loaded by path for the
acceptance bench's tests. A fixture imported into a test module is built once per module."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
from tokenizers import Regex, pre_tokenizers

from dflash_core.embedded import load_embedded_tokenizer
from dflash_core.tokenize.target import TargetTokenizer
from tests.unit.conftest_tokenize import MODEL_CACHE, QWEN_ADDED_TOKENS, QWEN_SPLIT, QWEN_STYLE_TEMPLATE


@pytest.fixture(scope="session")
def smol_hf():
    return load_embedded_tokenizer(MODEL_CACHE)


@pytest.fixture(scope="session")
def qwen_hf(smol_hf):
    tokenizer = copy.deepcopy(smol_hf)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.add_tokens(QWEN_ADDED_TOKENS)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def smol_target(smol_hf) -> TargetTokenizer:
    return TargetTokenizer.from_hf(smol_hf, name="smollm2")


@pytest.fixture(scope="session")
def qwen_target(qwen_hf) -> TargetTokenizer:
    return TargetTokenizer.from_hf(qwen_hf, name="qwen-style")


@pytest.fixture(scope="module")
def bench():
    """bench/bench_acceptance.py as a module (bench/ is no package), registered while the module's tests run."""
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_acceptance.py"
    spec = importlib.util.spec_from_file_location("bench_acceptance", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_acceptance"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_acceptance", None)

