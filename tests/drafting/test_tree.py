"""Candidate trees: the numba tree builder, the ancestor mask, the walk and the KV compaction
against brute-force references, the tree-aware attention mask against a dense one, and engines
drafting trees token-identical to HF greedy (eager, static-buffer and compiled steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_plookup
from hf_plookup.attention.metadata import step_mask
from hf_plookup.drafting.ngram import (
    RECENT_WEIGHT,
    RECENT_WINDOW,
    SHORT_WEIGHT,
    match_cap,
    vote,
)
from hf_plookup.drafting.tree import (
    MAX_CANDIDATES,
    RECORD_SCAN,
    RECYCLE_RANK_DECAY,
    RECYCLE_WEIGHT,
    SUB_MIN_MATCH,
    SUB_SHARE,
    SUB_WEIGHT,
    TreeProposer,
    accept_tree,
    ancestor_mask,
    chain_budget,
    compaction,
    depths,
)
from hf_plookup.engine.kv_cache import PagedKVCache
from tests.conftest import ARCHS, left_padded, tiny_model, wrap_copy

# ---------------------------------------------------------------------------------------------
# brute-force references
# ---------------------------------------------------------------------------------------------


def _match(src: list[int], p: int, row: list[int], max_ngram: int) -> int:
    """Tokens ending at src[p] that equal the row's suffix (src[p] == row[-1] given)."""
    m = 1
    while m < max_ngram and p - m >= 0 and len(row) - 1 - m >= 0 and src[p - m] == row[len(row) - 1 - m]:
        m += 1
    return m


def ref_tree(row: list[int], k: int, budget: int, max_ngram: int, min_ngram: int, max_depth: int,
             short_weight: float = SHORT_WEIGHT, decay: float = 0.8, min_score: float = 0.0,
             others: list[list[int]] | None = None, max_candidates: int = MAX_CANDIDATES,
             successors: np.ndarray | None = None, recycled: int = 0, recycle_weight: float = RECYCLE_WEIGHT):
    """(tokens, parents) of one row's tree, built the plain way: every earlier occurrence of the
    last token in the row (newest first; past max_candidates, only those matching more than any
    newer one, among RECORD_SCAN * max_candidates occurrences), then in `others` (sources in the index's insertion
    order; newest = last inserted first), each with its match length; then the substitution
    candidates (the second-to-last token's earlier occurrences in the row followed by another
    token than the last); a dict trie of all their continuations with their votes; the voted
    path (most votes at every level, over the regular candidates); nodes ranked by score
    (stable), those below min_score left out except the voted path; the best `budget` kept.
    `successors` [V, W] and `recycled`: after the text's candidates (and the voted path), the
    paths through the last token's first `recycled` successors, each continued by its tokens'
    first successors, voting recycle_weight * RECYCLE_RANK_DECAY ** rank."""
    n = len(row)
    cap, budget = min(k, max_depth), min(budget, max_depth)
    if cap <= 0 or budget <= 0 or n < 2:
        return [], []
    longest = match_cap(max_ngram)
    cands = []  # (source tokens, continuation start, match length, position for recency: -1 none)
    walked, best = 0, 0
    for p in range(n - 2, -1, -1):  # the newest max_candidates, then longer matches only
        if row[p] != row[-1]:
            continue
        if walked == RECORD_SCAN * max_candidates or (len(cands) >= max_candidates and best >= longest):
            break
        m = _match(row, p, row, longest)
        if m >= min_ngram and (len(cands) < max_candidates or m > best):
            cands.append((row, p + 1, m, p))
            best = max(best, m)
        walked += 1
    entries = [(src, p) for src in (others or []) for p in range(len(src))]
    own = len(cands)
    for src, p in reversed(entries):
        if len(cands) == own + max_candidates:
            break
        if src[p] == row[-1] and p + 1 < len(src):
            m = _match(src, p, row, longest)
            if m >= min_ngram:
                cands.append((src, p + 1, m, -1))
    rec_paths = []  # the recycled paths, best-ranked first
    for r in range(min(recycled, 0 if successors is None else successors.shape[1])):
        tok = int(successors[row[-1], r]) if row[-1] < len(successors) else -1
        if tok < 0:
            break
        path = []
        while len(path) < cap and tok >= 0:
            path.append(tok)
            tok = int(successors[tok, 0]) if tok < len(successors) else -1
        rec_paths.append(path)
    if not cands and not rec_paths:
        return [], []
    regular = len(cands)
    best = max((m for _, _, m, _ in cands), default=0)
    for p in range(n - 3, -1, -1) if regular else ():  # substitutions: the second-to-last token at p, then not the last
        if len(cands) == regular + max(max_candidates // SUB_SHARE, 1):
            break
        if row[p] == row[-2] and row[p + 1] != row[-1]:
            m = _match(row, p, row[:-1], longest)
            if m >= min_ngram:
                cands.append((row, p + 2, m, None))
    nodes = {}  # (parent node, token) -> node id (creation order)
    info = []  # node id -> [token, parent id or -1, weight, depth]

    def voted_path():
        path, node = [], -1
        while True:
            kids = [q for q in range(len(info)) if info[q][1] == node]  # creation order
            if not kids:
                return path
            node = max(kids, key=lambda q: info[q][2])  # the first of the heaviest
            path.append(node)

    total = 0.0
    voted = None
    for j, (src, c, m, pos) in enumerate(cands):
        if j == regular:
            voted = voted_path()
        shortfall = best - min(m, best)
        if j < regular:
            w = vote(short_weight, shortfall, pos, n - RECENT_WINDOW, RECENT_WEIGHT)
            if w <= 0:
                continue
        elif m >= max(SUB_MIN_MATCH, min_ngram):
            w = SUB_WEIGHT * vote(short_weight, shortfall, -1, 0, 1.0)
        else:
            w = 0.0
        total += w
        node = -1
        for d in range(min(cap, len(src) - c)):
            key = (node, src[c + d])
            if key not in nodes:
                nodes[key] = len(info)
                info.append([src[c + d], node, 0.0, d + 1])
            node = nodes[key]
            info[node][2] += w
    if voted is None:
        voted = voted_path()
    for r, path in enumerate(rec_paths):
        w = recycle_weight * RECYCLE_RANK_DECAY ** r
        total += w
        node = -1
        for d, tok in enumerate(path):
            if (node, tok) not in nodes:
                nodes[node, tok] = len(info)
                info.append([tok, node, 0.0, d + 1])
            node = nodes[node, tok]
            info[node][2] += w
    score = [w / total * decay ** (d - 1) for (_, _, w, d) in info]
    order = sorted(range(len(info)), key=lambda q: -score[q])
    keep = [q for q in order if score[q] >= min_score] + [q for q in voted if score[q] < min_score]
    tokens, parents, out_of = [], [], {}
    for q in keep[:budget]:
        tokens.append(info[q][0])
        parents.append(0 if info[q][1] < 0 else out_of[info[q][1]])
        out_of[q] = len(tokens)
    return tokens, parents


def _rows(rows: list[list[int]], caps: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(history [R, W] with one spare column, lengths [R], caps [R]) of token rows."""
    hist = np.zeros((len(rows), max(len(r) for r in rows) + 1), dtype=np.int64)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    return hist, np.array([len(r) for r in rows], dtype=np.int64), np.array(caps[: len(rows)], dtype=np.int64)


rows_strategy = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=40), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, k=st.integers(1, 6), budget=st.integers(1, 12), max_ngram=st.integers(1, 3),
       caps=st.lists(st.integers(0, 8), min_size=6, max_size=6),
       table=st.lists(st.lists(st.integers(-1, 4), min_size=3, max_size=3), min_size=5, max_size=5),
       recycled=st.integers(1, 3), weight=st.sampled_from([RECYCLE_WEIGHT, 1.0, 5.0]),
       min_score=st.sampled_from([0.0, 0.1, 0.4]))
def test_tree_builder_with_recycled_successors_matches_reference(rows, k, budget, max_ngram, caps, table, recycled,
                                                                 weight, min_score):
    """Recycled successors (drafting.recycle) merged into the text's trees, against the plain
    trie: where the text votes, where it is silent, with gaps (-1) in the table."""
    from hf_plookup.drafting.suffix import SuffixIndex

    hist, lengths, cap = _rows(rows, caps)
    succ = np.array(table, dtype=np.int64)
    index = SuffixIndex(len(rows), hist.shape[1])
    index.successors = succ
    prop = TreeProposer(k, budget, max_ngram, recycled=recycled, recycle_weight=weight)
    tokens, parents, num = prop.propose(hist, lengths, cap, min_score=min_score, index=index)
    for i, r in enumerate(rows):
        t_ref, p_ref = ref_tree(r, k, budget, max_ngram, 1, int(cap[i]), min_score=min_score, successors=succ,
                                recycled=recycled, recycle_weight=weight)
        n = int(num[i])
        assert tokens[i, :n].tolist() == t_ref and parents[i, :n].tolist() == p_ref, (r, k, budget, cap[i])


def test_recycled_successors_example():
    """drafting.recycle's example: a row ending in 5 whose text has no earlier 5 drafts 3 and 9
    under the root and 4 under 9, scored 2/3, 1/3 and 1/3 * decay; without a table, nothing."""
    from hf_plookup.drafting.recycle import SuccessorTable
    from hf_plookup.drafting.suffix import SuffixIndex

    table = SuccessorTable(20, 2)
    table.update(np.array([5, 9, 5]), np.array([[9, 7], [4, 1], [3, 9]]))
    assert table.succ[5].tolist() == [3, 9] and table.succ[9].tolist() == [4, 1] and (table.succ[7] == -1).all()
    hist, lengths = np.array([[1, 2, 3, 5]]), np.array([4])
    index = SuffixIndex(1, 4)
    index.successors = table.succ
    scores, rec = np.empty((1, 6)), np.empty((1, 6), dtype=bool)
    tokens, parents, num = TreeProposer(3, 6, recycled=2, decay=0.8).propose(hist, lengths, index=index, scores=scores,
                                                                            recycled=rec)
    assert tokens[0, :3].tolist() == [3, 9, 4] and parents[0, :3].tolist() == [0, 0, 2] and num[0] == 3
    assert scores[0, :3] == pytest.approx([2 / 3, 1 / 3, 0.8 / 3]) and rec[0, :3].all()
    # a row whose text has an earlier 5 followed by 3 8: the 3 is the text's (and recycled), 8 the text's alone
    hist, lengths = np.array([[5, 3, 8, 2, 5]]), np.array([5])
    index = SuffixIndex(1, 5)
    index.successors = table.succ
    tokens, parents, num = TreeProposer(3, 6, recycled=2).propose(hist, lengths, np.array([6]), index=index,
                                                                  recycled=rec)
    assert tokens[0, :num[0]].tolist() == [3, 8, 2, 9, 4] and rec[0, :num[0]].tolist() == [False, False, False, True, True]
    assert TreeProposer(3, 6, recycled=2).propose(np.array([[1, 2, 3, 5]]), np.array([4]))[2][0] == 0  # no table
    with pytest.raises(ValueError, match="top must have shape"):
        table.update(np.array([1]), np.array([[1, 2, 3]]))
    with pytest.raises(TypeError, match="draft_recycled"):
        TreeProposer(3, 6, recycled=1.5)


def ref_ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while i > 0:
        i = parents[i - 1]
        out.add(i)
    return out




@settings(max_examples=50, deadline=None)
@given(rows=rows_strategy, k=st.integers(1, 6), budget=st.integers(1, 12), max_ngram=st.integers(1, 3),
       caps=st.lists(st.integers(0, 8), min_size=6, max_size=6),
       short_weight=st.sampled_from([0.0, SHORT_WEIGHT, 0.25, 1.0]),
       decay=st.sampled_from([0.5, 0.8, 1.0]), min_score=st.sampled_from([0.0, 0.1, 0.4]),
       max_candidates=st.sampled_from([2, 5, MAX_CANDIDATES]))
def test_tree_builder_matches_reference(rows, k, budget, max_ngram, caps, short_weight, decay, min_score,
                                        max_candidates):
    hist, lengths, cap = _rows(rows, caps)
    prop = TreeProposer(k, budget, max_ngram, short_weight=short_weight, decay=decay, max_candidates=max_candidates)
    tokens, parents, num = prop.propose(hist, lengths, cap, min_score=min_score)
    for i, r in enumerate(rows):
        t_ref, p_ref = ref_tree(r, k, budget, max_ngram, 1, int(cap[i]), short_weight, decay, min_score,
                                max_candidates=max_candidates)
        n = int(num[i])
        assert tokens[i, :n].tolist() == t_ref and parents[i, :n].tolist() == p_ref, (r, k, budget, max_ngram, cap[i])
        assert (tokens[i, n:] == -1).all() and (parents[i, n:] == -1).all()
        if n:
            assert depths(parents[i, :n]).max() <= min(k, cap[i])


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=4),
       corpus=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=20), min_size=0, max_size=3),
       cross=st.booleans(), k=st.integers(1, 5), budget=st.integers(1, 10), max_ngram=st.integers(1, 3))
def test_tree_builder_with_other_sources_matches_reference(rows, corpus, cross, k, budget, max_ngram):
    """Cross-row and corpus sources: the index's walk finds exactly the occurrences a plain scan
    of every source finds, in the same order."""
    from hf_plookup.drafting.suffix import SuffixIndex

    width = max(len(r) for r in rows) + 2
    hist = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    index = SuffixIndex(len(rows), width, cross_rows=cross, corpus=[np.array(d, dtype=np.int64) for d in corpus])
    tokens, parents, num = TreeProposer(k, budget, max_ngram).propose(hist, lengths, index=index)
    for i, r in enumerate(rows):
        others = [d for d in corpus if d] + ([rows[j] for j in range(len(rows))] if cross else [])
        # the row's own entries are skipped in the cross walk: drop them from the reference's sources
        others = [o for o in others if o is not r]
        t_ref, p_ref = ref_tree(r, k, budget, max_ngram, 1, k, others=others)
        n = int(num[i])
        assert tokens[i, :n].tolist() == t_ref and parents[i, :n].tolist() == p_ref, (i, rows, corpus, cross)


@pytest.mark.parametrize("cross", [False, True])
def test_large_batches_walk_fewer_candidates(cross):
    """A step over many rows walks at most CANDIDATE_WORK candidates in all (never under
    MIN_CANDIDATES per row and kind): the trees are the reference's with that cap, and differ
    from the uncapped ones where rows repeat tokens often."""
    from hf_plookup.drafting.suffix import SuffixIndex
    from hf_plookup.drafting.tree import CANDIDATE_WORK, MIN_CANDIDATES

    rng = np.random.default_rng(0)
    batch = 400
    rows = [rng.integers(0, 6, size=int(rng.integers(150, 200))).tolist() for _ in range(batch)]
    width = max(len(r) for r in rows) + 1
    hist = np.zeros((batch, width), dtype=np.int64)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    prop = TreeProposer(4, 12, 2)
    cap = prop.candidates(batch, cross)
    assert cap == max(MIN_CANDIDATES, CANDIDATE_WORK // (batch * (2 if cross else 1))) < MAX_CANDIDATES
    assert prop.candidates(1, cross) == MAX_CANDIDATES
    tokens, parents, num = prop.propose(hist, lengths, index=SuffixIndex(batch, width, cross_rows=cross))
    differs = 0
    for i in range(0, batch, 37 if cross else 7):  # the cross reference scans every row: sample rows
        others = [rows[j] for j in range(batch) if j != i] if cross else None
        t_ref, p_ref = ref_tree(rows[i], 4, 12, 2, 1, 4, others=others, max_candidates=cap)
        n = int(num[i])
        assert tokens[i, :n].tolist() == t_ref and parents[i, :n].tolist() == p_ref, i
        differs += ref_tree(rows[i], 4, 12, 2, 1, 4, others=others) != (t_ref, p_ref)
    assert differs > 0


def test_index_grows_incrementally_without_rescans():
    """Each update indexes only the tokens appended since the last one, and trees proposed from
    an incrementally built index equal those of an index built in one go."""
    from hf_plookup.drafting.suffix import SuffixIndex

    g = np.random.default_rng(3)
    hist = g.integers(0, 8, size=(3, 200))
    prop = TreeProposer(4, 12, 2)
    own, cross = SuffixIndex(3, 200), SuffixIndex(3, 200, cross_rows=True)
    rows = np.arange(3)
    last = 0
    for n in range(20, 201, 30):
        lengths = np.full(3, n)
        before = cross.n_entries
        got = prop.propose(hist, lengths, rows=rows, index=own)
        prop.propose(hist, lengths, rows=rows, index=cross)
        assert cross.n_entries - before == 3 * (n - last)  # one entry per new token, none for old ones
        assert (own.indexed == n).all()
        last = n
        want = prop.propose(hist, lengths, rows=rows, index=SuffixIndex(3, 200))
        for a, b in zip(got, want):
            assert (a == b).all()


def test_tree_builder_parallel_batch_matches_serial():
    """Batches of >= 32 rows take numba's parallel kernel: same trees as row by row."""
    g = np.random.default_rng(0)
    hist = g.integers(0, 6, size=(40, 300))
    lengths = g.integers(2, 300, size=40)
    prop = TreeProposer(4, 16, 2)
    t, p, n = prop.propose(hist, lengths)
    for i in range(40):
        ti, pi, ni = prop.propose(hist[i : i + 1], lengths[i : i + 1])
        assert ni[0] == n[i] and (ti[0] == t[i]).all() and (pi[0] == p[i]).all()


def test_module_docstring_example():
    """tree.py's worked example: `1 5 6` matched in full once (followed by `7 2`) and `5 6`
    twice (followed by `8 3`, `8 1`): the full match outvotes the two shorter ones."""
    hist = np.array([[1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6, 8, 1, 5, 6]], dtype=np.int64)
    t, p, n = TreeProposer(2, 4, 2).propose(hist, np.array([15]), max_depth=np.array([4]))
    assert (t.tolist(), p.tolist(), n.tolist()) == ([[7, 2, 8, 1]], [[0, 1, 0, 3]], [4])
    # a row that may emit 2 more tokens gets 2 nodes: the best two (`7`, then its `2`)
    t, p, n = TreeProposer(2, 4, 2).propose(hist, np.array([15]))
    assert (t.tolist(), p.tolist(), n.tolist()) == ([[7, 2, -1, -1]], [[0, 1, -1, -1]], [2])
    # with a min score of 0.7 the `2` (0.63) would be left out, but the voted path is kept whole
    t, p, n = TreeProposer(2, 4, 2).propose(hist, np.array([15]), max_depth=np.array([4]), min_score=0.7)
    assert (t.tolist(), p.tolist(), n.tolist()) == ([[7, 2, -1, -1]], [[0, 1, -1, -1]], [2])
    # the chain drafter drafts the voted path
    from hf_plookup.drafting.ngram import NgramProposer

    d, nd = NgramProposer(2, 2).propose(hist, np.array([15]))
    assert (d.tolist(), nd.tolist()) == ([[7, 2]], [2])


def test_votes_weigh_match_length_and_recency():
    """Literal cases of the vote: a longer match outvotes shorter ones several times over, and
    occurrences among the row's last RECENT_WINDOW tokens vote RECENT_WEIGHT times."""
    assert vote(0.135, 0, 10, 68, 3.0) == 1.0
    assert vote(0.135, 2, 10, 68, 3.0) == pytest.approx(0.135 ** 2)
    assert vote(0.135, 1, 70, 68, 3.0) == pytest.approx(0.405)  # the module's example
    assert vote(0.135, 1, 68, 68, 3.0) == pytest.approx(0.405)
    assert vote(0.135, 1, 67, 68, 3.0) == pytest.approx(0.135)
    assert vote(0.135, 0, -1, -27, 3.0) == 1.0  # another source's occurrence: never recent
    assert vote(0.0, 0, 5, 68, 3.0) == 1.0 and vote(0.0, 1, 5, 68, 3.0) == 0.0
    # `1 2` followed by 10 four times long ago, and by 11 once among the last tokens (4 votes to 3)
    filler = list(range(100, 140))
    row = [1, 2, 10] * 4 + filler + [1, 2, 11] + [1, 2]
    t, p, n = TreeProposer(1, 2, 2).propose(np.array([row]), np.array([len(row)]), max_depth=np.array([2]))
    assert (t.tolist(), p.tolist(), n.tolist()) == ([[10, 11]], [[0, 0]], [2])
    # three times long ago: 3 votes to 3, the tie goes to the newest (11)
    row = [1, 2, 10] * 3 + filler + [1, 2, 11] + [1, 2]
    t, p, n = TreeProposer(1, 2, 2).propose(np.array([row]), np.array([len(row)]), max_depth=np.array([2]))
    assert (t.tolist(), p.tolist(), n.tolist()) == ([[11, 10]], [[0, 0]], [2])


def test_longer_match_further_back_than_the_newest_candidates():
    """With room for 2 candidates, the walk goes past the newest two `2`s (each matching one
    token) to the `7 1 2` that matches three, whose `5` then outvotes their `6`s; the chain
    drafter, which scans the whole row, drafts it too."""
    from hf_plookup.drafting.ngram import NgramProposer

    row = [7, 1, 2, 5] + [9, 2, 6] * 3 + [7, 1, 2]
    hist, length = np.array([row], dtype=np.int64), np.array([len(row)])
    t, p, n = TreeProposer(1, 2, 2, max_candidates=2).propose(hist, length, max_depth=np.array([2]))
    assert (t.tolist(), p.tolist(), n.tolist()) == ([[5, 6]], [[0, 0]], [2])
    assert NgramProposer(1, 2).propose(hist, length)[0].tolist() == [[5]]


def test_substitution_candidates_fill_the_budget():
    """The row ends in `4 9 2` where its text had `4 9 3 7 8` (the `3` reworded as `2`): the
    second-to-last token's earlier occurrence, followed by another token than the last, drafts
    `7 8` after the regular candidate's `5 6` (its vote is SUB_WEIGHT of a regular one, so it
    only takes budget the regular candidates leave)."""
    row = [4, 9, 3, 7, 8, 1, 2, 5, 6, 0, 4, 9, 2]
    hist = np.array([row], dtype=np.int64)
    four = np.array([4])
    t, p, n = TreeProposer(2, 4, 2).propose(hist, np.array([len(row)]), max_depth=four)
    assert (t.tolist(), p.tolist(), n.tolist()) == ([[5, 6, 7, 8]], [[0, 1, 0, 3]], [4])
    # a per-step budget above their score leaves them out (the regular `2` match holds the votes)
    t, p, n = TreeProposer(2, 4, 2).propose(hist, np.array([len(row)]), max_depth=four, min_score=0.1)
    assert (t.tolist(), n.tolist()) == ([[5, 6, -1, -1]], [2])
    # without a regular candidate there is no tree (a reworded token alone is too weak a sign)
    row = [4, 9, 3, 7, 8, 1, 4, 9, 2]
    t, p, n = TreeProposer(2, 4, 2).propose(np.array([row]), np.array([len(row)]), max_depth=four)
    assert n.tolist() == [0]


def test_one_occurrence_gives_the_chain():
    """Where the suffix occurred once before, the tree is the chain drafter's draft."""
    from hf_plookup.drafting.ngram import NgramProposer

    g = np.random.default_rng(1)
    for _ in range(20):
        row = g.permutation(50)[:30].tolist()  # distinct tokens
        row = row + row[:7]  # the suffix row[5:7] occurred once, at positions 5..6
        hist = np.array([row], dtype=np.int64)
        d, nd = NgramProposer(5, 2).propose(hist, np.array([len(row)]))
        t, p, n = TreeProposer(5, 20, 2).propose(hist, np.array([len(row)]))
        assert nd[0] == n[0] == 5
        assert t[0, :5].tolist() == d[0, :5].tolist() and p[0, :5].tolist() == [0, 1, 2, 3, 4]


@settings(max_examples=40, deadline=None)
@given(rows=rows_strategy, k=st.integers(1, 6), max_ngram=st.integers(1, 3),
       min_score=st.sampled_from([0.0, 0.4, 1.0]), decay=st.sampled_from([0.3, 1.0]))
def test_tree_holds_the_chain_drafters_draft(rows, k, max_ngram, min_score, decay):
    """The tree's voted path is the chain drafter's draft (both vote the same way over the same
    occurrences here: fewer than either's candidate cap), and it is kept whatever the per-step
    budget says: with room for every node, the chain's draft is a path of the tree."""
    from hf_plookup.drafting.ngram import NgramProposer

    width = max(len(r) for r in rows) + 1
    hist = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    d, nd = NgramProposer(k, max_ngram).propose(hist, lengths)
    room = 3 * width * k  # more nodes than any trie here holds (max_depth caps the budget too)
    t, p, n = TreeProposer(k, room, max_ngram, decay=decay).propose(hist, lengths, np.full(len(rows), room),
                                                                    min_score=min_score)
    for i in range(len(rows)):
        node = 0
        for j in range(int(nd[i])):
            kids = [q + 1 for q in range(int(n[i])) if p[i, q] == node and t[i, q] == d[i, j]]
            assert len(kids) == 1, (rows[i], k, d[i], t[i], p[i])
            node = kids[0]
        assert (n[i] > 0) == (nd[i] > 0)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(0, 10), extra=st.integers(0, 3))
def test_ancestor_mask_and_depths(data, n, extra):
    parents = [data.draw(st.integers(0, i)) for i in range(n)]  # node i+1 hangs under a node < i+1
    width = n + 1 + extra
    m = ancestor_mask(np.array(parents, dtype=np.int64), width)
    d = depths(np.array(parents, dtype=np.int64))
    for i in range(n + 1):
        anc = ref_ancestors(parents, i)
        assert set(np.flatnonzero(m[i]).tolist()) == anc
        assert d[i] == len(anc) - 1
    for i in range(n + 1, width):  # padding rows: the root and themselves
        assert set(np.flatnonzero(m[i]).tolist()) == {0, i}


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(0, 10))
def test_walk_and_compaction(data, n):
    parents = [data.draw(st.integers(0, i)) for i in range(n)]
    tokens = [data.draw(st.integers(0, 3)) for _ in range(n)]
    picks = np.array([data.draw(st.integers(0, 3)) for _ in range(n + 1)])
    path, nxt = accept_tree(picks, np.array(tokens), np.array(parents))
    # reference: follow the picks, taking the first child (lowest index) holding the pick
    node, ref_path = 0, []
    while True:
        kids = [i + 1 for i in range(n) if parents[i] == node and tokens[i] == picks[node]]
        if not kids:
            break
        node = kids[0]
        ref_path.append(node)
    assert path == ref_path and nxt == picks[node]
    # compaction: after the moves (all reads before writes) offset j + 1 holds node path[j]'s KV
    kv = np.arange(n + 1) * 10
    src, dst = compaction(path)
    moved = kv.copy()
    moved[dst] = kv[src]
    assert moved[1 : len(path) + 1].tolist() == [kv[p] for p in path]
    assert set(dst.tolist()).isdisjoint(set(range(len(path) + 1, n + 1))) or not len(dst)


def test_cache_move_slots_every_layer():
    from hf_plookup.engine.kv_cache import LayerSpec

    specs = [LayerSpec(num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))] * 3
    cache = PagedKVCache(specs, num_blocks=4, block_size=4)
    for t in (*cache.keys, *cache.values):
        t.copy_(torch.randn_like(t))
    before = [t.clone().view(16, 2, 4) for t in (*cache.keys, *cache.values)]
    src, dst = np.array([5, 9, 3]), np.array([3, 4, 5])  # overlapping: 3 and 5 are both read and written
    cache.move_slots(src, dst)
    for old, new in zip(before, (*cache.keys, *cache.values)):
        new = new.view(16, 2, 4)
        assert torch.equal(new[[3, 4, 5]], old[[5, 9, 3]])
        untouched = [i for i in range(16) if i not in (3, 4, 5)]
        assert torch.equal(new[untouched], old[untouched])
    with pytest.raises(ValueError, match="equal length"):
        cache.move_slots(np.array([1]), np.array([1, 2]))


# ---------------------------------------------------------------------------------------------
# the attention mask of a tree step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 3, 6])
def test_tree_step_mask_matches_dense(window):
    """step_mask with a tree: every real query row sees exactly the context keys before its chunk
    (within the window by position) and its chunk's ancestors (within the window by their
    positions start + depth), as spelled out key by key."""
    g = np.random.default_rng(2)
    b, tq = 4, 7
    starts = np.array([5, 0, 11, 3])
    n = np.array([7, 4, 1, 6])  # nodes fed per sequence (root included)
    lk = int((starts + tq).max())
    tree = np.zeros((b, tq, tq), dtype=bool)
    query_pos = np.full((b, tq), -1, dtype=np.int64)
    all_parents = []
    for i in range(b):
        parents = [int(g.integers(0, j + 1)) for j in range(n[i] - 1)]
        all_parents.append(parents)
        tree[i] = ancestor_mask(np.array(parents, dtype=np.int64), tq)
        query_pos[i, : n[i]] = starts[i] + depths(np.array(parents, dtype=np.int64))
    ctx = starts + n
    m = step_mask(torch.from_numpy(query_pos), torch.from_numpy(ctx), lk, window, torch.from_numpy(tree))[:, 0]
    for i in range(b):
        for j in range(n[i]):
            q = query_pos[i, j]
            anc = ref_ancestors(all_parents[i], j)
            want = np.zeros(lk, dtype=bool)
            for key in range(lk):
                if key < starts[i]:
                    want[key] = not window or key > q - window
                elif key < ctx[i] and key - starts[i] in anc:
                    want[key] = not window or query_pos[i, key - starts[i]] > q - window
            assert m[i, j].numpy().tolist() == want.tolist(), (i, j)


# ---------------------------------------------------------------------------------------------
# engines drafting trees
# ---------------------------------------------------------------------------------------------


def _branchy(model, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Prompts where the suffix recurs with different continuations: the model's own greedy
    continuation of a seed, then a copy with some tokens changed, twice (so the changed branch
    outvotes the model's own), then the seed."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 96, (1, 6), generator=g)
    cont = model.generate(base, max_new_tokens=30, do_sample=False, eos_token_id=None)
    changed = cont.clone()
    for i in range(3):
        changed[0, 8 + 7 * i] = (changed[0, 8 + 7 * i] + 1) % 96
    return torch.cat([cont, changed, changed, base], 1).repeat(batch, 1)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tree_drafts_identical_to_hf_greedy(arch):
    model = tiny_model(arch)
    wrapped = wrap_copy(model, max_cache_tokens=4096, block_size=4, tree_min_score=0.0)
    for ids, mask in (left_padded(3, seed=11), (_branchy(model), None)):
        mask = torch.ones_like(ids) if mask is None else mask
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=None)
        out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None,
                               prompt_lookup_num_tokens=5, prompt_lookup_tree_nodes=12)
        assert torch.equal(ref, out), arch
        s = wrapped.last_stats
        assert s.drafter == "ngram-tree"
        assert sum(s.accepted_hist) == s.verify_steps and s.mean_tree_size <= 12
        assert wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks


def test_tree_paths_off_the_first_candidate_are_moved(monkeypatch):
    """On the branchy prompts some accepted paths leave the first candidate, so their KV is
    moved; outputs stay identical to HF and trees score at least the chain's tokens per forward."""
    moves = []
    orig = PagedKVCache.move_slots

    def spy(self, src, dst):
        moves.append(len(src))
        return orig(self, src, dst)

    monkeypatch.setattr(PagedKVCache, "move_slots", spy)
    model = tiny_model("gemma2")
    wrapped = wrap_copy(model, max_cache_tokens=4096, block_size=4, tree_min_score=0.0)  # whole trees
    ids = _branchy(model)
    ref = model.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None)
    chain = wrapped.generate(ids, max_new_tokens=30, eos_token_id=None, prompt_lookup_num_tokens=6)
    chain_tpf = wrapped.last_stats.tokens_per_forward
    moves.clear()
    tree = wrapped.generate(ids, max_new_tokens=30, eos_token_id=None, prompt_lookup_num_tokens=6,
                            prompt_lookup_tree_nodes=16)
    assert torch.equal(ref, chain) and torch.equal(ref, tree)
    assert sum(moves) > 0
    # the chain's vote follows the model's own text here too (its match is longer than the
    # copies'), so the tree can only equal it
    assert wrapped.last_stats.tokens_per_forward >= chain_tpf


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral"])
def test_tree_static_buffer_and_compiled_steps_identical(arch, monkeypatch):
    """Tree steps through GraphRunner's padded static buffers (compile=True, traced with
    aot_eager on CPU) give HF's tokens too."""
    from hf_plookup.steps import graphs

    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")
    model = tiny_model(arch)
    wrapped = wrap_copy(model, max_cache_tokens=4096, block_size=16, compile=True)
    ids = _branchy(model)
    ref = model.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None)
    out = wrapped.generate(ids, max_new_tokens=20, eos_token_id=None, prompt_lookup_num_tokens=4,
                           prompt_lookup_tree_nodes=8)
    assert torch.equal(ref, out)
    assert any(key[3] for key in wrapped._engine._graphs.graphs)  # a tree bucket ran
    torch._dynamo.reset()


def test_trees_fall_back_to_a_chain_where_they_cannot_run(llama):
    """History-dependent processors (repetition penalty) keep one chain; warpers do not."""
    wrapped = wrap_copy(llama, max_cache_tokens=4096)
    ids, mask = left_padded(2, seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=3, prompt_lookup_tree_nodes=6)
    wrapped.generate(ids, repetition_penalty=1.3, **kw)
    assert wrapped.last_stats.drafter == "ngram"
    wrapped.generate(ids, do_sample=True, top_k=5, temperature=0.7, **kw)
    assert wrapped.last_stats.drafter == "ngram-tree"


@pytest.mark.parametrize("bad, err", [(0, ValueError), (-2, ValueError), (2.5, TypeError), ("8", TypeError),
                                      (True, TypeError)])
def test_tree_nodes_argument_checked(llama, bad, err):
    wrapped = wrap_copy(llama, max_cache_tokens=1024)
    ids, mask = left_padded(1)
    with pytest.raises(err, match="prompt_lookup_tree_nodes"):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=4, prompt_lookup_num_tokens=2,
                         prompt_lookup_tree_nodes=bad)
    with pytest.raises(ValueError, match="prompt_lookup_tree_nodes needs prompt_lookup_num_tokens"):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=4, prompt_lookup_tree_nodes=4)


def test_corpus_and_cross_row_sources_identical_to_hf(llama):
    """A corpus holding the continuation drafts it (many tokens per forward); other rows of the
    batch as sources; outputs stay HF's greedy tokens either way."""
    wrapped = wrap_copy(llama, max_cache_tokens=8192)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 96, (3, 20), generator=g)  # random prompts: nothing to find in the row itself
    ref = llama.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    kw = dict(max_new_tokens=24, eos_token_id=None, prompt_lookup_num_tokens=4)
    own = wrapped.generate(ids, **kw)
    own_tpf = wrapped.last_stats.tokens_per_forward
    corpus = [ref[i, 16:].tolist() for i in range(3)]  # each row's last 4 prompt tokens and its continuation
    out = wrapped.generate(ids, draft_corpus=corpus, **kw)
    s = wrapped.last_stats
    assert torch.equal(ref, own) and torch.equal(ref, out)
    assert s.drafter == "ngram-tree+corpus" and s.tokens_per_forward > max(2.5, own_tpf)
    # rows 1 and 2 repeat row 0: with cross-row sources they draft from row 0's tokens
    same = ids[:1].repeat(3, 1)
    ref = llama.generate(same, do_sample=False, max_new_tokens=24, eos_token_id=None)
    out = wrapped.generate(same, draft_cross_rows=True, prompt_lookup_tree_nodes=6, **kw)
    assert torch.equal(ref, out) and wrapped.last_stats.drafter == "ngram-tree+rows"


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(draft_cross_rows=1), TypeError, "draft_cross_rows"),
    (dict(draft_corpus="some text"), TypeError, "draft_corpus"),
    (dict(draft_corpus=[[1, 2], [[3]]]), TypeError, r"draft_corpus\[1\]"),
    (dict(draft_corpus=[[1, 10_000]]), ValueError, "outside the vocabulary"),
    (dict(draft_corpus=["text"]), ValueError, "tokenizer="),
    (dict(draft_recycled=-1), ValueError, "draft_recycled must be >= 0"),
    (dict(draft_recycled=2.0), TypeError, "draft_recycled must be an int"),
])
def test_source_arguments_checked(llama, kwargs, err, match):
    wrapped = wrap_copy(llama, max_cache_tokens=1024)
    ids, mask = left_padded(1)
    with pytest.raises(err, match=match):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=4, prompt_lookup_num_tokens=2, **kwargs)
    with pytest.raises(ValueError, match="needs prompt_lookup_num_tokens"):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=4, draft_cross_rows=True)
    with pytest.raises(ValueError, match="draft_recycled needs prompt_lookup_num_tokens"):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=4, draft_recycled=4)


def test_tree_min_score_prunes_and_is_checked(llama):
    """A min score prunes unlikely nodes (smaller trees, same tokens); with none given, CPU steps
    take the measured budget (engine.budget), and a given value is used as it is."""
    assert wrap_copy(llama, tree_min_score=None)._engine.budget is not None
    engine = wrap_copy(llama, tree_min_score=0.3)._engine
    assert (engine.tree_min_score, engine.budget) == (0.3, None)
    model = tiny_model("gemma2")
    ids = _branchy(model)
    sizes = []
    for ms in (0.0, 0.5):
        wrapped = wrap_copy(model, max_cache_tokens=4096, tree_min_score=ms)
        out = wrapped.generate(ids, max_new_tokens=20, eos_token_id=None, prompt_lookup_num_tokens=6,
                               prompt_lookup_tree_nodes=16)
        assert torch.equal(out, model.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None))
        sizes.append(wrapped.last_stats.mean_tree_size)
    assert sizes[1] < sizes[0]
    for bad in (-0.1, 1.5, "0.2", True):
        with pytest.raises(ValueError, match="tree_min_score"):
            wrap_copy(llama, tree_min_score=bad)


def test_walk_rejected_means_the_walk_stopped_above_a_child():
    """On a chain (parents 0, 1, ..., m-1) the walk rejected a draft exactly when it accepted fewer
    than m; in a tree, when its last accepted node (or the root) has a child; rows apart."""
    from hf_plookup.drafting.tree import walks_rejected

    def one(path, parents):  # one row; the paths' slots past `accepted` hold -1, as the walks leave them
        k = max(len(parents), 1)
        row = np.full((1, k), -1)
        row[0, : len(path)] = path
        padded = np.zeros((1, k), dtype=np.int64)
        padded[0, : len(parents)] = parents
        return bool(walks_rejected(row, np.array([len(path)]), padded, np.array([len(parents)]))[0])

    for m in range(5):
        chain = np.arange(m)
        for a in range(m + 1):
            assert one(list(range(1, a + 1)), chain) == (a < m)
    tree = np.array([0, 0, 1, 3])  # root -> 1, 2; 1 -> 3; 3 -> 4
    assert one([2], tree) is False and one([1, 3], tree) is True
    assert one([1, 3, 4], tree) is False and one([], tree) is True
    paths = np.array([[2, -1, -1, -1], [1, 3, -1, -1], [1, 3, 4, -1]])  # the same three walks at once
    assert walks_rejected(paths, np.array([1, 2, 3]), np.tile(tree, (3, 1)), np.full(3, 4)).tolist() == [False, True, False]


def test_chain_budget_cuts_before_the_first_draft_below_the_min_score():
    # rate**j: 0.8**6 = 0.26 >= 0.25 > 0.8**7; 0.5**2 = 0.25; 0.3**1 = 0.3 > 0.25 > 0.09
    assert chain_budget(np.array([0.8, 0.5, 0.3]), 0.25).tolist() == [6, 2, 1]
    assert chain_budget(np.array([0.3]), 0.5).tolist() == [0]  # not even the first draft pays
    assert chain_budget(np.array([0.3, 0.97]), 0.0).min() > 1000  # no budget: nothing is cut
