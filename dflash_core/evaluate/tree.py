"""DDTree: a draft tree from the drafter's per-position distributions, verified in one target pass.

One drafter pass gives independent distributions for block positions 1..B-1. The tree is grown
best-first under a node budget: a node is a token sequence (t_1..t_d), scored by the sum of its
per-position log-probabilities; expanding the best frontier node adds it to the tree and puts on
the frontier its first child (best token at depth d+1) and its next sibling (next-ranked token at
depth d). Parents always enter before their children, so the node order is a valid topological
order for the verify pass, whose mask lets each node see only its ancestors and itself.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch


@dataclasses.dataclass
class DraftTree:
    """Nodes 1..M below a root (index 0, the last accepted token). tokens/parents/depths: [M+1]."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1

    def ancestor_mask(self) -> torch.Tensor:
        """[M+1, M+1] bool: row i sees column j iff j is i or an ancestor of i."""
        size = len(self.tokens)
        mask = torch.zeros(size, size, dtype=torch.bool)
        for node in range(size):
            mask[node, node] = True
            parent = self.parents[node]
            if parent >= 0:
                mask[node] |= mask[parent]
        return mask


def build_draft_tree(logits_DV: torch.Tensor, *, root_token: int, budget: int, max_branch: int = 8) -> DraftTree:
    """Best-first tree of at most `budget` nodes from per-position logits [D, V] (depth d uses row d-1).

    `max_branch` bounds how many ranked tokens per depth are considered (the top-k is all a
    best-first tree of a modest budget can reach). A budget of D with max_branch 1 is the plain block.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    depth_max = logits_DV.shape[0]
    branch = min(max_branch, logits_DV.shape[1])
    top = torch.log_softmax(logits_DV.float(), dim=-1).topk(branch, dim=-1)
    ranked_logp = top.values.tolist()  # [D][branch], descending
    ranked_tok = top.indices.tolist()
    tree = DraftTree(tokens=[root_token], parents=[-1], depths=[0])
    # Frontier entries: (-score, tie, parent_index, depth, rank, parent_score).
    frontier = [(-ranked_logp[0][0], 0, 0, 1, 0, 0.0)]
    tie = 1
    while frontier and tree.num_nodes < budget:
        neg_score, _, parent, depth, rank, parent_score = heapq.heappop(frontier)
        node = len(tree.tokens)
        tree.tokens.append(ranked_tok[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        score = -neg_score
        if rank + 1 < branch:  # next sibling: same parent, next-ranked token at this depth
            heapq.heappush(frontier, (-(parent_score + ranked_logp[depth - 1][rank + 1]), tie, parent, depth,
                                      rank + 1, parent_score))
            tie += 1
        if depth < depth_max:  # first child: best token one level deeper
            heapq.heappush(frontier, (-(score + ranked_logp[depth][0]), tie, node, depth + 1, 0, score))
            tie += 1
    return tree


def accepted_path(tree: DraftTree, target_next_M1: list[int]) -> list[int]:
    """Node indices (excluding the root) of the longest path whose every token equals the target's
    greedy choice after its parent; `target_next_M1[i]` is the target's argmax after node i."""
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tree.tokens)):
        children.setdefault(tree.parents[node], {}).setdefault(tree.tokens[node], node)
    path, node = [], 0
    while True:
        child = children.get(node, {}).get(target_next_M1[node])
        if child is None:
            return path
        path.append(child)
        node = child
