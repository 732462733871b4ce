"""Which node answers which prompt shards when one generation runs on several nodes: a deterministic split in
proportion to each node's server instances, and the check that a set of shares answers every shard once.

`split_by_weight` deals the shards in their order, each to the node furthest below its proportional share
(the smallest (shards so far + 1) / weight; ties to the node listed first), so the same shards and nodes
always give the same split, each node's count is within one shard of its exact quota, and the held-out
shards at the end spread over the nodes like the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def split_by_weight(items: Sequence[str], weights: Mapping[str, int]) -> dict[str, list[str]]:
    """Each of `items`, in order, to one name of `weights` (name -> positive weight), in proportion to the
    weights; every name appears in the result, in the order of `weights`."""
    if not weights:
        raise ValueError("no node to give the prompt shards to")
    bad = {name: weight for name, weight in weights.items() if weight <= 0}
    if bad:
        raise ValueError(f"every node needs a positive weight (its server instances); got {bad}")
    if len(set(items)) != len(items):
        raise ValueError(f"a prompt shard is listed twice: {sorted({i for i in items if list(items).count(i) > 1})}")
    order = list(weights)
    shares: dict[str, list[str]] = {name: [] for name in order}
    for item in items:
        name = min(order, key=lambda n: ((len(shares[n]) + 1) / weights[n], order.index(n)))
        shares[name].append(item)
    return shares


def check_shares(items: Sequence[str], shares: Mapping[str, Sequence[str]]) -> None:
    """Raise ValueError unless every item is in exactly one share and no share holds anything else."""
    owners: dict[str, list[str]] = {}
    for name, share in shares.items():
        for item in share:
            owners.setdefault(item, []).append(name)
    twice = {item: names for item, names in owners.items() if len(names) > 1}
    missing = [item for item in items if item not in owners]
    extra = [item for item in owners if item not in set(items)]
    problems = ([f"given to more than one node: {twice}"] if twice else []) + \
        ([f"given to no node: {missing}"] if missing else []) + ([f"not among the shards: {extra}"] if extra else [])
    if problems:
        raise ValueError("the prompt shards' split is wrong: " + "; ".join(problems))
