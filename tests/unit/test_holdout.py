"""The held-out split: chosen per source by prompt id and seed, stable under reordering, never empty
for a source of two or more, never all of a source; the demo's held-out prompts.

Run: `.venv/bin/python -m pytest -q tests/unit/test_holdout.py`
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from dflash_core.data.holdout import HoldoutSpec, split_heldout


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
