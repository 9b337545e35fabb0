"""Candidate trees: several prompt-lookup continuations per sequence, merged into one token tree
and verified in one forward.

A row's tree has `n` draft nodes (node 0, the root, is the row's last token and is not stored
here). Node i (1-based) holds `tokens[i-1]` and hangs under `parents[i-1]` (0 = the root); a
parent always comes before its children, so node order is a topological order. The candidates
come from every earlier occurrence of the row's suffix (matched over up to max_ngram tokens, as
the chain proposer matches): their continuations form a trie in which each node counts the
occurrences passing through it, and the tree keeps the best-scoring nodes (`TreeProposer`).
Shared prefixes are fed once; each path is at most `k` tokens long (`prompt_lookup_num_tokens`).

Verification feeds node i at position `start + depth(i)` and lets it attend to the cached
context and to its ancestors only (`ancestor_mask`); the accepted path's keys/values are then
moved to the positions a chain would have used (`compaction`).

The kernel runs per row in three stages over the records below: `_find_candidates`,
`_build_trie`, `_keep_best`.

Example (k=2, 4 nodes, max_ngram 2): the row `5 6 7 5 6 8 5 6` ends in `5 6`, which occurred
at positions 0-1 and 3-4, followed by `7 5` and `8 5`. The newest, `8 5`, is the chain drafter's
path and comes first; `7 5` holds half the votes (score 0.5, its `5` 0.5 * 0.8). Output:
tokens `[8, 5, 7, 5]`, parents `[0, 1, 0, 3]` (node 2 under node 1, node 4 under node 3).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from .suffix import SuffixIndex, _slot

__all__ = ["TreeProposer", "accept_tree", "acceptance_estimate", "ancestor_mask",
           "batch_min_score", "chain_budget", "compaction", "depths", "walk_rejected"]

# earlier occurrences ranked per row and kind of source (own row, others); each costs a few cache
# misses, so a large batch gets fewer: at most CANDIDATE_WORK over the batch, never under
# MIN_CANDIDATES (measured in docs/results.md, "Candidate trees")
MAX_CANDIDATES = 64
MIN_CANDIDATES = 8
CANDIDATE_WORK = 6144
# a node on the chain drafter's path scores CHAIN_SCORE + (k - depth): above every voted score (<= 1)
CHAIN_SCORE = 2.0
# the trie's integer fields per node, rows of Scratch.trie [T, TRIE_FIELDS, nodes]
TOKEN = 0         # the token it drafts
PARENT = 1        # its parent trie node (-1: the root)
DEPTH = 2         # 1 for the root's children
FIRST_CHILD = 3   # children are a list in creation order: the first child ...
NEXT_SIBLING = 4  # ... and each child's next sibling (-1: none)
OUTPUT_NODE = 5   # its node number in the output tree (1-based), once kept
ON_CHAIN = 6      # 1 on the chain drafter's path
FRONTIER = 7      # not a per-node field: the list of candidate nodes while keeping the best
TRIE_FIELDS = 8


class TreeParams(NamedTuple):
    """How every row's tree of one `propose` call is drafted."""

    k: int                # the longest path (prompt_lookup_num_tokens)
    budget: int           # the most draft nodes per row
    max_candidates: int   # earlier occurrences per row and kind of source
    max_ngram: int        # the longest suffix matched
    min_ngram: int        # the shortest match an occurrence needs
    short_weight: float   # an occurrence's vote when its match is shorter than the best one
    min_score: float      # nodes scoring below it are left out


class Scratch(NamedTuple):
    """Working arrays, one slice per parallel task t (small: each stays in its core's cache)."""

    cand_source: np.ndarray     # [T, 2C] a candidate occurrence's source
    cand_start: np.ndarray      # [T, 2C] the position of the token after it (its continuation)
    cand_match: np.ndarray      # [T, 2C] how many suffix tokens it matches
    trie: np.ndarray            # [T, TRIE_FIELDS, 2C * k] int64 fields above
    trie_weight: np.ndarray     # [T, 2C * k] the votes through each trie node
    decay_at_depth: np.ndarray  # [T, k] decay ** (depth - 1)


class Trees(NamedTuple):
    """The output: each row's draft nodes in topological order, -1 where unused."""

    tokens: np.ndarray     # [B, budget] int64
    parents: np.ndarray    # [B, budget] int64, output node numbers (0: the root)
    num_nodes: np.ndarray  # [B] int64


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
def _match(sources, row, length, s, pos, max_ngram):
    """How many tokens ending at position `pos` of source `s` equal the row's suffix (>= 1: `pos`
    holds the row's last token), at most max_ngram."""
    m = 1
    while m < max_ngram and pos - m >= 0 and length - 1 - m >= 0 and \
            _source_token(sources, s, pos - m) == sources.history[row, length - 1 - m]:
        m += 1
    return m


@numba.njit(cache=True, nogil=True)
def _find_candidates(sources, params, row, length, scratch, t):
    """Stage 1: earlier occurrences of the row's last token matching at least min_ngram suffix
    tokens, newest first: the row's own (up to max_candidates), then other sources' (as many
    again). Returns (how many, the longest match, which one is the chain drafter's: the newest
    own occurrence with the longest match)."""
    found, best_match, chain = 0, 0, -1
    pos = sources.prev_own[row, length - 1]
    while pos >= 0 and found < params.max_candidates:
        m = _match(sources, row, length, row, pos, params.max_ngram)
        if m >= params.min_ngram:
            scratch.cand_source[t, found] = row
            scratch.cand_start[t, found] = pos + 1
            scratch.cand_match[t, found] = m
            if m > best_match:
                best_match, chain = m, found
            found += 1
        pos = sources.prev_own[row, pos]
    if not sources.cross:
        return found, best_match, chain
    last = sources.history[row, length - 1]
    h = _slot(sources.any_keys, last)
    entry = sources.any_vals[h] if sources.any_keys[h] == last else -1
    own = found
    while entry >= 0 and found < own + params.max_candidates:
        s, pos = sources.entry_source[entry], sources.entry_pos[entry]
        if s != row and pos + 1 < _source_length(sources, s):
            m = _match(sources, row, length, s, pos, params.max_ngram)
            if m >= params.min_ngram:
                scratch.cand_source[t, found] = s
                scratch.cand_start[t, found] = pos + 1
                scratch.cand_match[t, found] = m
                found += 1
                best_match = max(best_match, m)
        entry = sources.entry_prev[entry]
    return found, best_match, chain


@numba.njit(cache=True, nogil=True)
def _build_trie(sources, params, row, length, depth_cap, found, best_match, chain, scratch, t):
    """Stage 2: the trie of the candidates' continuations (up to depth_cap tokens each). Every
    candidate votes for the nodes on its path: 1 with the longest match, short_weight with a
    shorter one; the chain drafter's path is marked ON_CHAIN. Returns (the root's first child,
    the sum of the votes)."""
    trie, weight = scratch.trie, scratch.trie_weight
    n_nodes = 0
    total = 0.0
    root_first = -1
    for j in range(found):
        s, start = scratch.cand_source[t, j], scratch.cand_start[t, j]
        vote = 1.0 if scratch.cand_match[t, j] == best_match else params.short_weight
        if vote <= 0.0 and j != chain:
            continue
        total += vote
        node = -1  # the root
        end = length if s == row else _source_length(sources, s)
        for d in range(min(depth_cap, end - start)):
            tok = _source_token(sources, s, start + d)
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
                weight[t, child] = 0.0
                if prev_sibling >= 0:
                    trie[t, NEXT_SIBLING, prev_sibling] = child
                elif node < 0:
                    root_first = child
                else:
                    trie[t, FIRST_CHILD, node] = child
            weight[t, child] += vote
            if j == chain:
                trie[t, ON_CHAIN, child] = 1
            node = child
    return root_first, total


@numba.njit(cache=True, nogil=True)
def _keep_best(params, depth_cap, budget, decay, root_first, total, scratch, t, trees, i):
    """Stage 3: score every node (its share of the votes times decay per level below the first;
    the chain's path CHAIN_SCORE + k - depth, ahead of all) and keep the best `budget` scoring at
    least min_score, best first (ties: creation order), as output row i. A child never outscores
    its parent and is created after it, so the next best node is always a child of a kept one:
    it is picked from the frontier of the kept nodes' children. Returns the nodes kept."""
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
        best, best_score = -1, -1.0
        for f in range(n_front):
            q = trie[t, FRONTIER, f]
            if trie[t, ON_CHAIN, q] == 1:
                score = CHAIN_SCORE + params.k - trie[t, DEPTH, q]
            else:
                score = scratch.trie_weight[t, q] / total * scratch.decay_at_depth[t, trie[t, DEPTH, q] - 1]
            if score > best_score or (score == best_score and q < trie[t, FRONTIER, best]):
                best, best_score = f, score
        if best_score < params.min_score:
            break
        q = trie[t, FRONTIER, best]
        n_front -= 1
        trie[t, FRONTIER, best] = trie[t, FRONTIER, n_front]
        trees.tokens[i, n] = trie[t, TOKEN, q]
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
def _tree_row(sources, params, rows, lengths, max_depth, decay, trees, i, scratch, t):
    """Output row i: the tree of history row rows[i], built in scratch slice t."""
    trees.tokens[i, :] = -1
    trees.parents[i, :] = -1
    trees.num_nodes[i] = 0
    row, length = rows[i], lengths[i]
    depth_cap = min(params.k, max_depth[i])
    budget = min(params.budget, max_depth[i])  # no more nodes than tokens the row may still emit
    if depth_cap <= 0 or budget <= 0 or length < 2:
        return
    found, best_match, chain = _find_candidates(sources, params, row, length, scratch, t)
    if found == 0:
        return
    root_first, total = _build_trie(sources, params, row, length, depth_cap, found, best_match, chain, scratch, t)
    trees.num_nodes[i] = _keep_best(params, depth_cap, budget, decay[i], root_first, total, scratch, t, trees, i)


@numba.njit(parallel=True, cache=True, nogil=True)
def propose_tree_batch(sources, params, rows, lengths, max_depth, decay, trees, scratch):
    """Every output row's tree, in parallel: task t of the scratch's T takes rows t, t + T, ..."""
    tasks = scratch.cand_source.shape[0]
    for t in numba.prange(tasks):
        for i in range(t, rows.shape[0], tasks):
            _tree_row(sources, params, rows, lengths, max_depth, decay, trees, i, scratch, t)


@numba.njit(cache=True, nogil=True)
def propose_tree_serial(sources, params, rows, lengths, max_depth, decay, trees, scratch):
    """`propose_tree_batch` on one thread (small batches), in scratch slice 0."""
    for i in range(rows.shape[0]):
        _tree_row(sources, params, rows, lengths, max_depth, decay, trees, i, scratch, 0)


class TreeProposer:
    """Candidate trees for a whole batch: at most `budget` draft nodes per row, paths of at most
    `k` tokens, matches as `NgramProposer` finds them (HF's `max_matching_ngram_size`).

    Every earlier occurrence of the row's suffix (up to `candidates(batch)` per kind of source,
    own row then the others, newest first) votes for
    its continuation: occurrences with the longest match weigh 1, shorter matches
    `short_weight`. A node's score is the share of the votes that pass through it times
    `decay` per level below the first (an estimate of the chance that verification reaches
    it), and the tree keeps the `budget` best-scoring nodes, those scoring at least
    `min_score` (the per-step budget: see `propose`). The chain drafter's draft (the newest own
    occurrence with the longest match) is pinned ahead of every voted node and kept whatever
    `min_score` says, so the tree always holds it as its first path."""

    def __init__(self, k: int, budget: int, max_ngram: int = 2, min_ngram: int = 1, short_weight: float = 0.25,
                 decay: float = 0.8, max_candidates: int = MAX_CANDIDATES):
        from .ngram import PARALLEL_MIN_BATCH, _check_int

        self.k = _check_int("prompt_lookup_num_tokens", k)
        self.budget = _check_int("prompt_lookup_tree_nodes", budget)
        self.max_ngram = _check_int("max_matching_ngram_size", max_ngram)
        self.min_ngram = _check_int("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_matching_ngram_size ({self.max_ngram})")
        if not 0.0 <= short_weight <= 1.0:
            raise ValueError(f"short_weight must be in [0, 1], got {short_weight}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.short_weight, self.decay = float(short_weight), float(decay)
        self.max_candidates = _check_int("max_candidates", max_candidates)
        self._parallel_min = PARALLEL_MIN_BATCH
        self._scratch: Scratch | None = None
        hist = np.array([[1, 2, 1, 2, 1]] * PARALLEL_MIN_BATCH, dtype=np.int64)  # warm both kernels
        self.propose(hist[:1], np.array([5], dtype=np.int64))
        self.propose(hist, np.full(PARALLEL_MIN_BATCH, 5, dtype=np.int64))

    def _buffers(self) -> Scratch:
        """The scratch, one slice per parallel task (numba's thread count), for 2 * max_candidates
        candidates and a trie of their continuations (at most k nodes each)."""
        threads = numba.get_num_threads()
        if self._scratch is None or self._scratch.cand_source.shape[0] != threads:
            c = 2 * self.max_candidates
            n = c * self.k
            self._scratch = Scratch(cand_source=np.empty((threads, c), np.int64),
                                    cand_start=np.empty((threads, c), np.int64),
                                    cand_match=np.empty((threads, c), np.int64),
                                    trie=np.empty((threads, TRIE_FIELDS, n), np.int64),
                                    trie_weight=np.empty((threads, n)),
                                    decay_at_depth=np.empty((threads, self.k)))
        return self._scratch

    def candidates(self, batch: int, cross: bool = False) -> int:
        """Candidates per row and kind of source for a step of `batch` rows: `max_candidates`,
        fewer when the batch would exceed CANDIDATE_WORK (counting both kinds when other sources
        are indexed), at least MIN_CANDIDATES."""
        fair = CANDIDATE_WORK // (max(batch, 1) * (2 if cross else 1))
        return min(self.max_candidates, max(MIN_CANDIDATES, fair))

    def propose(self, history: np.ndarray, lengths: np.ndarray, max_depth: np.ndarray | None = None,
                min_score: float = 0.0, rows: np.ndarray | None = None, index: SuffixIndex | None = None,
                decay: np.ndarray | None = None):
        """Trees for history rows `rows` [B] (default: every row) of `history` [R, W] int64, row
        r's tokens being history[r, :lengths[i]]. max_depth [B]: the longest path and most nodes
        allowed per row (the tokens it may still emit; default k). `min_score`: leave out nodes
        scoring below it (0: fill the budget). `index`: the loop's `SuffixIndex` (brought up to
        `lengths` here); None indexes these rows afresh. `decay` [B]: per-row decay (default: the
        proposer's), e.g. each row's measured acceptance rate. Returns (tokens [B, budget], parents
        [B, budget], num_nodes [B]), int64, -1 where unused."""
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
        trees = Trees(np.empty((batch, self.budget), dtype=np.int64), np.empty((batch, self.budget), dtype=np.int64),
                      np.empty(batch, dtype=np.int64))
        params = TreeParams(k=self.k, budget=self.budget, max_candidates=self.candidates(batch, index.cross),
                            max_ngram=self.max_ngram, min_ngram=self.min_ngram, short_weight=self.short_weight,
                            min_score=float(min_score))
        kernel = propose_tree_batch if batch >= self._parallel_min else propose_tree_serial
        kernel(index.sources(history), params, rows, lengths, max_depth, decay, trees, self._buffers())
        return trees.tokens, trees.parents, trees.num_nodes


def batch_min_score(base: float, batch: int, k: int, fixed_tokens: float | None) -> float:
    """The per-step budget of a batch: `base` (the min score that pays at batch 1) scaled by how
    much dearer a fed token is in a step of `batch` rows. With a step costing `fixed_tokens` + N
    tokens' worth for N fed tokens, a node pays when its score beats the step's yield times one
    token's share of the step; the yield grows with the batch, the share falls more slowly:
    base * batch * (F + 1 + k) / (F + batch * (1 + k)), at most 1. None: `base` at any batch."""
    if fixed_tokens is None or batch <= 1:
        return base
    return min(1.0, base * batch * (fixed_tokens + 1 + k) / (fixed_tokens + batch * (1 + k)))


def chain_budget(rate: np.ndarray, min_score: float) -> np.ndarray:
    """[B] int64: how many drafts of a chain are worth feeding, per row: draft j is reached with
    chance `rate`**j (the row's acceptance rate, acceptance_estimate), so the chain is cut before
    the first draft whose chance falls below `min_score` (the tree budget's rule, batch_min_score).
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


def acceptance_estimate(accepted: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """The chance that a draft is accepted given its parent was, per row, from its `accepted`
    drafts and `rejected` verify steps (steps whose walk stopped at a node with children), pulled
    towards PRIOR_RATE by PRIOR_WEIGHT pseudo-drafts and kept in [0.3, 0.97]: the per-level decay
    of the row's next tree, so a row that copies its source gets deep trees and one that does
    not gets wide ones."""
    rate = (np.asarray(accepted) + PRIOR_RATE * PRIOR_WEIGHT) / (np.asarray(accepted) + np.asarray(rejected) + PRIOR_WEIGHT)
    return np.clip(rate, 0.3, 0.97)


def walk_rejected(path, parents: np.ndarray) -> bool:
    """Whether a verify step's walk rejected a draft: it stopped at a node with children. `path`:
    the accepted nodes (1-based, as the walks return them), `parents`: the tree's [n]."""
    end = int(path[-1]) if len(path) else 0  # the last accepted node (0: the root)
    return bool((np.asarray(parents) == end).any())


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
