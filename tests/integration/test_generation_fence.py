"""A node share's shard writes are fenced by the shard's assignment (dflash_core/serving/generation.py
`fenced_for`): a share whose shard is dealt to another while it answers stores nothing of it after that (the new
owner resumes from what it checkpointed before), the new owner's shard is stamped with its deal, and a shard
written outside the deal is found and written again by its owner without asking the server again. Against the
session's real S3 server and a real `transformers serve`.

Run: `.venv/bin/python -m pytest -q -n 0 tests/integration/test_generation_fence.py`
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_core.data.completion import Message
from dflash_core.data.prompts import PromptRecord
from dflash_core.layout import ArtifactKind
from dflash_core.lineage import write_artifact
from dflash_core.serving import launcher
from dflash_core.serving.client import ClientConfig, SamplingParams
from dflash_core.serving.generation import (
    PARTIAL_SUFFIX, GenerationTarget, ShardAssignment, ShardNotAssigned, assign_shard, generate_shard, stored_by,
    stored_by_another,
)
from dflash_core.serving.profiles import TransformersProfile
from tests.conftest import free_port

PROMPTS = 4
LOST = ShardAssignment(node="gpu-1", deal="generate-run:generate-gpu-1-attempt-1-wave-0")
NEW = ShardAssignment(node="gpu-2", deal="generate-run:generate-gpu-2-attempt-1-wave-1")


@pytest.fixture(scope="module")
def target(tiny_model_dir, tmp_path_factory):
    profile = TransformersProfile(model=str(tiny_model_dir))
    instances = launcher.launch(profile, num_instances=1, base_port=free_port(),
                                run_dir=tmp_path_factory.mktemp("servers"))
    launcher.wait_until_ready(instances, profile)
    yield GenerationTarget(urls=[i.url for i in instances], model=profile.request_model, server="transformers",
                           sampling=SamplingParams(max_tokens=6, temperature=0.0, enable_thinking=False),
                           client=ClientConfig(concurrency=2, backoff_s=0.2, request_timeout_s=60))
    launcher.stop_instances(instances)


def test_a_share_whose_shard_is_dealt_again_while_it_answers_stores_nothing_of_it(store, prefix, target,
                                                                                tmp_path: Path) -> None:
    prompt_key, output_key = _prompt_shard(store, prefix), f"{prefix}/completions-00000.jsonl"
    assign_shard(store, output_key, LOST)

    def dealt_again(_result) -> None:  # what the generate run does once it declares gpu-1 lost
        assign_shard(store, output_key, NEW)

    with pytest.raises(ShardNotAssigned, match="declared lost"):
        generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target, scratch_dir=tmp_path / "a",
                       checkpoint_every=1, on_result=dealt_again, assignment=LOST)
    # its first answer was checkpointed while the shard was still its own; nothing after that
    assert not store.exists(output_key) and store.exists(output_key + PARTIAL_SUFFIX)

    made = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target,
                          scratch_dir=tmp_path / "b", assignment=NEW)
    assert (made.completed, made.generated_now) == (PROMPTS, PROMPTS - 1), made  # resumed from that checkpoint
    assert stored_by(store, output_key) == NEW.deal and not store.exists(output_key + PARTIAL_SUFFIX)
    assert not stored_by_another(store, output_key)
    with pytest.raises(ShardNotAssigned):  # the lost share, back, retrying its failed write
        generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target,
                       scratch_dir=tmp_path / "a", assignment=LOST)
    assert stored_by(store, output_key) == NEW.deal


def test_a_shard_written_outside_its_deal_is_found_and_written_again_by_its_owner(store, prefix, target,
                                                                                  tmp_path: Path) -> None:
    prompt_key, output_key = _prompt_shard(store, prefix), f"{prefix}/completions-00000.jsonl"
    generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target, scratch_dir=tmp_path / "x")
    assign_shard(store, output_key, NEW)
    assert stored_by(store, output_key) is None and stored_by_another(store, output_key)

    made = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target,
                          scratch_dir=tmp_path / "b", assignment=NEW)
    assert (made.skipped, made.generated_now, made.completed) == (False, 0, PROMPTS)  # its answers were kept
    assert stored_by(store, output_key) == NEW.deal and not stored_by_another(store, output_key)


def _prompt_shard(store, prefix) -> str:
    prompts = [PromptRecord(id=f"p{i}", source="test", messages=[Message(role="user", content=f"Say {i}")])
               for i in range(PROMPTS)]
    key = f"{prefix}/prompts-00000.jsonl"
    write_artifact(store, key, b"".join(p.to_json_line() for p in prompts), kind=ArtifactKind.PROMPTS)
    return key
