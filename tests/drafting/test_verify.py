"""The verify walk (drafting.verify.accept_paths): literal chains and trees, and random steps
against a plain per-row walk (drafting.tree.accept_tree)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_plookup.drafting.tree import accept_tree
from hf_plookup.drafting.verify import accept_paths, chain_parents


def test_chain_literal():
    # drafts [5, 6, 7]: the root emits 5, draft 1 emits 6, draft 2 emits 9 (not 7): two accepted, next 9
    accepted, paths, final = accept_paths(np.array([5, 6, 9, 8]), np.array([0]), np.array([3]),
                                          np.array([[5, 6, 7]]), chain_parents(3)[None])
    assert accepted.tolist() == [2] and paths.tolist() == [[1, 2, -1]] and final.tolist() == [9]


def test_tree_literal_two_rows():
    # row 0: root -> {1: 4, 2: 5}, 2 -> {3: 6}; the root emits 5, node 2 emits 6, node 3 emits 1
    # row 1 (fed after row 0's 4 rows): a prompt's last chunk, no drafts: emits its target 7
    targets = np.array([5, 0, 6, 1, 7])
    drafts = np.array([[4, 5, 6], [0, 0, 0]])
    parents = np.array([[0, 0, 2], [-1, -1, -1]])
    accepted, paths, final = accept_paths(targets, np.array([0, 4]), np.array([3, 0]), drafts, parents)
    assert accepted.tolist() == [2, 0]
    assert paths.tolist() == [[2, 3, -1], [-1, -1, -1]]
    assert final.tolist() == [1, 7]


def test_no_rows():
    accepted, paths, final = accept_paths(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                          np.zeros((0, 4), np.int64), np.zeros((0, 4), np.int64))
    assert accepted.shape == (0,) and paths.shape == (0, 4) and final.shape == (0,)


@pytest.mark.parametrize("seed", range(20))
def test_matches_plain_walk(seed):
    rng = np.random.default_rng(seed)
    s, k = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    num_drafts = rng.integers(0, k + 1, s)
    drafts = rng.integers(0, 3, (s, k))  # a small vocabulary: many matches
    parents = np.full((s, k), -1)
    for i in range(s):
        for j in range(num_drafts[i]):
            parents[i, j] = rng.integers(0, j + 1) if rng.random() < 0.5 else j  # trees and chains mixed
    offsets = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    targets = rng.integers(0, 3, int((num_drafts + 1).sum()))
    accepted, paths, final = accept_paths(targets, offsets, num_drafts, drafts, parents)
    for i in range(s):
        m = num_drafts[i]
        path, nxt = accept_tree(targets[offsets[i] : offsets[i] + m + 1], drafts[i, :m], parents[i, :m])
        assert accepted[i] == len(path) and paths[i, : len(path)].tolist() == path and final[i] == nxt
        assert (paths[i, len(path):] == -1).all()
