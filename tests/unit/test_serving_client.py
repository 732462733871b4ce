"""Engine profiles, response parsing and the canary, without a server.

Run: `.venv/bin/python -m pytest tests/unit/test_serving_client.py -q`
"""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from dflash_core.data.completion import Message
from dflash_core.data.prompts import PromptRecord
from dflash_core.serving.canary import CanaryThresholds, check_canary, looks_degenerate
from dflash_core.serving.client import FailedPrompt, SamplingParams, parse_response, request_body
from dflash_core.serving.profiles import EngineProfile

PROMPT = PromptRecord(id="p1", source="t", messages=[Message(role="user", content="hi")])


def _response(content, reasoning=None, finish="stop"):
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {"choices": [{"message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 9}}


def test_profiles_are_data_and_bind_loopback() -> None:
    adapter = TypeAdapter(EngineProfile)
    vllm = adapter.validate_python({"engine": "vllm", "model": "/m", "speculative_config": {"method": "mtp"},
                                    "api_key": "k"})
    argv = vllm.argv(port=9000)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--reasoning-parser" not in argv, "a target without a thinking mode (Llama, SmolLM2) gets no parser forced"
    qwen = adapter.validate_python({"engine": "vllm", "model": "/m", "reasoning_parser": "qwen3", "dtype": "bfloat16"})
    assert qwen.argv(port=1)[qwen.argv(port=1).index("--reasoning-parser") + 1] == "qwen3"
    assert "--dtype" in qwen.argv(port=1) and "--dtype" not in argv
    assert '"method": "mtp"' in argv[argv.index("--speculative-config") + 1]
    assert vllm.instance_env("3")["CUDA_VISIBLE_DEVICES"] == "3"
    assert "k" not in argv and vllm.instance_env(None)["VLLM_API_KEY"] == "k", "the key travels by env only"
    sglang = adapter.validate_python({"engine": "sglang", "model": "/m", "tensor_parallel_size": 2})
    assert sglang.argv(port=1)[1:3] == ["-m", "sglang.launch_server"] and "--tp" in sglang.argv(port=1)
    cpu = adapter.validate_python({"engine": "transformers", "model": "/m", "continuous_batching": True})
    assert cpu.argv(port=5)[1:3] == ["serve", "/m"] and "--continuous-batching" in cpu.argv(port=5)
    with pytest.raises(ValueError, match="API-key"):
        adapter.validate_python({"engine": "transformers", "model": "/m", "api_key": "x"}).argv(port=5)


def test_request_asks_for_thinking_and_records_sampling() -> None:
    body = request_body(PROMPT, model="m", sampling=SamplingParams(seed=3, max_tokens=7))
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["seed"] == 3 and body["max_tokens"] == 7 and body["messages"] == [{"role": "user", "content": "hi"}]


def test_reasoning_from_field_or_think_tags() -> None:
    sampling = SamplingParams()
    split = parse_response(PROMPT, _response("answer", reasoning="thought"), model="m", server="vllm", sampling=sampling)
    assert (split.reasoning, split.content) == ("thought", "answer")
    inline = parse_response(PROMPT, _response("<think>\nhmm\n</think>\n\nanswer"), model="m", server="t",
                            sampling=sampling)
    assert (inline.reasoning, inline.content) == ("hmm", "answer")
    assert inline.generation.completion_tokens == 9 and inline.generation.enable_thinking is True


def test_canary_catches_missing_reasoning_and_loops() -> None:
    sampling = SamplingParams()
    good = [parse_response(PROMPT, _response(f"answer {i}", reasoning=f"because {i}"), model="m", server="s",
                           sampling=sampling) for i in range(10)]
    assert check_canary(good, expect_thinking=True, thresholds=CanaryThresholds()).passed
    no_think = [parse_response(PROMPT, _response("answer"), model="m", server="s", sampling=sampling)] * 10
    report = check_canary(no_think, expect_thinking=True, thresholds=CanaryThresholds())
    assert not report.passed and "no reasoning" in report.problems[0]
    loop = "the cat sat on " * 100
    looped = [parse_response(PROMPT, _response(loop, reasoning="x", finish="length"), model="m", server="s",
                             sampling=sampling)] * 10
    report = check_canary(looped, expect_thinking=True, thresholds=CanaryThresholds())
    assert report.degenerate == 10 and report.truncated == 10 and len(report.problems) == 2
    failed = [FailedPrompt(id="x", source="t", error="boom", attempts=4)] * 3 + good[:7]
    assert "got no answer" in check_canary(failed, expect_thinking=True, thresholds=CanaryThresholds()).problems[0]
    assert looks_degenerate(loop) and not looks_degenerate(" ".join(f"word{i}" for i in range(300)))


def test_recorded_command_lines_carry_no_secrets(tmp_path) -> None:
    import json
    import sys

    from dflash_core.provenance import current_producer
    from dflash_core.services.process import ProcessRecord, start_detached, stop

    argv = [sys.executable, "-c", "import time; time.sleep(30)", "--api-key", "sk-live-1",
            '{"engine": {"api_key": "sk-live-2"}}']
    record = start_detached("t", argv, log_path=tmp_path / "log", record_path=tmp_path / "rec.json")
    stop(record, timeout_s=5)
    saved = (tmp_path / "rec.json").read_text()
    assert "sk-live-1" not in saved and "sk-live-2" not in saved
    assert ProcessRecord.load(tmp_path / "rec.json").argv[0] == sys.executable
    sys_argv, sys.argv = sys.argv, ["dflash", "run", "generate", "--params", '{"engine": {"api_key": "sk-3"}}']
    try:
        assert "sk-3" not in json.dumps(current_producer().model_dump())
    finally:
        sys.argv = sys_argv
