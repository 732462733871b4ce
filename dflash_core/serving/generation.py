"""Generate one completion shard from one prompt shard, resumably.

Each answered prompt is appended to a local partial file at once and the partial file is copied
to S3 (`<output>.partial`) every `checkpoint_every` answers, so a run killed at any point resumes
where it stopped, on this node or another. The shard is final when every prompt has an answer or a
recorded failure: the JSONL goes to S3 with its manifest (input: the prompt shard), failures beside
it (`<output>.failures.jsonl`); a rerun retries only the failed prompts. A shard with no answer at
all is not registered (no object, no manifest): nothing downstream mistakes it for data.
`failure_verdict` says whether a run's failed fraction is past what its caller accepts.

In a generation across nodes each shard is dealt to one node's share run: the generate run records the deal in
`<output>.assignment.json` (`assign_shard`) before it starts the share, and deletes it when the node is lost (the
next wave deals it again). That share writes through `fenced_for`: every write of the shard asks first whether
the shard is still dealt to it (`ShardNotAssigned` when not) and is stamped with its deal, so a write that raced
the move is found (`stored_by_another`) and left out of the merge.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_core.data.completion import CompletionRecord
from dflash_core.data.prompts import read_prompt_lines
from dflash_core.layout import ArtifactKind, manifest_key
from dflash_core.lineage import input_ref, read_manifest, write_artifact
from dflash_core.provenance import Producer
from dflash_core.serving.client import ClientConfig, FailedPrompt, SamplingParams, complete_all
from dflash_core.storage import ObjectNotFound, ObjectStore, StoreError

PARTIAL_SUFFIX = ".partial"
MAX_NAMED_FAILURES = 20  # failed prompt ids a verdict names; every one is in <shard>.failures.jsonl
FAILURES_SUFFIX = ".failures.jsonl"
ASSIGNMENT_SUFFIX = ".assignment.json"
DEAL_METADATA_KEY = "shard-deal"  # user metadata the fence stamps on every object a node share writes


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


class ShardNotAssigned(StoreError):
    """A write for a shard that is no longer dealt to this node's share (its node was declared lost and the shard
    went to another): refused for good, retrying cannot help."""


@dataclass(frozen=True)
class ShardAssignment:
    """The node share a shard is dealt to: the node, and the deal (the share run's idempotency key: one per node,
    attempt and wave of the generate run)."""

    node: str
    deal: str


def assign_shard(store: ObjectStore, output_key: str, assignment: ShardAssignment) -> None:
    store.put_bytes(output_key + ASSIGNMENT_SUFFIX, json.dumps(asdict(assignment)).encode(),
                    content_type="application/json")


def revoke_shard(store: ObjectStore, output_key: str) -> None:
    """Deal the shard to nobody: every share's write of it is refused until it is dealt again."""
    store.delete(output_key + ASSIGNMENT_SUFFIX)


def assignment_of(store: ObjectStore, output_key: str) -> ShardAssignment | None:
    try:
        return ShardAssignment(**json.loads(store.get_bytes(output_key + ASSIGNMENT_SUFFIX)))
    except ObjectNotFound:
        return None


def fenced_for(store: ObjectStore, output_key: str, assignment: ShardAssignment) -> ObjectStore:
    """`store` whose every write (each HTTP attempt) first checks that the shard is still dealt to `assignment`, and
    stamps its deal on each object written (`deal_of`)."""
    # `in_flight_s` goes unused: a deal has no expiry to land before. A write sent just before the deal moved that
    # lands after it carries the old deal's stamp, which `stored_by_another` finds.
    def still_dealt(key: str, *, in_flight_s: float) -> dict[str, str]:
        current = assignment_of(store, output_key)
        if current != assignment:
            now = f"to node {current.node} ({current.deal})" if current else "to no node"
            raise ShardNotAssigned(f"not writing {store.uri(key)}: {store.uri(output_key)} is dealt {now}, no longer "
                                   f"to node {assignment.node} ({assignment.deal}), which was declared lost")
        return {DEAL_METADATA_KEY: assignment.deal}

    return store.fenced(still_dealt)


def deal_of(store: ObjectStore, key: str) -> str | None:
    """The deal stamped on the object at `key` by the share that wrote it (None: no object, or not a share's)."""
    try:
        return store.head(key).metadata.get(DEAL_METADATA_KEY)
    except ObjectNotFound:
        return None


def stored_by(store: ObjectStore, output_key: str) -> str | None:
    """The deal of the share that stored the shard, its data and its manifest both (None: no whole shard stored
    by one share)."""
    deal = deal_of(store, output_key)
    return deal if deal is not None and deal_of(store, manifest_key(output_key)) == deal else None


def stored_by_another(store: ObjectStore, output_key: str) -> bool:
    """True when the stored shard or its manifest was written by another share than the one it is dealt to: a
    write of a lost node that got past the fence just before the shard was dealt again."""
    assignment = assignment_of(store, output_key)
    return assignment is not None and any(
        store.exists(key) and deal_of(store, key) != assignment.deal for key in (output_key, manifest_key(output_key)))


def stored_outcome(store: ObjectStore, output_key: str) -> ShardOutcome:
    """A stored shard's counts as its manifest records them (for a run that stored it but never reported)."""
    config = read_manifest(store, output_key).config
    prompts, failed = config["prompts"], config.get("failed", 0)
    return ShardOutcome(output_key, prompts, prompts - failed, failed, config.get("generated_now", prompts - failed),
                        config.get("completion_tokens_now", 0))


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
                   on_result: Callable[[CompletionRecord | FailedPrompt], None] | None = None,
                   assignment: ShardAssignment | None = None) -> ShardOutcome:
    """`assignment`: the node share this shard is dealt to; every write is then fenced by it (`fenced_for`), and a
    shard another share stored is written again under this one (its answers kept)."""
    prompts = read_prompt_lines(store.get_bytes(prompt_key))
    failures_key = output_key + FAILURES_SUFFIX
    config = _work_config(target, len(prompts))
    prompt_ref = input_ref(store, prompt_key)
    same_work = _made_from(store, output_key, prompt_ref.sha256, config)
    ours = assignment is None or stored_by(store, output_key) == assignment.deal
    if same_work and ours and not store.exists(failures_key):
        return ShardOutcome(output_key, len(prompts), len(prompts), 0, 0, 0, skipped=True)
    writer = fenced_for(store, output_key, assignment) if assignment is not None else store

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
                        writer.put_file(output_key + PARTIAL_SUFFIX, local_partial)
                else:
                    failures.append(result)
                if on_result is not None:
                    on_result(result)

    if remaining:
        asyncio.run(run())
    body = b"".join(done[prompt.id] for prompt in prompts if prompt.id in done)
    made = {"failed": len(failures), "generated_now": new, "completion_tokens_now": tokens}
    if body:
        write_artifact(writer, output_key, body, kind=ArtifactKind.COMPLETIONS, inputs=[prompt_ref],
                       config={**config, **made}, producer=producer)
    else:  # no answer at all: no shard, and no stale one from an earlier run either
        writer.delete_many([k for k in (output_key, output_key + ".manifest.json") if store.exists(k)])
    if failures:
        lines = b"".join(f.model_dump_json().encode() + b"\n" for f in failures)
        write_artifact(writer, failures_key, lines, kind=ArtifactKind.REPORT, inputs=[prompt_ref],
                       config=config, producer=producer)
    else:
        writer.delete_many([k for k in (failures_key, failures_key + ".manifest.json") if store.exists(k)])
    writer.delete_many([k for k in (output_key + PARTIAL_SUFFIX,) if store.exists(k)])
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
