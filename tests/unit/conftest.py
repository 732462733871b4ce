"""The tokenizers the tokenization tests share, built once per session (what each one is:
tests/unit/conftest_tokenize.py)."""

from __future__ import annotations

import copy

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
