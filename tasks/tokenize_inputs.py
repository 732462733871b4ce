"""What the tokenize flow reads before it tokenizes: the completions record (as given, from a result.json, or
listed from a completion run's prefix) and the check that no training shard holds a held-out prompt."""

from __future__ import annotations

from dflash_core.data.holdout import heldout_leaks
from dflash_core.layout import completion_run_of, is_completion_shard, is_heldout_key
from dflash_core.stage_results import CompletionsDataset, StoredShard
from dflash_core.storage import ObjectStore, sha256_bytes
from tasks.results import resolve_result


class HeldOutLeak(ValueError):
    """A training shard holds a prompt id of the held-out split."""


def resolve_completions(settings, value: CompletionsDataset | str) -> CompletionsDataset:
    """The completions record: as given, read from a result.json, or listed from a completion run's prefix."""
    if isinstance(value, str) and value.endswith("/"):
        return completions_from_prefix(settings, value)
    return resolve_result(settings, value, CompletionsDataset)


def completions_from_prefix(settings, uri: str) -> CompletionsDataset:
    """A completion run's shards (training and held-out) listed under `uri`, with their hashes."""
    store = ObjectStore.from_settings(settings)
    prefix = store.key_of(uri)
    dataset, run = completion_run_of(settings.s3_prefixes, prefix)
    keys = sorted((i.key for i in store.list(prefix) if is_completion_shard(i.key)),
                  key=lambda key: (is_heldout_key(key), key))
    if not keys:
        raise ValueError(f"no completion shards under {store.uri(prefix)}: run the generate stage first")
    shards = [StoredShard(uri=store.uri(key), sha256=store.head(key).sha256 or sha256_bytes(store.get_bytes(key)),
                          split="heldout" if is_heldout_key(key) else "train") for key in keys]
    # The held-out ids are read with every shard's ids by the flow: no second download here.
    return CompletionsDataset(dataset=dataset, run=run, shards=shards)


def check_no_heldout_in_training(ids: dict[str, list[str | None]], *, heldout_ids: set[str]) -> None:
    """Refuse, before anything is written, a training shard that holds a held-out prompt id (the drafter would
    be measured on what it learned)."""
    leaked = heldout_leaks(ids, heldout_ids=heldout_ids, is_heldout=is_heldout_key)
    if leaked:
        examples = ", ".join(f"{prompt_id} in {shard.rsplit('/', 1)[-1]}" for shard, prompt_id in leaked[:5])
        raise HeldOutLeak(f"{len(leaked)} training samples have held-out prompt ids ({examples}): the held-out "
                          f"split must never be trained on; give those prompts new ids or re-import with a holdout "
                          f"that keeps them apart")
