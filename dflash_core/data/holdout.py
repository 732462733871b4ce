"""The held-out split: prompts chosen at import, per source and by prompt id, that are never trained on.

Which prompts are held out depends only on (seed, source, id): each prompt gets a rank from a hash
of those, and the lowest-ranked ones of each source are held out. Adding prompts to a source moves
few choices, reordering a file moves none, and the same seed gives the same split on any machine.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from pydantic import Field, model_validator

from dflash_core.strict import StrictModel

DEFAULT_HOLDOUT_FRACTION = 0.05  # of each source's prompts; at least one per source of two or more


class HasIdAndSource(Protocol):
    id: str
    source: str


P = TypeVar("P", bound=HasIdAndSource)


class HoldoutSpec(StrictModel):
    """How many prompts of each source to hold out for evaluation."""

    fraction: float | None = Field(None, ge=0, lt=1, description=(
        f"Share of each source's prompts held out (rounded; at least one from a source of two or more). None "
        f"(and no count): {DEFAULT_HOLDOUT_FRACTION}. 0 holds none out: evaluation then needs prompts of its own."))
    count: int | None = Field(None, ge=0, description="Or: exactly this many per source (at most all but one).")
    seed: int = Field(0, description="Which prompts: the same seed gives the same split.")

    @model_validator(mode="after")
    def _one_rule(self) -> HoldoutSpec:
        if self.count is not None and self.fraction is not None:
            raise ValueError(f"holdout: give a count ({self.count}) or a fraction ({self.fraction}), not both")
        return self

    def per_source(self, num_prompts: int) -> int:
        """How many of a source's `num_prompts` prompts to hold out; always leaves one to train on."""
        if num_prompts < 2:
            return 0
        if self.count is not None:
            return min(self.count, num_prompts - 1)
        fraction = DEFAULT_HOLDOUT_FRACTION if self.fraction is None else self.fraction
        if fraction == 0:
            return 0
        return min(max(1, round(fraction * num_prompts)), num_prompts - 1)


def holdout_rank(seed: int, source: str, prompt_id: str) -> str:
    return hashlib.sha256(f"{seed}\0{source}\0{prompt_id}".encode("utf-8", "surrogatepass")).hexdigest()


def heldout_leaks(ids_by_shard: dict[str, list[str | None]], *, heldout_ids: set[str],
                  is_heldout: Callable[[str], bool]) -> list[tuple[str, str]]:
    """(shard, id) of every training-shard line whose id is a held-out prompt's (the given ids and those of
    the held-out shards)."""
    held = heldout_ids | {i for shard, ids in ids_by_shard.items() if is_heldout(shard) for i in ids if i}
    return [(shard, i) for shard, ids in ids_by_shard.items() if not is_heldout(shard) for i in ids if i in held]


def split_heldout(prompts: Sequence[P], spec: HoldoutSpec) -> tuple[list[P], list[P]]:
    """(training, held out), each in the input's order."""
    by_source: dict[str, list[P]] = defaultdict(list)
    for prompt in prompts:
        by_source[prompt.source].append(prompt)
    held: set[tuple[str, str]] = set()
    for source, members in by_source.items():
        ranked = sorted(members, key=lambda p: holdout_rank(spec.seed, source, p.id))
        held |= {(source, p.id) for p in ranked[:spec.per_source(len(members))]}
    train = [p for p in prompts if (p.source, p.id) not in held]
    heldout = [p for p in prompts if (p.source, p.id) in held]
    return train, heldout
