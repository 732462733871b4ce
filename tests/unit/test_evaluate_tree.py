"""DDTree construction and path acceptance, on hand-made distributions.

Run: .venv/bin/python -m pytest tests/unit/test_evaluate_tree.py -q
"""

import math

import pytest
import torch

from dflash_core.evaluate.tree import DraftTree, accepted_path, build_draft_tree


def _logits(rows):
    """Per-position log-probabilities given as {token: prob} dicts over a 6-token vocabulary."""
    out = torch.full((len(rows), 6), -1e9)
    for depth, probs in enumerate(rows):
        for token, p in probs.items():
            out[depth, token] = math.log(p)
    return out


def test_best_first_tree_takes_the_most_likely_paths_under_the_budget():
    logits = _logits([{1: 0.6, 2: 0.4}, {3: 0.9, 4: 0.1}, {5: 1.0}])
    tree = build_draft_tree(logits, root_token=0, budget=4, max_branch=2)
    # Scores: [1]=.6, [1,3]=.54, [2]=.4, [2,3]=.36, [1,3,5]=.54 -> best four: 1, 13, 135, 2.
    paths = set()
    for node in range(1, len(tree.tokens)):
        path, cur = [], node
        while cur > 0:
            path.append(tree.tokens[cur])
            cur = tree.parents[cur]
        paths.add(tuple(reversed(path)))
    assert paths == {(1,), (1, 3), (1, 3, 5), (2,)}
    assert tree.num_nodes == 4
    assert all(tree.parents[n] < n for n in range(1, len(tree.tokens)))  # topological order
    assert all(tree.depths[n] == tree.depths[tree.parents[n]] + 1 for n in range(1, len(tree.tokens)))


def test_budget_of_depth_with_one_branch_is_the_plain_block():
    logits = torch.randn(5, 50)
    tree = build_draft_tree(logits, root_token=7, budget=5, max_branch=1)
    assert tree.tokens[1:] == logits.argmax(-1).tolist()
    assert tree.parents == [-1, 0, 1, 2, 3, 4]


def test_ancestor_mask_sees_only_ancestors_and_self():
    tree = DraftTree(tokens=[0, 1, 2, 3, 4], parents=[-1, 0, 0, 1, 3], depths=[0, 1, 1, 2, 3])
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)


def test_accepted_path_follows_the_targets_greedy_choices():
    tree = DraftTree(tokens=[9, 1, 2, 3, 4], parents=[-1, 0, 0, 2, 3], depths=[0, 1, 1, 2, 3])
    # Target after root -> 2 (node 2), after node 2 -> 3 (node 3), after node 3 -> 5 (no such child).
    assert accepted_path(tree, [2, 0, 3, 5, 0]) == [2, 3]
    assert accepted_path(tree, [7, 0, 0, 0, 0]) == []


def test_bad_budget_is_a_value_error():
    with pytest.raises(ValueError, match="budget"):
        build_draft_tree(torch.randn(3, 8), root_token=0, budget=0)
