"""The inference server killed mid-generation (#28.9): SIGKILL of the recorded `transformers serve`
PID while a shard is being answered. The flow fails past max_failed_fraction, naming failed prompts
(message and each shard's failures.jsonl); a rerun (a fresh launch) answers the rest, and every
prompt then has exactly one record across the completion shards: none duplicated, none missing.

Run: `.venv/bin/python -m pytest -q tests/integration/test_generate_server_killed.py`
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter

import pytest

from dflash_core.data.completion import CompletionRecord
from dflash_core.serving import launcher
from dflash_core.serving.generation import failures_of
from dflash_core.services.process import ProcessRecord, is_alive
from tests.integration.test_generate_flow import _params

PROMPTS = {f"q{i}" for i in range(10)}


def _kill_after_first_answer(settings, run: str, killed: dict) -> threading.Thread:
    """A thread that SIGKILLs server 0 (its recorded PID only) once the first answer is in a partial file."""
    scratch, run_dir = settings.work_path("generate"), settings.work_path("servers", run)

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for partial in scratch.glob(f"*{run}*.partial"):
                try:
                    answered = partial.read_bytes().count(b"\n")
                except FileNotFoundError:
                    continue
                if answered:
                    record = ProcessRecord.load(run_dir / "server-0.json")
                    os.kill(record.pid, signal.SIGKILL)
                    killed.update(pid=record.pid, record=record, shard=partial.name, answered=answered)
                    return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _records(store, run: str) -> Counter:
    ids: Counter = Counter()
    for info in store.list(f"completions/flowtest/{run}/"):
        if info.key.endswith(".jsonl") and not info.key.endswith(".failures.jsonl"):
            for line in store.get_bytes(info.key).splitlines():
                ids[CompletionRecord.model_validate_json(line).id] += 1
    return ids


def test_server_killed_mid_shard_fails_visibly_and_a_rerun_completes_exactly_once(
        prefect_server, store, env_settings, tiny_model_dir, tmp_path) -> None:
    from flows.generate import generate

    # Longer answers and two requests in flight: the kill lands while the shard still has prompts to answer.
    params = _params(tmp_path, tiny_model_dir, canary_prompts=0,
                     sampling={"max_tokens": 48, "temperature": 0.0, "enable_thinking": False},
                     client={"concurrency": 2, "max_attempts": 2, "backoff_s": 0.05, "endpoint_cooldown_s": 0})
    killed: dict = {}
    watcher = _kill_after_first_answer(env_settings, params.run, killed)
    state = generate(params, return_state=True)
    watcher.join(timeout=10)
    assert killed, "the server was never killed (no answer landed)"
    assert not is_alive(killed["record"])
    print(f"killed server pid {killed['pid']} after {killed['answered']} answer(s) of {killed['shard']}")
    assert state.is_failed(), state

    with pytest.raises(Exception) as failure:
        state.result()
    message = str(failure.value)
    match = re.search(r"(\d+) of 10 prompts failed \(\d+\.\d%; max_failed_fraction 2\.0%\)", message)
    assert match, message
    failed_count = int(match.group(1))
    print("flow failed:", message)
    first_errors = set(re.findall(r"\b(q\d): ", message))
    assert first_errors and len(first_errors) == min(3, failed_count), message
    named = set(re.search(r"; failed prompts: ([q\d, ]+)", message).group(1).split(", "))
    assert "failures.jsonl" in message and "rerunning the flow retries only those" in message
    failed = {f.id for info in store.list(f"completions/flowtest/{params.run}/")
              if info.key.endswith(".failures.jsonl") for f in failures_of(store, info.key[:-len(".failures.jsonl")])}
    answered = _records(store, params.run)
    assert len(failed) == failed_count and named == failed and first_errors <= failed, (failed, message)
    assert set(answered) | failed == PROMPTS and not set(answered) & failed, (answered, failed)
    assert all(count == 1 for count in answered.values()), answered
    run_dir = env_settings.work_path("servers", params.run)
    assert not any(is_alive(i.record) for i in launcher.load_instances(run_dir)), "servers stopped"

    again = generate(params.model_copy(update={"prompt_sources": []}), return_state=True)
    assert again.is_completed(), again
    result = again.result()
    assert result.outcomes["failed"] == 0 and result.outcomes["generated_now"] == failed_count
    ids: Counter = Counter()
    for shard in result.shards:
        for line in store.get_bytes(store.key_of(shard.uri)).splitlines():
            ids[CompletionRecord.model_validate_json(line).id] += 1
    assert ids == Counter(PROMPTS), f"not exactly one record per prompt: {ids}"
    assert _records(store, params.run) == Counter(PROMPTS)
    leftovers = [info.key for info in store.list(f"completions/flowtest/{params.run}/")
                 if info.key.endswith((".failures.jsonl", ".partial"))]
    assert not leftovers, leftovers
    assert not any(is_alive(i.record) for i in launcher.load_instances(run_dir)), "servers stopped"


def test_verdict_names_every_failed_prompt_up_to_a_cap() -> None:
    from dflash_core.serving.generation import MAX_NAMED_FAILURES, GenerationFailed, ShardOutcome, failure_verdict

    ids = [f"p{i}" for i in range(MAX_NAMED_FAILURES + 5)]
    outcomes = [ShardOutcome("c/shard-0", 30, 30 - len(ids), len(ids), 0, 0, first_errors=["p0: ConnectError"],
                             failed_ids=ids)]
    with pytest.raises(GenerationFailed) as failed:
        failure_verdict(outcomes, max_failed_fraction=0.02)
    assert f"failed prompts: {', '.join(ids[:MAX_NAMED_FAILURES])} (+5 more)" in str(failed.value)
