"""Prefect task: tokenize one completion shard into an Arrow shard (+ quarantine), with manifests.

The cache key is everything that decides the output: the input object's ETag, the output key, the
tokenizer's content hash, the tokenize config, the lines dropped as duplicates of earlier shards and
the output schema version. A rerun with nothing changed is a cache hit; a changed shard (new ETag),
config or duplicate list re-tokenizes. The flow refreshes the cache for shards whose output is gone,
so a deleted output is never replayed from a stale cache.

Duplicate ids across shards: `read_completion_ids` reads each shard's ids (cached by ETag), the
flow's `find_duplicates` over them, in shard order, gives each shard its `duplicates`.
"""

from __future__ import annotations

import hashlib
import json

from prefect import task
from prefect.context import TaskRunContext
from pydantic import BaseModel, ConfigDict

from dflash_core.data.verdict import PENDING
from dflash_core.layout import QUARANTINE_SUFFIX, ArtifactKind, manifest_key
from dflash_core.lineage import input_ref, write_artifact
from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore
from dflash_core.tokenize import (
    TargetTokenizer, TokenizeConfig, TokenizePool, arrow_bytes, quarantine_bytes, sample_frame, skipped_frame,
    tokenize_shard,
)
from dflash_core.tokenize.duplicates import Duplicate, line_ids
from dflash_core.tokenize.io import read_arrow_bytes
from dflash_core.tokenize.render import PrefixUnstable
from dflash_core.tokenize.shard import TOKENIZED_SCHEMA_VERSION, StaleDuplicates, TemplateFailed, shard_lines
from tasks.provenance import run_producer
from tasks.retry import retry_unless


class ShardSummary(BaseModel):
    """What the flow needs from one shard, small enough to persist as the task's result."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    input_key: str
    output_key: str
    output_sha256: str
    quarantine_key: str | None
    num_lines: int
    samples: int
    skipped: dict[str, int]
    cpu_seconds: float
    samples_ipc: bytes  # per-sample scalars (stats.sample_frame) as Arrow IPC
    skipped_ipc: bytes  # one row per quarantined / blank line (stats.skipped_frame)


def shard_cache_key(context: TaskRunContext, parameters: dict) -> str:
    store = ObjectStore.from_settings(parameters["settings"])
    target: TargetTokenizer = parameters["target"]
    config: TokenizeConfig = parameters["config"]
    duplicates: dict[int, Duplicate] = parameters.get("duplicates") or {}
    parts = [
        "tokenize-shard", str(TOKENIZED_SCHEMA_VERSION), parameters["input_key"],
        store.head(parameters["input_key"]).etag, parameters["output_key"], target.content_hash,
        config.model_dump_json(),
        json.dumps([[line, d.id, d.first_shard, d.first_line] for line, d in sorted(duplicates.items())]),
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def ids_cache_key(context: TaskRunContext, parameters: dict) -> str:
    store = ObjectStore.from_settings(parameters["settings"])
    parts = ["completion-ids", parameters["input_key"], store.head(parameters["input_key"]).etag,
             str(parameters["max_record_bytes"])]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


@task(retries=3, retry_delay_seconds=[2, 5, 15], cache_key_fn=ids_cache_key, persist_result=True,
      task_run_name="read ids {input_key}")
def read_completion_ids(settings: Settings, *, input_key: str, max_record_bytes: int) -> list[str | None]:
    """The id of each line of a completion shard (None where it cannot be read), without validating the records."""
    data = ObjectStore.from_settings(settings).get_bytes(input_key)
    return line_ids(shard_lines(data), max_record_bytes=max_record_bytes)


# Transient faults (S3, a killed worker) may pass next time; a template or a shard that failed fails again.
retry_unless_the_shard_fails_again = retry_unless(TemplateFailed, PrefixUnstable, StaleDuplicates)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_unless_the_shard_fails_again, cache_key_fn=shard_cache_key,
      persist_result=True, task_run_name="tokenize {input_key}")
def tokenize_completion_shard(settings: Settings, *, input_key: str, output_key: str, target: TargetTokenizer,
                              config: TokenizeConfig, pool: TokenizePool | None = None,
                              duplicates: dict[int, Duplicate] | None = None) -> ShardSummary:
    """Read a completion shard, tokenize it, write the Arrow shard and its quarantine with manifests.

    `duplicates`: this shard's lines whose id an earlier shard has ({line: Duplicate naming that shard's
    key}), quarantined as duplicate_id; repeats within the shard are found here without it.
    """
    store = ObjectStore.from_settings(settings)
    source = input_ref(store, input_key)
    data = store.get_bytes(input_key)
    # Named by URI, as the shard's own repeats are.
    drops = {line: Duplicate(d.id, store.uri(d.first_shard), d.first_line) for line, d in (duplicates or {}).items()}
    result = tokenize_shard(data, target=target, config=config, pool=pool, name=source.uri, duplicates=drops)
    run_config = {"tokenizer": target.name, "tokenizer_sha256": target.content_hash,
                  "tokenize": config.model_dump(mode="json"), "schema_version": TOKENIZED_SCHEMA_VERSION}
    # Judged with the whole dataset by the flow's gate, which writes the verdict into dataset.json beside it.
    payload = arrow_bytes(result.table, metadata={"dflash.tokenizer_sha256": target.content_hash,
                                                  "dflash.tokenize_config": config.model_dump_json(),
                                                  "dflash.input_uri": source.uri, **PENDING.arrow_metadata()})
    producer = run_producer()
    manifest = write_artifact(store, output_key, payload, kind=ArtifactKind.TOKENIZED, inputs=[source],
                              config={**run_config, "skipped": dict(result.skipped)}, producer=producer)
    quarantine_key = output_key + QUARANTINE_SUFFIX
    if result.quarantine:
        write_artifact(store, quarantine_key, quarantine_bytes(result.quarantine), kind=ArtifactKind.TOKENIZED,
                       inputs=[source], config={**run_config, "quarantine_of": source.uri}, producer=producer)
    elif store.exists(quarantine_key):
        store.delete_many([quarantine_key, manifest_key(quarantine_key)])  # stale from an earlier run
    shard = output_key.rsplit("/", 1)[-1]
    samples = sample_frame(result.table, shard=shard)
    skipped = skipped_frame(result.quarantine, shard=shard, blank_lines=result.skipped.get("blank_line", 0))
    return ShardSummary(
        input_key=input_key, output_key=output_key, output_sha256=manifest.sha256,
        quarantine_key=quarantine_key if result.quarantine else None, num_lines=result.num_lines,
        samples=result.table.num_rows, skipped=dict(result.skipped), cpu_seconds=result.cpu_seconds,
        samples_ipc=arrow_bytes(samples.to_arrow()), skipped_ipc=arrow_bytes(skipped.to_arrow()),
    )


def summary_frames(summary: ShardSummary):
    """(samples, skipped) polars frames back from a persisted summary."""
    import polars as pl

    return (pl.from_arrow(read_arrow_bytes(summary.samples_ipc)),
            pl.from_arrow(read_arrow_bytes(summary.skipped_ipc)))
