"""Generate one completion shard from one prompt shard, resumably.

Each answered prompt is appended to a local partial file at once and the partial file is copied
to S3 (`<output>.partial`) every `checkpoint_every` answers, so a run killed at any point resumes
where it stopped, on this node or another. The shard is final when every prompt has an answer or a
recorded failure: the JSONL goes to S3 with its manifest (input: the prompt shard), failures beside
it (`<output>.failures.jsonl`); a rerun retries only the failed prompts. A shard with no answer at
all is not registered (no object, no manifest): nothing downstream mistakes it for data.
`failure_verdict` says whether a run's failed fraction is past what its caller accepts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.data.completion import CompletionRecord
from dflash_core.data.prompts import read_prompt_lines
from dflash_core.layout import ArtifactKind
from dflash_core.lineage import input_ref, read_manifest, write_artifact
from dflash_core.provenance import Producer
from dflash_core.serving.client import ClientConfig, FailedPrompt, SamplingParams, complete_all
from dflash_core.storage import ObjectNotFound, ObjectStore

PARTIAL_SUFFIX = ".partial"
MAX_NAMED_FAILURES = 20  # failed prompt ids a verdict names; every one is in <shard>.failures.jsonl
FAILURES_SUFFIX = ".failures.jsonl"


@dataclass
class ShardOutcome:
    output_key: str
    prompts: int
    completed: int
    failed: int
    generated_now: int
    completion_tokens_now: int
    skipped: bool = False
    first_errors: list[str] = field(default_factory=list)  # "<prompt id>: <error>", at most 3
    failed_ids: list[str] = field(default_factory=list)  # every failed prompt's id, in prompt order


class GenerationFailed(RuntimeError):
    """More prompts failed than the run accepts; the message gives the counts and the first errors."""


def failure_verdict(outcomes: list[ShardOutcome], *, max_failed_fraction: float) -> str | None:
    """None when nothing failed; a warning line when the failed fraction is within `max_failed_fraction`;
    raises `GenerationFailed` past it."""
    prompts = sum(o.prompts for o in outcomes)
    failed = sum(o.failed for o in outcomes)
    if not failed:
        return None
    errors = [error for o in outcomes for error in o.first_errors][:3]
    empty = [o.output_key for o in outcomes if o.prompts and o.completed == 0]
    # getattr: an outcome restored from Prefect's result cache may lack failed_ids.
    ids = [id_ for o in outcomes for id_ in getattr(o, "failed_ids", [])]
    named = (f"; failed prompts: {', '.join(ids[:MAX_NAMED_FAILURES])}"
             + (f" (+{len(ids) - MAX_NAMED_FAILURES} more)" if len(ids) > MAX_NAMED_FAILURES else "")) if ids else ""
    line = (f"{failed} of {prompts} prompts failed ({failed / max(1, prompts):.1%}; max_failed_fraction "
            f"{max_failed_fraction:.1%}) in {sum(1 for o in outcomes if o.failed)} shard(s); first errors: "
            + "; ".join(errors) + named
            + (f"; shards without any answer (not registered): {', '.join(empty)}" if empty else "")
            + ". Each shard's failures are in <shard>.failures.jsonl; rerunning the flow retries only those.")
    if failed / max(1, prompts) > max_failed_fraction:
        raise GenerationFailed(line)
    return line


@dataclass
class GenerationTarget:
    """Where and how to generate: endpoints, the model name requests carry, sampling, client limits."""

    urls: list[str]
    model: str
    server: str
    sampling: SamplingParams
    client: ClientConfig
    api_key: str | None = None


def _work_config(target: GenerationTarget, num_prompts: int) -> dict:
    """What makes two generations of a shard the same work (not where the servers run)."""
    return {"model": target.model, "server": target.server, "sampling": target.sampling.model_dump(mode="json"),
            "prompts": num_prompts}


def shard_is_done(store: ObjectStore, *, prompt_key: str, output_key: str, target: GenerationTarget) -> bool:
    """True when `output_key` holds every answer for these prompts with this model and sampling."""
    if not store.exists(output_key) or store.exists(output_key + FAILURES_SUFFIX):
        return False
    prompts = read_prompt_lines(store.get_bytes(prompt_key))
    return _made_from(store, output_key, input_ref(store, prompt_key).sha256, _work_config(target, len(prompts)))


def generate_shard(store: ObjectStore, *, prompt_key: str, output_key: str, target: GenerationTarget,
                   scratch_dir: Path, producer: Producer | None = None, checkpoint_every: int = 64,
                   on_result: Callable[[CompletionRecord | FailedPrompt], None] | None = None) -> ShardOutcome:
    prompts = read_prompt_lines(store.get_bytes(prompt_key))
    failures_key = output_key + FAILURES_SUFFIX
    config = _work_config(target, len(prompts))
    prompt_ref = input_ref(store, prompt_key)
    same_work = _made_from(store, output_key, prompt_ref.sha256, config)
    if same_work and not store.exists(failures_key):
        return ShardOutcome(output_key, len(prompts), len(prompts), 0, 0, 0, skipped=True)

    wanted = {prompt.id for prompt in prompts}
    # Answers of an earlier run count only when they came from the same prompts, model and sampling.
    done = _answered(store, output_key, wanted) if same_work else {}
    local_partial = Path(scratch_dir) / (output_key.replace("/", "__") + PARTIAL_SUFFIX)
    local_partial.parent.mkdir(parents=True, exist_ok=True)
    if len(wanted) != len(prompts):
        raise ValueError(f"{store.uri(prompt_key)} repeats prompt ids: every prompt needs its own id")
    for source in (_read_local(local_partial), _read_remote(store, output_key + PARTIAL_SUFFIX)):
        # A partial file left by a run with another model or sampling is not this run's work.
        done.update({id_: line for id_, line in _parse_lines(source, made_by=target).items() if id_ in wanted})
    _rewrite(local_partial, done)

    remaining = [prompt for prompt in prompts if prompt.id not in done]
    failures: list[FailedPrompt] = []
    new = tokens = 0

    async def run() -> None:
        nonlocal new, tokens
        with open(local_partial, "ab") as partial:
            async for result in complete_all(remaining, urls=target.urls, model=target.model, server=target.server,
                                             sampling=target.sampling, config=target.client,
                                             api_key=target.api_key):
                if isinstance(result, CompletionRecord):
                    line = result.to_json_line()
                    partial.write(line)
                    partial.flush()
                    done[result.id] = line
                    new += 1
                    tokens += result.generation.completion_tokens or 0
                    if new % checkpoint_every == 0:
                        store.put_file(output_key + PARTIAL_SUFFIX, local_partial)
                else:
                    failures.append(result)
                if on_result is not None:
                    on_result(result)

    if remaining:
        asyncio.run(run())
    body = b"".join(done[prompt.id] for prompt in prompts if prompt.id in done)
    if body:
        write_artifact(store, output_key, body, kind=ArtifactKind.COMPLETIONS, inputs=[prompt_ref],
                       config={**config, "failed": len(failures)}, producer=producer)
    else:  # no answer at all: no shard, and no stale one from an earlier run either
        store.delete_many([k for k in (output_key, output_key + ".manifest.json") if store.exists(k)])
    if failures:
        lines = b"".join(f.model_dump_json().encode() + b"\n" for f in failures)
        write_artifact(store, failures_key, lines, kind=ArtifactKind.REPORT, inputs=[prompt_ref],
                       config=config, producer=producer)
    else:
        store.delete_many([k for k in (failures_key, failures_key + ".manifest.json") if store.exists(k)])
    store.delete_many([k for k in (output_key + PARTIAL_SUFFIX,) if store.exists(k)])
    local_partial.unlink(missing_ok=True)
    failed_ids = {f.id for f in failures}
    return ShardOutcome(output_key, len(prompts), len(prompts) - len(failures), len(failures), new, tokens,
                        first_errors=[f"{f.id}: {f.error[:200]}" for f in failures[:3]],
                        failed_ids=[prompt.id for prompt in prompts if prompt.id in failed_ids])


def _made_from(store: ObjectStore, output_key: str, prompt_sha256: str | None, config: dict) -> bool:
    """True when `output_key` exists and its manifest says it came from these prompts with this config."""
    try:
        manifest = read_manifest(store, output_key)
    except ObjectNotFound:
        return False
    recorded = {key: manifest.config.get(key) for key in config}
    return (store.exists(output_key) and [ref.sha256 for ref in manifest.inputs] == [prompt_sha256]
            and recorded == config)


def _answered(store: ObjectStore, output_key: str, wanted: set[str]) -> dict[str, bytes]:
    """Answers already in a final shard (one that still has failures to retry)."""
    try:
        data = store.get_bytes(output_key)
    except ObjectNotFound:
        return {}
    return {id_: line for id_, line in _parse_lines(data).items() if id_ in wanted}


def _read_local(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _read_remote(store: ObjectStore, key: str) -> bytes:
    try:
        return store.get_bytes(key)
    except ObjectNotFound:
        return b""


def _parse_lines(data: bytes, *, made_by: GenerationTarget | None = None) -> dict[str, bytes]:
    """id -> line for every complete, valid record line (a line cut by a crash is ignored); with
    `made_by`, only records generated with that target's model and sampling."""
    answered: dict[str, bytes] = {}
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            continue
        try:
            record = CompletionRecord.model_validate_json(line)
        except ValueError:
            continue
        if made_by is None or _generated_with(record, made_by):
            answered.setdefault(record.id, line)
    return answered


def _generated_with(record: CompletionRecord, target: GenerationTarget) -> bool:
    meta, sampling = record.generation, target.sampling
    return (meta.model, meta.server, meta.enable_thinking, meta.temperature, meta.top_p, meta.max_tokens,
            meta.seed) == (target.model, target.server, sampling.enable_thinking, sampling.temperature,
                           sampling.top_p, sampling.max_tokens, sampling.seed)


def _rewrite(path: Path, done: dict[str, bytes]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(b"".join(done.values()))
    tmp.replace(path)


def failures_of(store: ObjectStore, output_key: str) -> list[FailedPrompt]:
    try:
        data = store.get_bytes(output_key + FAILURES_SUFFIX)
    except ObjectNotFound:
        return []
    return [FailedPrompt.model_validate(json.loads(line)) for line in data.splitlines() if line.strip()]
