"""The held-out split: whole conversations chosen at import, per source, whose prompts are never trained on.

A prompt belongs to the conversation named by its id without a turn suffix and a ShareGPT part suffix
(`conversation_key`): ShareGPT cuts a long conversation into records `<id>_0`, `<id>_1`, ..., and a
held-out part whose sibling was trained on would inflate acceptance. Which conversations are held out
depends only on (seed, source, conversation key): each gets a rank from a hash of those, and each source
holds out its lowest-ranked conversations. Adding prompts to a source moves few choices, reordering a file
moves none, and the same seed gives the same split on any machine.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from pydantic import Field, model_validator

from dflash_core.strict import StrictModel

DEFAULT_HOLDOUT_FRACTION = 0.05  # of each source's prompts; at least one conversation of a source of two
# What the split ranks, recorded in every imported prompt set's manifests: a prompt set recorded without it
# was split prompt by prompt (each by its own id), and holds out other prompts than this rule does.
HOLDOUT_RULE = "conversation"
# `<conversation>_<part>` (ShareGPT's cut of a long conversation), then `#t<turn>` (a later user turn alone).
_CONVERSATION_ID = re.compile(r"(?P<key>.+?)(?:_\d+)?(?:#t\d+)?", re.DOTALL)


class HasIdAndSource(Protocol):
    id: str
    source: str


P = TypeVar("P", bound=HasIdAndSource)


class HoldoutSpec(StrictModel):
    """How many prompts of each source to hold out for evaluation, counted in prompts and chosen as whole
    conversations (`split_heldout`): a source holds out the prompts asked for, or more by fewer than the size
    of the last conversation it took; fewer only where that conversation would leave nothing to train on."""

    fraction: float | None = Field(None, ge=0, lt=1, description=(
        f"Share of each source's prompts held out, as whole conversations (rounded; at least one from a "
        f"source of two or more conversations). None (and no count): {DEFAULT_HOLDOUT_FRACTION}. 0 holds none "
        f"out: evaluation then needs prompts of its own."))
    count: int | None = Field(None, ge=0, description=(
        "Or: this many prompts per source, as whole conversations (a conversation of several parts can add "
        "a few more; never all of a source)."))
    seed: int = Field(0, description="Which conversations: the same seed gives the same split.")

    @model_validator(mode="after")
    def _one_rule(self) -> HoldoutSpec:
        if self.count is not None and self.fraction is not None:
            raise ValueError(f"holdout: give a count ({self.count}) or a fraction ({self.fraction}), not both")
        return self

    def per_source(self, num_prompts: int) -> int:
        """How many of a source's `num_prompts` prompts to hold out at least (`split_heldout` takes whole
        conversations); always leaves one to train on."""
        if num_prompts < 2:
            return 0
        if self.count is not None:
            return min(self.count, num_prompts - 1)
        fraction = DEFAULT_HOLDOUT_FRACTION if self.fraction is None else self.fraction
        if fraction == 0:
            return 0
        return min(max(1, round(fraction * num_prompts)), num_prompts - 1)


def conversation_key(prompt_id: str) -> str:
    """The conversation `prompt_id` belongs to: the id without a turn suffix `#t<index>`, then without one
    part suffix `_<digits>` (`QWJhYvA_3#t2` -> `QWJhYvA`). Applied to every source: ids of another source that
    merely end in `_<digits>` (`q_1`, `q_2`) are held out together too, which is harmless (they only stay on
    one side)."""
    return _CONVERSATION_ID.fullmatch(prompt_id)["key"]


def holdout_rank(seed: int, source: str, key: str) -> str:
    """The rank of a conversation (its `conversation_key`) in its source: lowest first is held out first."""
    return hashlib.sha256(f"{seed}\0{source}\0{key}".encode("utf-8", "surrogatepass")).hexdigest()


def heldout_leaks(ids_by_shard: dict[str, list[str | None]], *, heldout_ids: set[str],
                  is_heldout: Callable[[str], bool]) -> list[tuple[str, str]]:
    """(shard, id) of every training-shard line whose id is a held-out prompt's (the given ids and those of
    the held-out shards)."""
    held = heldout_ids | {i for shard, ids in ids_by_shard.items() if is_heldout(shard) for i in ids if i}
    return [(shard, i) for shard, ids in ids_by_shard.items() if not is_heldout(shard) for i in ids if i in held]


def split_heldout(prompts: Sequence[P], spec: HoldoutSpec) -> tuple[list[P], list[P]]:
    """(training, held out), each in the input's order; every conversation whole on one side.

    Per source, conversations are taken in rank order, each with all its prompts, until the source holds out
    `spec.per_source(<its prompts>)`; one that would leave the source nothing to train on is passed over. Rank
    order, not a best fit of sizes: a fit would hold out short conversations more often than long ones."""
    conversations: dict[str, dict[str, list[P]]] = defaultdict(lambda: defaultdict(list))
    for prompt in prompts:
        conversations[prompt.source][conversation_key(prompt.id)].append(prompt)
    held: set[tuple[str, str]] = set()
    for source, by_key in conversations.items():
        num_prompts = sum(map(len, by_key.values()))
        wanted = spec.per_source(num_prompts)
        num_held = 0
        for key in sorted(by_key, key=lambda k: holdout_rank(spec.seed, source, k)):
            if num_held >= wanted:
                break
            if num_held + len(by_key[key]) < num_prompts:
                held |= {(source, p.id) for p in by_key[key]}
                num_held += len(by_key[key])
    train = [p for p in prompts if (p.source, p.id) not in held]
    heldout = [p for p in prompts if (p.source, p.id) in held]
    return train, heldout
