"""Candidate trees: several prompt-lookup continuations per sequence, merged into one token tree
and verified in one forward.

A row's tree has `n` draft nodes (node 0, the root, is the row's last token and is not stored
here). Node i (1-based) holds `tokens[i-1]` and hangs under `parents[i-1]` (0 = the root); a
parent always comes before its children, so node order is a topological order. The candidates
are the earlier occurrences of the row's last token, each with its match length (how many
tokens ending there equal the row's suffix, measured as the chain drafter measures it,
drafting.ngram), and substitution candidates (the row's second-to-last token matched, its last
token not: the row reworded one token of a passage it goes on copying). Their continuations
form a trie in which each node adds up the votes of the candidates passing through it
(drafting.ngram.vote: the longest matches decide, shorter ones break ties and fill the budget),
and the tree keeps the best-scoring nodes (`TreeProposer`). Shared prefixes are fed once; each
path is at most `k` tokens long (`prompt_lookup_num_tokens`).

Verification feeds node i at position `start + depth(i)` and lets it attend to the cached
context and to its ancestors only (`ancestor_mask`); the accepted path's keys/values are then
moved to the positions a chain would have used (`compaction`).

The kernel runs per row in three stages over the records below: `_find_candidates`,
`_build_trie`, `_keep_best`.

Example (k=2, 4 nodes): the row `1 5 6 7 2 5 6 8 3 5 6 8 1 5 6` ends in `1 5 6`. The `6` at
position 2 matches all three tokens and was followed by `7 2`; those at 6 and 10 match two
(`5 6`) and were followed by `8 3` and `8 1`. A match one token short votes 0.135 of a full one
(every position here is recent, so each vote is tripled alike): `7` and its `2` hold 3 / 3.81
of the votes (scores 0.79 and 0.79 * 0.8 = 0.63 with decay 0.8), `8` holds 0.81 / 3.81 (0.21),
and `8 1` and `8 3` half of that times 0.8 (0.085 each; the first created, `1`, is kept).
Output: tokens `[7, 2, 8, 1]`, parents `[0, 1, 0, 3]`. The voted path `7 2` is also the chain
drafter's draft; HF's rule (the newest match of `5 6`) would give `8 1`.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from ..base.checks import positive_int
from .ngram import RECENT_WEIGHT, RECENT_WINDOW, SHORT_WEIGHT, match_cap, vote
from .suffix import NO_SUCCESSORS, SuffixIndex, _slot

__all__ = ["TreeProposer", "accept_tree", "acceptance_estimate", "ancestor_mask",
           "chain_budget", "compaction", "depths", "walks_rejected"]

# earlier occurrences ranked per row and kind of source (own row, others); each costs a few cache
# misses, so a large batch gets fewer: at most CANDIDATE_WORK over the batch, never under
# MIN_CANDIDATES (measured in docs/results.md, "Candidate trees")
MAX_CANDIDATES = 64
MIN_CANDIDATES = 8
CANDIDATE_WORK = 6144
# past its newest max_candidates own occurrences, the walk goes on to RECORD_SCAN times as many,
# keeping only those matching more tokens than any newer one: the longest match often lies
# further back than a common token's newest occurrences, and it decides the vote
RECORD_SCAN = 2
# substitution candidates (the row's second-to-last token matched, its last token not: the row
# reworded one token of text it goes on copying) vote SUB_WEIGHT times a regular vote, so they
# fill the budget the regular candidates leave; those matching fewer than SUB_MIN_MATCH tokens
# vote 0, so their nodes only take budget nothing else wants (and only with a min score of 0)
SUB_WEIGHT = 0.02
SUB_MIN_MATCH = 2
# a row walks max_candidates // SUB_SHARE substitution candidates: each adds a branch that rarely
# pays, and inserting it walks the trie's sibling lists
SUB_SHARE = 4
# recycled successors (drafting.recycle): the path through a row's last token's r-th best-ranked
# successor votes RECYCLE_WEIGHT * RECYCLE_RANK_DECAY ** r of a regular vote, so where the text
# votes, its candidates decide and recycled nodes fill what budget is left; where it is silent,
# the recycled paths alone make the tree
RECYCLE_WEIGHT = 0.1
RECYCLE_RANK_DECAY = 0.5
# the trie's integer fields per node, rows of Scratch.trie [T, TRIE_FIELDS, nodes]
TOKEN = 0         # the token it drafts
PARENT = 1        # its parent trie node (-1: the root)
DEPTH = 2         # 1 for the root's children
FIRST_CHILD = 3   # children are a list in creation order: the first child ...
NEXT_SIBLING = 4  # ... and each child's next sibling (-1: none)
OUTPUT_NODE = 5   # its node number in the output tree (1-based), once kept
ON_CHAIN = 6      # 1 on the voted path (the chain drafter's rule, drafting.ngram)
FRONTIER = 7      # not a per-node field: the list of candidate nodes while keeping the best
FROM_TEXT = 8     # 1 where a candidate of the text passes through it, 0 for recycled successors' alone
TRIE_FIELDS = 9
# NUMBA_TYPES: the kernels below pass scalars among themselves as int64 (np.int64(0), not 0), since
# numba compiles a callee once for each type it is called with, a literal constant (0, -1, True)
# and an unsigned prange counter each being a type of their own: every such call compiled the
# callees under it again, and a first call with trees spent most of its time compiling


class TreeParams(NamedTuple):
    """How every row's tree of one `propose` call is drafted."""

    k: int                # the longest path (prompt_lookup_num_tokens)
    budget: int           # the most draft nodes per row
    max_candidates: int   # earlier occurrences per row and kind of source
    longest: int          # the longest suffix match measured (drafting.ngram.match_cap)
    min_ngram: int        # the shortest match an occurrence needs
    short_weight: float   # an occurrence's vote per token its match falls short of the best one
    recent_window: int    # own occurrences among the row's last this many tokens ...
    recent_weight: float  # ... vote this many times more (drafting.ngram.vote)
    min_score: float      # nodes scoring below it are left out
    recycled: int         # recycled successors per row's last token drafted (0: none)
    recycle_weight: float  # the best-ranked recycled path's vote (RECYCLE_WEIGHT)


class Scratch(NamedTuple):
    """Working arrays, one slice per parallel task t (small: each stays in its core's cache)."""

    cand_source: np.ndarray     # [T, N] a candidate occurrence's source (N: TreeProposer._buffers)
    cand_start: np.ndarray      # [T, N] the position of the token after it (its continuation)
    cand_match: np.ndarray      # [T, N] how many suffix tokens it matches
    trie: np.ndarray            # [T, TRIE_FIELDS, N * k] int64 fields above
    trie_weight: np.ndarray     # [T, N * k] the votes through each trie node
    decay_at_depth: np.ndarray  # [T, k] decay ** (depth - 1)
    path: np.ndarray            # [T, k] int64 the tokens of the candidate being inserted


class Trees(NamedTuple):
    """The output: each row's draft nodes in topological order, -1 where unused."""

    tokens: np.ndarray     # [B, budget] int64
    parents: np.ndarray    # [B, budget] int64, output node numbers (0: the root)
    num_nodes: np.ndarray  # [B] int64
    scores: np.ndarray     # [B, budget] float64: each node's score (0 where unused)
    recycled: np.ndarray   # [B, budget] bool: the node comes from recycled successors alone


@numba.njit(cache=True, nogil=True)
def _source_token(sources, s, pos):
    if s < sources.history.shape[0]:
        return sources.history[s, pos]
    return sources.corpus_tokens[sources.corpus_offsets[s - sources.history.shape[0]] + pos]


@numba.njit(cache=True, nogil=True)
def _source_length(sources, s):
    if s < sources.history.shape[0]:
        return sources.indexed[s]
    d = s - sources.history.shape[0]
    return sources.corpus_offsets[d + 1] - sources.corpus_offsets[d]


@numba.njit(cache=True, nogil=True)
def _match(sources, row, length, s, pos, longest):
    """How many tokens ending at position `pos` of source `s` equal the row's first `length`
    tokens' suffix (>= 1: `pos` holds the token at length - 1), at most `longest`."""
    m = 1
    while m < longest and pos - m >= 0 and length - 1 - m >= 0 and \
            _source_token(sources, s, pos - m) == sources.history[row, length - 1 - m]:
        m += 1
    return m


@numba.njit(cache=True, nogil=True)
def _find_candidates(sources, params, row, length, scratch, t):
    """Stage 1: earlier occurrences of the row's last token matching at least min_ngram suffix
    tokens, newest first: the row's own (up to max_candidates; then, among the next ones up to
    RECORD_SCAN * max_candidates occurrences walked in all, those matching more tokens than any
    newer one), then other sources' (up to max_candidates); then, if there were any, the
    substitution candidates (up to max_candidates // SUB_SHARE, own row): occurrences of the
    row's second-to-last token matching at least min_ngram tokens there and followed by another
    token than the row's last, their continuation starting after that token. Returns (how many,
    how many of them are regular ones (before the substitutions), the longest regular match)."""
    found, best_match, walked = 0, 0, 0
    pos = np.int64(sources.prev_own[row, length - 1])  # (int64: see NUMBA_TYPES)
    while pos >= 0 and walked < RECORD_SCAN * params.max_candidates:
        if found >= params.max_candidates and best_match >= params.longest:
            break  # nothing further back can match more
        m = _match(sources, row, length, row, pos, params.longest)
        if m >= params.min_ngram and (found < params.max_candidates or m > best_match):
            scratch.cand_source[t, found] = row
            scratch.cand_start[t, found] = pos + 1
            scratch.cand_match[t, found] = m
            best_match = max(best_match, m)
            found += 1
        walked += 1
        pos = np.int64(sources.prev_own[row, pos])
    last = sources.history[row, length - 1]
    if sources.cross:
        h = _slot(sources.any_keys, last)
        entry = sources.any_vals[h] if sources.any_keys[h] == last else -1
        own = found
        while entry >= 0 and found < own + params.max_candidates:
            s, pos = sources.entry_source[entry], sources.entry_pos[entry]
            if s != row and pos + 1 < _source_length(sources, s):
                m = _match(sources, row, length, s, pos, params.longest)
                if m >= params.min_ngram:
                    scratch.cand_source[t, found] = s
                    scratch.cand_start[t, found] = pos + 1
                    scratch.cand_match[t, found] = m
                    found += 1
                    best_match = max(best_match, m)
            entry = sources.entry_prev[entry]
    regular = found
    if regular == 0 or length < 3:
        return found, regular, best_match
    pos = np.int64(sources.prev_own[row, length - 2])
    while pos >= 0 and found < regular + max(params.max_candidates // SUB_SHARE, 1):
        if sources.history[row, pos + 1] != last:  # pos + 1 <= length - 2: inside the row
            m = _match(sources, row, length - 1, row, pos, params.longest)
            if m >= params.min_ngram:
                scratch.cand_source[t, found] = row
                scratch.cand_start[t, found] = pos + 2
                scratch.cand_match[t, found] = m
                found += 1
        pos = np.int64(sources.prev_own[row, pos])
    return found, regular, best_match


@numba.njit(cache=True, nogil=True)
def _insert(sources, row, length, depth_cap, s, start, w, n_nodes, root_first, scratch, t):
    """Add one candidate's continuation (up to depth_cap tokens of source s from `start`) to the
    trie with its vote `w`. Returns (the trie's node count, the root's first child)."""
    end = length if s == row else _source_length(sources, s)
    n = min(depth_cap, end - start)
    for d in range(n):
        scratch.path[t, d] = _source_token(sources, s, start + d)
    return _insert_path(n, w, np.int64(1), n_nodes, root_first, scratch, t)


@numba.njit(cache=True, nogil=True)
def _insert_path(n, w, text, n_nodes, root_first, scratch, t):
    """Add the path scratch.path[t, :n] to the trie with its vote `w` (`text` 1: a candidate of the
    text, 0: recycled successors). Returns (the trie's node count, the root's first child)."""
    trie, weight = scratch.trie, scratch.trie_weight
    node = -1  # the root
    for d in range(n):
        tok = scratch.path[t, d]
        child = root_first if node < 0 else trie[t, FIRST_CHILD, node]
        prev_sibling = -1
        while child >= 0 and trie[t, TOKEN, child] != tok:
            prev_sibling = child
            child = trie[t, NEXT_SIBLING, child]
        if child < 0:  # a new node, last among its siblings
            child = n_nodes
            n_nodes += 1
            trie[t, TOKEN, child] = tok
            trie[t, PARENT, child] = node
            trie[t, DEPTH, child] = d + 1
            trie[t, FIRST_CHILD, child] = -1
            trie[t, NEXT_SIBLING, child] = -1
            trie[t, ON_CHAIN, child] = 0
            trie[t, FROM_TEXT, child] = 0
            weight[t, child] = 0.0
            if prev_sibling >= 0:
                trie[t, NEXT_SIBLING, prev_sibling] = child
            elif node < 0:
                root_first = child
            else:
                trie[t, FIRST_CHILD, node] = child
        weight[t, child] += w
        if text:
            trie[t, FROM_TEXT, child] = 1
        node = child
    return n_nodes, root_first


@numba.njit(cache=True, nogil=True)
def _insert_recycled(sources, params, last, depth_cap, n_nodes, root_first, total, scratch, t):
    """Add the recycled paths of a row whose last token is `last` (drafting.recycle): for each of
    its first `params.recycled` successors, that token continued by the best-ranked successor of
    each token in turn, up to depth_cap tokens, voting recycle_weight * RECYCLE_RANK_DECAY ** rank.
    Returns (the trie's node count, the root's first child, the sum of the votes)."""
    succ = sources.successors
    w = params.recycle_weight
    for r in range(min(params.recycled, succ.shape[1])):
        tok = succ[last, r] if last < succ.shape[0] else -1
        if tok < 0:
            break
        n = 0
        while n < depth_cap and tok >= 0:
            scratch.path[t, n] = tok
            n += 1
            tok = succ[tok, 0] if tok < succ.shape[0] else -1
        n_nodes, root_first = _insert_path(n, w, np.int64(0), n_nodes, root_first, scratch, t)
        total += w
        w *= RECYCLE_RANK_DECAY
    return n_nodes, root_first, total


@numba.njit(cache=True, nogil=True)
def _mark_voted_path(root_first, scratch, t):
    """Mark ON_CHAIN the path that takes, from the root, the child with the most votes at every
    level (ties: the first created, i.e. the newest candidate's token)."""
    trie, weight = scratch.trie, scratch.trie_weight
    node = root_first
    while node >= 0:
        q, q_w = node, weight[t, node]
        child = trie[t, NEXT_SIBLING, node]
        while child >= 0:
            if weight[t, child] > q_w:
                q, q_w = child, weight[t, child]
            child = trie[t, NEXT_SIBLING, child]
        trie[t, ON_CHAIN, q] = 1
        node = trie[t, FIRST_CHILD, q]


@numba.njit(cache=True, nogil=True)
def _build_trie(sources, params, row, length, depth_cap, found, regular, best_match, scratch, t):
    """Stage 2: the trie of the candidates' continuations (up to depth_cap tokens each). Every
    candidate votes for the nodes on its path: drafting.ngram.vote (short_weight ** (best_match
    - its match length), more for the row's recent tokens); substitutions SUB_WEIGHT times that
    (their match counted up to best_match, never recent), or 0 below SUB_MIN_MATCH. Before the
    substitutions vote, the path that takes the child with the most votes at every level (ties:
    the first created) is marked ON_CHAIN: the chain drafter's rule over the regular candidates.
    Last come the recycled successors' paths, where the proposer drafts them (`_insert_recycled`).
    Returns (the root's first child, the sum of the votes)."""
    n_nodes, root_first = np.int64(0), np.int64(-1)  # (int64, not literals: see NUMBA_TYPES)
    total = 0.0
    need = max(SUB_MIN_MATCH, params.min_ngram)
    for j in range(found):
        if j == regular:  # the regular candidates are all in: mark the voted path
            _mark_voted_path(root_first, scratch, t)
        s, start = scratch.cand_source[t, j], scratch.cand_start[t, j]
        shortfall = best_match - min(scratch.cand_match[t, j], best_match)
        if j < regular:
            w = vote(params.short_weight, shortfall, start - 1 if s == row else -1, length - params.recent_window,
                     params.recent_weight)
            if w <= 0.0:
                continue
        elif scratch.cand_match[t, j] >= need:
            w = SUB_WEIGHT * vote(params.short_weight, shortfall, np.int64(-1), np.int64(0), 1.0)
        else:  # a substitution matching too little: its nodes only fill budget nothing else wants
            w = 0.0
        total += w
        n_nodes, root_first = _insert(sources, row, length, depth_cap, s, start, w, n_nodes, root_first, scratch, t)
    if found == regular:
        _mark_voted_path(root_first, scratch, t)
    if params.recycled > 0:
        last = sources.history[row, length - 1]
        n_nodes, root_first, total = _insert_recycled(sources, params, last, depth_cap, n_nodes, root_first, total,
                                                      scratch, t)
    return root_first, total


@numba.njit(cache=True, nogil=True)
def _keep_best(params, depth_cap, budget, decay, root_first, total, scratch, t, trees, i):
    """Stage 3: score every node (its share of the votes times decay per level below the first)
    and keep the best `budget` scoring at least min_score, best first (ties: creation order), as
    output row i; the voted path (ON_CHAIN) is kept whatever min_score says, so a tree never
    feeds less than the chain drafter would. A child never outscores its parent and is created
    after it, so the next best node is always a child of a kept one: it is picked from the
    frontier of the kept nodes' children. Returns the nodes kept."""
    trie = scratch.trie
    for d in range(depth_cap):  # a power, as the reference computes it
        scratch.decay_at_depth[t, d] = decay ** d
    n_front = 0
    child = root_first
    while child >= 0:
        trie[t, FRONTIER, n_front] = child
        n_front += 1
        child = trie[t, NEXT_SIBLING, child]
    n = 0
    while n < budget and n_front > 0:
        best, best_score, on_chain = -1, -1.0, -1
        for f in range(n_front):
            q = trie[t, FRONTIER, f]
            if trie[t, ON_CHAIN, q] == 1:
                on_chain = f
            score = scratch.trie_weight[t, q] / total * scratch.decay_at_depth[t, trie[t, DEPTH, q] - 1]
            if score > best_score or (score == best_score and q < trie[t, FRONTIER, best]):
                best, best_score = f, score
        if best_score < params.min_score:
            if on_chain < 0:
                break
            best = on_chain
        q = trie[t, FRONTIER, best]
        n_front -= 1
        trie[t, FRONTIER, best] = trie[t, FRONTIER, n_front]
        trees.scores[i, n] = scratch.trie_weight[t, q] / total * scratch.decay_at_depth[t, trie[t, DEPTH, q] - 1]
        trees.tokens[i, n] = trie[t, TOKEN, q]
        trees.recycled[i, n] = trie[t, FROM_TEXT, q] == 0
        parent = trie[t, PARENT, q]
        trees.parents[i, n] = 0 if parent < 0 else trie[t, OUTPUT_NODE, parent]
        n += 1
        trie[t, OUTPUT_NODE, q] = n
        child = trie[t, FIRST_CHILD, q]
        while child >= 0:
            trie[t, FRONTIER, n_front] = child
            n_front += 1
            child = trie[t, NEXT_SIBLING, child]
    return n


@numba.njit(cache=True, nogil=True)
def _has_recycled(sources, params, last):
    """Whether the row whose last token is `last` gets recycled paths."""
    succ = sources.successors
    return params.recycled > 0 and last < succ.shape[0] and succ[last, 0] >= 0


@numba.njit(cache=True, nogil=True)
def _tree_row(sources, params, rows, lengths, max_depth, decay, trees, i, scratch, t):
    """Output row i: the tree of history row rows[i], built in scratch slice t."""
    trees.tokens[i, :] = -1
    trees.parents[i, :] = -1
    trees.scores[i, :] = 0.0
    trees.recycled[i, :] = False
    trees.num_nodes[i] = 0
    row, length = rows[i], lengths[i]
    depth_cap = min(params.k, max_depth[i])
    budget = min(params.budget, max_depth[i])  # no more nodes than tokens the row may still emit
    if depth_cap <= 0 or budget <= 0 or length < 2:
        return
    found, regular, best_match = _find_candidates(sources, params, row, length, scratch, t)
    if found == 0 and not _has_recycled(sources, params, sources.history[row, length - 1]):
        return
    root_first, total = _build_trie(sources, params, row, length, depth_cap, found, regular, best_match, scratch, t)
    trees.num_nodes[i] = _keep_best(params, depth_cap, budget, decay[i], root_first, total, scratch, t, trees, i)


@numba.njit(parallel=True, cache=True, nogil=True)
def propose_tree_batch(sources, params, rows, lengths, max_depth, decay, trees, scratch):
    """Every output row's tree, in parallel: task t of the scratch's T takes rows t, t + T, ..."""
    tasks = scratch.cand_source.shape[0]
    for task in numba.prange(tasks):
        t = np.int64(task)  # (prange counts in uint64: see NUMBA_TYPES)
        for i in range(t, rows.shape[0], tasks):
            _tree_row(sources, params, rows, lengths, max_depth, decay, trees, i, scratch, t)


@numba.njit(cache=True, nogil=True)
def propose_tree_serial(sources, params, rows, lengths, max_depth, decay, trees, scratch):
    """`propose_tree_batch` on one thread (small batches), in scratch slice 0."""
    for i in range(rows.shape[0]):
        _tree_row(sources, params, rows, lengths, max_depth, decay, trees, i, scratch, np.int64(0))


class TreeProposer:
    """Candidate trees for a whole batch: at most `budget` draft nodes per row, paths of at most
    `k` tokens, matches measured as `NgramProposer` measures them (up to match_cap(max_ngram)
    tokens, at least min_ngram).

    Every earlier occurrence of the row's last token (up to `candidates(batch)` per kind of
    source, own row then the others, newest first, and the row's longer matches further back)
    votes for its continuation: `short_weight` ** (how many tokens its match falls short of the
    longest one), RECENT_WEIGHT times that among the row's last RECENT_WINDOW tokens
    (drafting.ngram.vote), so the longest matches decide and shorter ones break ties and fill
    the budget; substitution candidates (`_find_candidates`) vote SUB_WEIGHT times that. A
    node's score is the share of the votes that pass through it times `decay` per level below
    the first (an estimate of the chance that verification reaches it), and the tree keeps the
    `budget` best-scoring nodes, those scoring at least `min_score` (the per-step budget: see
    `propose`). The voted path (the child with the most votes at every level: `NgramProposer`'s
    draft where both see the same occurrences) is kept whatever `min_score` says."""

    def __init__(self, k: int, budget: int, max_ngram: int = 2, min_ngram: int = 1,
                 short_weight: float = SHORT_WEIGHT,
                 decay: float = 0.8, max_candidates: int = MAX_CANDIDATES, recycled: int = 0,
                 recycle_weight: float = RECYCLE_WEIGHT):
        from .ngram import PARALLEL_MIN_BATCH

        self.k = positive_int("prompt_lookup_num_tokens", k)
        self.budget = positive_int("prompt_lookup_tree_nodes", budget)
        self.max_ngram = positive_int("max_matching_ngram_size", max_ngram)
        self.min_ngram = positive_int("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_matching_ngram_size ({self.max_ngram})")
        if not 0.0 <= short_weight <= 1.0:
            raise ValueError(f"short_weight must be in [0, 1], got {short_weight}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.short_weight, self.decay = float(short_weight), float(decay)
        self.max_candidates = positive_int("max_candidates", max_candidates)
        # recycled successors drafted per row (drafting.recycle), read from the index's table
        self.recycled = positive_int("draft_recycled", recycled, minimum=0)
        if not recycle_weight > 0.0:
            raise ValueError(f"recycle_weight must be > 0, got {recycle_weight}")
        self.recycle_weight = float(recycle_weight)
        self._parallel_min = PARALLEL_MIN_BATCH
        self._scratch: Scratch | None = None
        hist = np.array([[1, 2, 1, 2, 1]] * PARALLEL_MIN_BATCH, dtype=np.int64)  # warm both kernels
        self.propose(hist[:1], np.array([5], dtype=np.int64))
        self.propose(hist, np.full(PARALLEL_MIN_BATCH, 5, dtype=np.int64))

    def _buffers(self) -> Scratch:
        """The scratch, one slice per parallel task (numba's thread count), for 3 * max_candidates
        candidates (own, other sources', substitutions: at most that many) and the own longer
        matches further back (at most one per match length), and a trie of their continuations
        (at most k nodes each)."""
        threads = numba.get_num_threads()
        if self._scratch is None or self._scratch.cand_source.shape[0] != threads:
            c = 3 * self.max_candidates + match_cap(self.max_ngram) + self.recycled
            n = c * self.k
            self._scratch = Scratch(cand_source=np.empty((threads, c), np.int64),
                                    cand_start=np.empty((threads, c), np.int64),
                                    cand_match=np.empty((threads, c), np.int64),
                                    trie=np.empty((threads, TRIE_FIELDS, n), np.int64),
                                    trie_weight=np.empty((threads, n)),
                                    decay_at_depth=np.empty((threads, self.k)),
                                    path=np.empty((threads, self.k), np.int64))
        return self._scratch

    def candidates(self, batch: int, cross: bool = False) -> int:
        """Candidates per row and kind of source for a step of `batch` rows: `max_candidates`,
        fewer when the batch would exceed CANDIDATE_WORK (counting both kinds when other sources
        are indexed; the substitutions, a SUB_SHARE-th as many, are not counted), at least
        MIN_CANDIDATES."""
        fair = CANDIDATE_WORK // (max(batch, 1) * (2 if cross else 1))
        return min(self.max_candidates, max(MIN_CANDIDATES, fair))

    def propose(self, history: np.ndarray, lengths: np.ndarray, max_depth: np.ndarray | None = None,
                min_score: float = 0.0, rows: np.ndarray | None = None, index: SuffixIndex | None = None,
                decay: np.ndarray | None = None, scores: np.ndarray | None = None,
                recycled: np.ndarray | None = None):
        """Trees for history rows `rows` [B] (default: every row) of `history` [R, W] int64, row
        r's tokens being history[r, :lengths[i]]. max_depth [B]: the longest path and most nodes
        allowed per row (the tokens it may still emit; default k). `min_score`: leave out nodes
        scoring below it (0: fill the budget). `index`: the loop's `SuffixIndex` (brought up to
        `lengths` here); None indexes these rows afresh. `decay` [B]: per-row decay (default: the
        proposer's), e.g. each row's measured acceptance rate. `scores` [B, budget] float64, where
        given, gets each kept node's score (0 where unused): nodes come best first, so the scores of a
        row never rise along its nodes, and cutting a row to its first n nodes keeps a tree.
        `recycled` [B, budget] bool, where given, gets which nodes come from recycled successors
        alone (drafting.recycle; False where a text candidate passes through the node). Returns
        (tokens [B, budget], parents [B, budget], num_nodes [B]), int64, -1 where unused."""
        history = np.ascontiguousarray(history, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        rows = np.arange(history.shape[0], dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        batch = rows.shape[0]
        decay = np.full(batch, self.decay) if decay is None else np.ascontiguousarray(decay, dtype=np.float64)
        if decay.shape != (batch,) or not ((decay > 0) & (decay <= 1)).all():
            raise ValueError(f"decay must be [{batch}] values in (0, 1]")
        if lengths.shape != (batch,):
            raise ValueError(f"lengths must have shape ({batch},), got {lengths.shape}")
        if max_depth is None:
            max_depth = np.full(batch, self.k, dtype=np.int64)
        max_depth = np.ascontiguousarray(max_depth, dtype=np.int64)
        if index is None:
            index = SuffixIndex(history.shape[0], history.shape[1])
        index.update(history, rows, lengths)
        if scores is not None and (scores.shape != (batch, self.budget) or scores.dtype != np.float64):
            raise ValueError(f"scores must be a float64 array of shape ({batch}, {self.budget})")
        if recycled is not None and (recycled.shape != (batch, self.budget) or recycled.dtype != np.bool_):
            raise ValueError(f"recycled must be a bool array of shape ({batch}, {self.budget})")
        trees = Trees(np.empty((batch, self.budget), dtype=np.int64), np.empty((batch, self.budget), dtype=np.int64),
                      np.empty(batch, dtype=np.int64),
                      scores if scores is not None else np.empty((batch, self.budget), dtype=np.float64),
                      recycled if recycled is not None else np.empty((batch, self.budget), dtype=np.bool_))
        params = TreeParams(k=self.k, budget=self.budget, max_candidates=self.candidates(batch, index.cross),
                            longest=match_cap(self.max_ngram), min_ngram=self.min_ngram,
                            short_weight=self.short_weight, recent_window=RECENT_WINDOW,
                            recent_weight=float(RECENT_WEIGHT),
                            min_score=float(min_score),
                            recycled=self.recycled if index.successors is not NO_SUCCESSORS else 0,
                            recycle_weight=self.recycle_weight)
        kernel = propose_tree_batch if batch >= self._parallel_min else propose_tree_serial
        kernel(index.sources(history), params, rows, lengths, max_depth, decay, trees, self._buffers())
        return trees.tokens, trees.parents, trees.num_nodes


def chain_budget(rate: np.ndarray, min_score: float) -> np.ndarray:
    """[B] int64: how many drafts of a chain are worth feeding, per row: draft j is reached with
    chance `rate`**j (the row's acceptance rate, acceptance_estimate), so the chain is cut before
    the first draft whose chance falls below `min_score` (a tree's nodes are cut by the same score).
    A `min_score` of 0 cuts nothing (the result is then larger than any chain).

    Example: rates [0.8, 0.5, 0.3] with min score 0.25 give [6, 2, 1]
    (0.8**6 = 0.26, 0.5**2 = 0.25, 0.3 ** 2 = 0.09)."""
    rate = np.asarray(rate, dtype=np.float64)
    if min_score <= 0.0:
        return np.full(rate.shape, np.iinfo(np.int32).max, dtype=np.int64)
    # the largest j with rate**j >= min_score; rates are below 1 (acceptance_estimate keeps them in [0.3, 0.97])
    j = np.floor(np.log(min_score) / np.log(np.clip(rate, 1e-9, 1 - 1e-9)) + 1e-9)
    return np.maximum(j, 0).astype(np.int64)


# prior of a row's acceptance rate (acceptance_estimate): draft replays on the builtin prompts
PRIOR_RATE, PRIOR_WEIGHT = 0.8, 4.0


RATE_MIN, RATE_MAX = 0.3, 0.97  # acceptance_estimate's bounds on a row's rate


def acceptance_estimate(accepted: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """The chance that a draft is accepted given its parent was, per row, from its `accepted`
    drafts and `rejected` verify steps (steps whose walk stopped at a node with children), pulled
    towards PRIOR_RATE by PRIOR_WEIGHT pseudo-drafts and kept in [0.3, 0.97]: the per-level decay
    of the row's next tree, so a row that copies its source gets deep trees and one that does
    not gets wide ones."""
    rate = (np.asarray(accepted) + PRIOR_RATE * PRIOR_WEIGHT) / (np.asarray(accepted) + np.asarray(rejected) + PRIOR_WEIGHT)
    return np.clip(rate, RATE_MIN, RATE_MAX)


def walks_rejected(paths: np.ndarray, accepted: np.ndarray, parents: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """[S] bool: whether each row's verify walk rejected a draft, i.e. stopped at a node with
    children. `paths` [S, K'] the accepted nodes (1-based, as the walks return them; a row's first
    `accepted` [S] entries), `parents` [S, K] the trees, of which a row's first `num_drafts` [S].

    Example: the tree root -> 1, 2; 1 -> 3 (parents [0, 0, 1]): a walk that took node 2 stopped
    at a leaf (False), one that took node 1 stopped above node 3 (True), and one that took
    nothing stopped at the root (True)."""
    paths, accepted, parents = np.asarray(paths), np.asarray(accepted), np.asarray(parents)
    rows = np.arange(len(accepted))
    last = np.where(accepted > 0, paths[rows, np.maximum(accepted - 1, 0)], 0)  # [S] 0: the root
    fed = np.arange(parents.shape[1])[None, :] < np.asarray(num_drafts)[:, None]  # [S, K]
    return ((parents == last[:, None]) & fed).any(axis=1)


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node of a chunk, root included: parents [n] (0-based chunk indices of the
    draft nodes' parents) -> [n + 1] int64 (root 0)."""
    d = np.zeros(len(parents) + 1, dtype=np.int64)
    for i, p in enumerate(parents):
        d[i + 1] = d[p] + 1
    return d


def ancestor_mask(parents: np.ndarray, width: int) -> np.ndarray:
    """[width, width] bool: row i is True at node i and its ancestors (chunk indices; the chunk
    is the root then the draft nodes). Rows past the tree (padding) see the root and themselves."""
    m = np.zeros((width, width), dtype=bool)
    m[np.arange(width), np.arange(width)] = True
    m[:, 0] = True
    for i, p in enumerate(parents):
        m[i + 1] |= m[p]
    return m


def accept_tree(targets: np.ndarray, tokens: np.ndarray, parents: np.ndarray) -> tuple[list[int], int]:
    """Walk one row's tree by its targets: `targets` [n + 1] the token each chunk node emits
    (the argmax, or a draw keyed by the node's output position: drafting.verify). A node is
    entered when its parent's target is its token; the first target that matches no child is
    the next token. Returns (accepted path as chunk indices of draft nodes, root excluded; the
    next token)."""
    path: list[int] = []
    node = 0
    while True:
        want = targets[node]
        nxt = 0
        for i in range(len(tokens)):
            if parents[i] == node and tokens[i] == want:
                nxt = i + 1
                break
        if nxt == 0:
            return path, int(want)
        path.append(nxt)
        node = nxt


def compaction(path: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) chunk offsets that move an accepted path's keys/values to where a
    chain would hold them: node path[j] -> offset j + 1. Only nodes not already in place."""
    src = np.asarray(path, dtype=np.int64)
    dst = np.arange(1, len(path) + 1, dtype=np.int64)
    moved = src != dst
    return src[moved], dst[moved]
