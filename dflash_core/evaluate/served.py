"""The drafter as a serving engine runs it: the same prompts (token ids) through a target-only server and a
server that drafts with the export, at temperature 0, at several request concurrencies.

Acceptance comes from the engine's own counters (vLLM's `/metrics`: drafts, accepted tokens, accepted tokens
per draft position), read before and after each pass, so tau = 1 + accepted / drafts is what the engine did,
counted as we count it (accepted + 1 per round). Every drafted output is compared token for token with the
target-only output of the same prompt. `measure_server` talks to a server that runs; `serve_and_measure`
starts one (dflash_core/serving/launcher.py), measures it and stops it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_DRAFTS = "vllm:spec_decode_num_drafts"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters, summed over its engines (all zero on a target-only server)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_position: tuple[float, ...] = ()

    def _combine(self, other: SpecCounters, sign: float) -> SpecCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine, theirs = (list(c.accepted_per_position) + [0.0] * (width - len(c.accepted_per_position))
                        for c in (self, other))
        return SpecCounters(drafts=self.drafts + sign * other.drafts,
                            draft_tokens=self.draft_tokens + sign * other.draft_tokens,
                            accepted=self.accepted + sign * other.accepted,
                            accepted_per_position=tuple(a + sign * b for a, b in zip(mine, theirs)))

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1.0)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        return self._combine(before, -1.0)

    @property
    def tau(self) -> float | None:
        """Mean tokens per draft round (accepted + 1), None when nothing was drafted."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of rounds whose draft position k (0-based) was accepted."""
        return [count / self.drafts for count in self.accepted_per_position] if self.drafts else []


def parse_spec_counters(metrics_text: str) -> SpecCounters:
    """The spec-decode counters of a Prometheus text exposition (vLLM's /metrics)."""
    totals = {_DRAFTS: 0.0, _DRAFT_TOKENS: 0.0, _ACCEPTED: 0.0}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in (*totals, _ACCEPTED_PER_POS):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the _created timestamps
            if family.name == _ACCEPTED_PER_POS:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            else:
                totals[family.name] += sample.value
    width = max(per_position, default=-1) + 1
    return SpecCounters(drafts=totals[_DRAFTS], draft_tokens=totals[_DRAFT_TOKENS], accepted=totals[_ACCEPTED],
                        accepted_per_position=tuple(per_position.get(k, 0.0) for k in range(width)))


@dataclass
class ConcurrencyPass:
    """One pass over every prompt with at most `concurrency` requests in flight."""

    concurrency: int
    wall_s: float
    output_tokens: int
    counters: SpecCounters
    outputs: list[list[int]] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


async def _complete_all(url: str, *, model: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
                        headers: dict[str, str], timeout_s: float) -> list[list[int]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0,
                "return_token_ids": True}
        async with gate:
            response = await client.post(f"{url}/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{url}/v1/completions answered {response.status_code}: {response.text[:300]}")
        choice = response.json()["choices"][0]
        if choice.get("token_ids") is None:
            raise RuntimeError(f"{url} returned no token_ids: an engine without `return_token_ids` (vLLM >= 0.10) "
                               "cannot be compared token for token")
        return list(choice["token_ids"])

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, prompt) for prompt in prompts)))


def read_counters(url: str, *, headers: dict[str, str] | None = None) -> SpecCounters:
    response = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=30)
    response.raise_for_status()
    return parse_spec_counters(response.text)


def measure_server(url: str, *, model: str, prompts: list[list[int]], max_new_tokens: int,
                   concurrencies: list[int], api_key: str | None = None,
                   timeout_s: float = 600.0) -> list[ConcurrencyPass]:
    """Every prompt once per concurrency, on a server that runs; the engine's counters over each pass. A
    warm-up request first, so no pass pays for the engine's first-request compilation."""
    if not prompts:
        raise ValueError("no prompts to serve")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    run = lambda batch, concurrency: asyncio.run(_complete_all(  # noqa: E731
        url, model=model, prompts=batch, max_new_tokens=max_new_tokens, concurrency=concurrency, headers=headers,
        timeout_s=timeout_s))
    run(prompts[:1], 1)
    passes = []
    for concurrency in concurrencies:
        before = read_counters(url, headers=headers)
        start = time.perf_counter()
        outputs = run(prompts, concurrency)
        wall = time.perf_counter() - start
        passes.append(ConcurrencyPass(concurrency=concurrency, wall_s=wall, output_tokens=sum(map(len, outputs)),
                                      counters=read_counters(url, headers=headers) - before, outputs=outputs))
    return passes


def serve_and_measure(profile: Any, *, run_dir: Path, port: int, device: str | None, prompts: list[list[int]],
                      max_new_tokens: int, concurrencies: list[int],
                      log: Callable[[str], None] = print) -> list[ConcurrencyPass]:
    """Start one server of `profile` (an engine profile, dflash_core/serving/profiles.py), wait until it answers,
    measure it at every concurrency, stop it."""
    from dflash_core.serving.launcher import launch, stop_instances, wait_until_ready

    instances = launch(profile, num_instances=1, base_port=port, run_dir=run_dir, devices=[device] if device else None)
    try:
        ready_s = wait_until_ready(instances, profile)[0]
        log(f"{run_dir.name}: ready in {ready_s:.0f} s (log {instances[0].log_path})")
        passes = measure_server(instances[0].url, model=profile.request_model, prompts=prompts,
                                max_new_tokens=max_new_tokens, concurrencies=concurrencies,
                                api_key=profile.api_key.get_secret_value() if profile.api_key else None)
    finally:
        stop_instances(instances)
    for one in passes:
        tau = "-" if one.counters.tau is None else f"{one.counters.tau:.3f}"
        log(f"{run_dir.name}, {one.concurrency} in flight: {one.tokens_per_s:,.0f} tokens/s, tau {tau}")
    return passes


def compare_served(target_only: list[ConcurrencyPass], drafted: list[ConcurrencyPass]) -> dict[str, Any]:
    """The served table: per concurrency, tokens/s of both servers and the speedup, the engine's tau and
    acceptance per position, and how many drafted outputs equal the target-only output of their prompt."""
    if [p.concurrency for p in target_only] != [p.concurrency for p in drafted]:
        raise ValueError("the two servers were measured at different concurrencies")
    rows = []
    for base, spec in zip(target_only, drafted):
        equal = sum(a == b for a, b in zip(base.outputs, spec.outputs))
        rows.append({
            "concurrency": spec.concurrency, "prompts": len(spec.outputs),
            "target_tokens_per_s": round(base.tokens_per_s, 1), "drafted_tokens_per_s": round(spec.tokens_per_s, 1),
            "speedup": round(spec.tokens_per_s / base.tokens_per_s, 3) if base.tokens_per_s else None,
            "tau": None if spec.counters.tau is None else round(spec.counters.tau, 4),
            "acceptance_per_position": [round(a, 4) for a in spec.counters.acceptance_per_position],
            "drafts": int(spec.counters.drafts), "outputs_equal_target": equal,
        })
    total = sum((p.counters for p in drafted), SpecCounters())
    return {"rows": rows, "tau": total.tau,
            "acceptance_per_position": [round(a, 4) for a in total.acceptance_per_position],
            "all_outputs_equal": all(r["outputs_equal_target"] == r["prompts"] for r in rows)}


def markdown_table(served: dict[str, Any], *, evaluator_tau: float | None = None) -> str:
    lines = ["| concurrency | target-only tokens/s | with drafter tokens/s | speedup | engine tau | outputs equal |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in served["rows"]:
        lines.append(f"| {row['concurrency']} | {row['target_tokens_per_s']:,.0f} | {row['drafted_tokens_per_s']:,.0f} "
                     f"| {row['speedup']}x | {row['tau']} | {row['outputs_equal_target']}/{row['prompts']} |")
    if evaluator_tau is not None:
        lines.append(f"\nOur evaluator's tau on the same prompts: {evaluator_tau:.3f}; the engine's over all passes: "
                     f"{served['tau']:.3f}")
    return "\n".join(lines)
