"""Shard-level tokenization errors say what happened and name the shard: a chat template that fails on
every record (inline and through the process pool, where it used to surface as BrokenProcessPool), and
a byte-order mark at the start of a completion shard costs no record.

Run: `.venv/bin/python -m pytest -q tests/unit/test_tokenize_errors.py`
"""

from __future__ import annotations

import codecs

import pytest

from dflash_core.tokenize import TargetTokenizer, TokenizeConfig, TokenizePool, tokenize_shard
from dflash_core.tokenize.shard import TemplateFailed
from tests.unit.conftest_tokenize import jsonl, make_record

FAILING_TEMPLATE = "{{ raise_exception('this template needs a tools list') }}"


@pytest.fixture(scope="module")
def failing_target(smol_hf) -> TargetTokenizer:
    return TargetTokenizer.from_hf(smol_hf, chat_template=FAILING_TEMPLATE, name="failing")


def test_a_template_that_fails_every_record_names_the_shard_inline(failing_target) -> None:
    with pytest.raises(TemplateFailed, match=r"shard s3://b/completions/x/shard-00007.jsonl: the chat template of "
                                             r"failing fails .*this template needs a tools list"):
        tokenize_shard(jsonl(make_record()), target=failing_target, config=TokenizeConfig(),
                       name="s3://b/completions/x/shard-00007.jsonl")


def test_a_template_that_fails_every_record_names_the_shard_through_the_pool(failing_target) -> None:
    with TokenizePool(target=failing_target, config=TokenizeConfig(), workers=1) as pool:
        with pytest.raises(TemplateFailed, match=r"shard shard-00003.jsonl: .*this template needs a tools list"):
            tokenize_shard(jsonl(make_record()), target=failing_target, config=TokenizeConfig(), pool=pool,
                           name="shard-00003.jsonl")


def test_a_bom_at_the_start_of_a_shard_costs_no_record(qwen_target) -> None:
    data = codecs.BOM_UTF8 + jsonl(*[make_record(id=f"r{i}", content=f"Answer {i}.") for i in range(3)])
    result = tokenize_shard(data, target=qwen_target, config=TokenizeConfig())
    assert result.table["id"].to_pylist() == ["r0", "r1", "r2"]
    assert not result.quarantine
