"""A rerun of the same prompt import on the real S3 server keeps the stored prompt set: every shard, the
import report and the quarantine file stay as the first run wrote them, manifests included, so the first
run stays their producer (its lineage and S3 usage keep their prompts). Changed content is written anew.
A prompt set split prompt by prompt (before whole conversations) is refused where the split would move
prompts, and kept where it would not.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_prompt_reimport.py`
"""

from __future__ import annotations

import json
import uuid

from prefect.logging import disable_run_logger

import pytest

import tasks.generate
from dflash_core.data.holdout import HoldoutSpec, holdout_rank
from dflash_core.data.prompts import PromptSource
from dflash_core.layout import manifest_key
from dflash_core.lineage import read_manifest
from tasks.generate import import_prompt_set


def _prompts(count: int, *, parts: int = 1) -> bytes:
    """`count` prompts; with `parts`, ShareGPT-like ids `c<n>_<part>`, `parts` of each conversation."""
    ids = [f"p{i}" for i in range(count)] if parts == 1 else [f"c{i // parts}_{i % parts}" for i in range(count)]
    records = [{"id": i, "messages": [{"role": "user", "content": f"question {i}"}]} for i in ids]
    return json.dumps([*records, {"text": "not a conversation"}]).encode()  # one quarantined record


def _stored(store, keys: list[str]) -> dict[str, tuple[str, bytes]]:
    """key -> (the object's ETag, its manifest's bytes)."""
    return {key: (store.head(key).etag, store.get_bytes(manifest_key(key))) for key in keys}


def test_a_rerun_of_the_same_import_keeps_the_prompt_set_and_its_producer(store, env_settings, tmp_path,
                                                                           monkeypatch):
    source = tmp_path / "prompts.json"
    source.write_bytes(_prompts(5))
    dataset = f"reimport-{uuid.uuid4().hex[:8]}"

    def run_import(flow_run_id: str) -> list[str]:
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", flow_run_id)  # what prefect.runtime reads outside a run
        with disable_run_logger():
            return import_prompt_set.fn(env_settings, sources=[PromptSource(source, "s")], dataset=dataset,
                                        version="v1", total=None, shard_size=2, seed=0,
                                        holdout=HoldoutSpec(count=1))

    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    keys = run_import(first)
    base = keys[0].rsplit("/", 1)[0] + "/import-report.json"
    every = [*keys, base, base + ".quarantine.jsonl"]
    before = _stored(store, every)
    assert {read_manifest(store, key).producer.flow_run_id for key in every} == {first}

    assert run_import(second) == keys
    assert _stored(store, every) == before, "a rerun with the same content rewrote the prompt set"

    source.write_bytes(_prompts(6))  # one more prompt: the content changes, so the import is written anew
    changed = run_import(second)
    assert second in {read_manifest(store, key).producer.flow_run_id for key in changed}
    assert read_manifest(store, base).producer.flow_run_id == second


def _split_by_own_id(prompts, spec):
    """The split before whole conversations: each prompt ranked by its own id."""
    ranked = sorted(prompts, key=lambda p: holdout_rank(spec.seed, p.source, p.id))
    held = {p.id for p in ranked[:spec.per_source(len(prompts))]}
    return [p for p in prompts if p.id not in held], [p for p in prompts if p.id in held]


@pytest.mark.parametrize(("parts", "refused"), [(2, True), (1, False)])
def test_a_prompt_set_split_prompt_by_prompt_is_refused_where_the_split_moves(store, env_settings, tmp_path,
                                                                              monkeypatch, parts, refused):
    source = tmp_path / "prompts.json"
    source.write_bytes(_prompts(8, parts=parts))
    dataset = f"resplit-{uuid.uuid4().hex[:8]}"

    def run_import() -> list[str]:
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(uuid.uuid4()))
        with disable_run_logger():
            return import_prompt_set.fn(env_settings, sources=[PromptSource(source, "s")], dataset=dataset,
                                        version="v1", total=None, shard_size=2, seed=0,
                                        holdout=HoldoutSpec(count=1))

    with monkeypatch.context() as old_code:  # what the import wrote before: no rule recorded
        old_code.setattr(tasks.generate, "split_heldout", _split_by_own_id)
        old_code.setattr(tasks.generate, "HOLDOUT_RULE", None)
        keys = run_import()
    base = keys[0].rsplit("/", 1)[0] + "/import-report.json"
    every = [*keys, base, base + ".quarantine.jsonl"]
    before = _stored(store, every)
    if refused:  # a held-out part's sibling trains: rewriting in place would mix the two splits
        with pytest.raises(ValueError, match=r"rule prompt; this import holds out whole conversations .* so 3 "
                                             r"prompts change sides: import into a new prompts_version"):
            run_import()
        assert _stored(store, every) == before, "the refused import wrote over the old split"
    else:  # one prompt per conversation: the same split, kept as it was
        assert run_import() == keys and _stored(store, every) == before
