"""Async chat-completion requests spread over several OpenAI-compatible servers.

Bounded concurrency, the least-busy healthy endpoint first, retries with backoff for transient
faults (connection errors, timeouts, 429, 5xx) on another endpoint, and a failed prompt returned
as a `FailedPrompt` rather than raised: one bad prompt never stops the others.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import BaseModel, Field

from dflash_core.data.completion import CompletionRecord, GenerationMeta, ToolCall
from dflash_core.data.prompts import PromptRecord, regenerate_completion
from dflash_core.strict import StrictModel

_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)
_FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}


class SamplingParams(StrictModel):
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(4096, gt=0)
    seed: int | None = None
    enable_thinking: bool = Field(True, description="Sent as chat_template_kwargs.enable_thinking.")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Engine-specific request fields.")


class ClientConfig(StrictModel):
    concurrency: int = Field(32, ge=1, description="Requests in flight across all endpoints.")
    max_attempts: int = Field(4, ge=1)
    backoff_s: float = Field(1.0, ge=0, description="First retry delay; doubles each attempt, with jitter.")
    request_timeout_s: float = Field(900.0, gt=0)
    endpoint_cooldown_s: float = Field(10.0, ge=0, description="How long a failing endpoint is avoided.")


class FailedPrompt(BaseModel):
    id: str
    source: str
    error: str
    attempts: int
    endpoint: str | None = None


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    avoid_until: float = 0.0
    failures: int = 0


@dataclass
class EndpointPool:
    urls: list[str]
    cooldown_s: float = 10.0
    _endpoints: list[_Endpoint] = field(init=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("no inference endpoints given")
        self._endpoints = [_Endpoint(url.rstrip("/")) for url in self.urls]

    def acquire(self) -> _Endpoint:
        now = time.monotonic()
        healthy = [e for e in self._endpoints if e.avoid_until <= now] or self._endpoints
        endpoint = min(healthy, key=lambda e: (e.avoid_until > now, e.in_flight, e.failures))
        endpoint.in_flight += 1
        return endpoint

    def release(self, endpoint: _Endpoint, *, failed: bool) -> None:
        endpoint.in_flight -= 1
        if failed:
            endpoint.failures += 1
            endpoint.avoid_until = time.monotonic() + self.cooldown_s


class _Transient(Exception):
    pass


class _Permanent(Exception):
    pass


def request_body(prompt: PromptRecord, *, model: str, sampling: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [m.model_dump(exclude_none=True) for m in prompt.messages],
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "chat_template_kwargs": {"enable_thinking": sampling.enable_thinking},
        **sampling.extra_body,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if prompt.tools:
        body["tools"] = prompt.tools
    return body


def parse_response(prompt: PromptRecord, payload: dict[str, Any], *, model: str, server: str,
                   sampling: SamplingParams) -> CompletionRecord:
    """A completion record from a chat-completion response; reasoning split out of `<think>` if the
    server did not do it."""
    try:
        choice = payload["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as error:
        raise _Permanent(f"response has no choices[0].message: {str(payload)[:200]}") from error
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is None and (match := _THINK.match(content)):
        reasoning, content = match.group(1).strip(), content[match.end():]
    finish = choice.get("finish_reason") or "stop"
    if finish not in _FINISH_REASONS:
        finish = "length" if finish in ("max_tokens", "abort") else "stop"
    usage = payload.get("usage") or {}
    return CompletionRecord(
        id=prompt.id, source=prompt.source, prompt=prompt.messages, tools=prompt.tools,
        reasoning=reasoning, content=content,
        tool_calls=[ToolCall.model_validate(call) for call in message.get("tool_calls") or []],
        finish_reason=finish,
        generation=GenerationMeta(
            model=model, server=server, enable_thinking=sampling.enable_thinking,
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens,
            seed=sampling.seed, prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"), created_at=datetime.now(UTC).isoformat(),
        ),
    )


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> dict:
    try:
        response = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
    except (httpx.TransportError, httpx.TimeoutException) as error:
        raise _Transient(f"{type(error).__name__}: {error}") from error
    if response.status_code == 429 or response.status_code >= 500:
        raise _Transient(f"HTTP {response.status_code}: {response.text[:200]}")
    if response.status_code >= 400:
        raise _Permanent(f"HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError as error:
        raise _Transient(f"response is not JSON: {response.text[:200]}") from error


class _TurnFailed(Exception):
    def __init__(self, failed: FailedPrompt):
        super().__init__(failed.error)
        self.failed = failed


async def complete_one(client: httpx.AsyncClient, pool: EndpointPool, prompt: PromptRecord, *, model: str,
                       server: str, sampling: SamplingParams, config: ClientConfig,
                       api_key: str | None = None) -> CompletionRecord | FailedPrompt:
    """One prompt's record. A prompt with follow-up user turns (import policy `regenerate_turns`) is
    answered turn by turn with the target's own answers as context; a failed turn fails the prompt,
    naming the turn."""
    kwargs = dict(model=model, server=server, sampling=sampling, config=config, api_key=api_key)
    if not prompt.followups:
        return await _complete_request(client, pool, prompt, **kwargs)
    turn = 0

    async def ask(messages) -> CompletionRecord:
        nonlocal turn
        turn += 1
        result = await _complete_request(client, pool, prompt.model_copy(update={"messages": messages}), **kwargs)
        if isinstance(result, FailedPrompt):
            raise _TurnFailed(result.model_copy(update={
                "error": f"turn {turn} of {1 + len(prompt.followups)}: {result.error}"}))
        return result

    try:
        return await regenerate_completion(prompt, ask)
    except _TurnFailed as failed:
        return failed.failed


async def _complete_request(client: httpx.AsyncClient, pool: EndpointPool, prompt: PromptRecord, *, model: str,
                            server: str, sampling: SamplingParams, config: ClientConfig,
                            api_key: str | None = None) -> CompletionRecord | FailedPrompt:
    body = request_body(prompt, model=model, sampling=sampling)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    error = "no attempt made"
    endpoint = None
    for attempt in range(1, config.max_attempts + 1):
        endpoint = pool.acquire()
        try:
            payload = await _post(client, endpoint.url, body, headers)
            record = parse_response(prompt, payload, model=model, server=server, sampling=sampling)
        except _Transient as transient:
            pool.release(endpoint, failed=True)
            error = str(transient)
            if attempt < config.max_attempts:
                await asyncio.sleep(config.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            continue
        except (_Permanent, ValueError) as permanent:
            pool.release(endpoint, failed=False)
            return FailedPrompt(id=prompt.id, source=prompt.source, error=str(permanent), attempts=attempt,
                                endpoint=endpoint.url)
        pool.release(endpoint, failed=False)
        return record
    return FailedPrompt(id=prompt.id, source=prompt.source, error=error, attempts=config.max_attempts,
                        endpoint=endpoint.url if endpoint else None)


async def complete_all(prompts: Iterable[PromptRecord], *, urls: list[str], model: str, server: str,
                       sampling: SamplingParams, config: ClientConfig,
                       api_key: str | None = None) -> AsyncIterator[CompletionRecord | FailedPrompt]:
    """Results in completion order, at most `config.concurrency` requests in flight."""
    pool = EndpointPool(urls, cooldown_s=config.endpoint_cooldown_s)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(timeout=config.request_timeout_s, limits=limits) as client:
        queue = iter(prompts)
        running: set[asyncio.Task] = set()

        def submit() -> bool:
            prompt = next(queue, None)
            if prompt is None:
                return False
            running.add(asyncio.create_task(complete_one(client, pool, prompt, model=model, server=server,
                                                         sampling=sampling, config=config, api_key=api_key)))
            return True

        while len(running) < config.concurrency and submit():
            pass
        try:
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    running.discard(task)
                    yield task.result()
                    submit()
        finally:
            for task in running:
                task.cancel()
