"""Prefect task: refuse training data whose quality gate failed or is unknown, before any process starts."""

from __future__ import annotations

import warnings

from prefect import get_run_logger, task

from dflash_core.settings import Settings
from dflash_core.stage_results import StoredShard
from dflash_core.storage import ObjectStore
from dflash_core.train.config import TrainConfig
from tasks.retry import retry_store_outage


@task
def check_training_data(settings: Settings, config: TrainConfig) -> int:
    """Every shard's verdict (downloading into the cache the trainer reads); the number of shards.

    Not retried: a verdict does not change by waiting. The trainer checks again in every process."""
    from dflash_core.train.inputs import fetch_shards  # imports torch, which the pipeline's process does not need

    store = ObjectStore.from_settings(settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shards = fetch_shards(config.data, store=store, cache_dir=config.run_dir.parent / ".cache",
                              allow_failed_quality_gate=config.allow_failed_quality_gate)
    for warning in caught:
        get_run_logger().warning(str(warning.message))
    return len(shards)


class ShardChanged(ValueError):
    """A shard's bytes in the bucket are not the ones its dataset record names."""


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def verify_shards(settings: Settings, shards: list[StoredShard]) -> None:
    """Every shard is in the bucket with the sha256 its dataset record names (so a run trains on exactly
    what its tokenize stage made); one error listing those that are missing or changed."""
    store = ObjectStore.from_settings(settings)
    problems = []
    for shard in shards:
        key = store.key_of(shard.uri)
        if not store.exists(key):
            problems.append(f"{shard.uri} is gone")
            continue
        found = store.head(key).sha256
        if found != shard.sha256:
            problems.append(f"{shard.uri} has sha256 {found}, not {shard.sha256}")
    if problems:
        raise ShardChanged(f"{len(problems)} of {len(shards)} training shards are not what the tokenize result names "
                           f"({'; '.join(problems[:5])}): rerun the tokenize stage and train on its new result")
