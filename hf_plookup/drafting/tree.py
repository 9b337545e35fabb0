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
"""

from __future__ import annotations

import numba
import numpy as np

from .suffix import SuffixIndex, _slot as _slot_any

__all__ = ["TreeProposer", "accept_tree", "acceptance_estimate", "ancestor_mask",
           "batch_min_score", "compaction", "depths", "walk_rejected"]

# candidates (earlier occurrences) per row and kind of source (own row, others) before ranking;
# each costs a few cache misses (its link and its tokens), so large batches get fewer: at most
# CANDIDATE_WORK per step over the batch, never under MIN_CANDIDATES (docs/results.md "Candidate trees":
# draft replays give under 1% fewer tokens per forward at 16-24 candidates than at 64, and
# proposer_bench's 256 rows of 8k tokens, 24 candidates each, take under 1 ms per step on 2 cores)
MAX_CANDIDATES = 64
MIN_CANDIDATES = 8
CANDIDATE_WORK = 6144
# the trie's integer fields per node (scratch [B, TRIE_FIELDS, nodes]): token, parent (-1: the
# root), depth, first child, next sibling (-1: none), output node (1-based, once kept), on the
# chain drafter's path (1) or not (0), and the frontier of step 3 (a list of trie nodes, not a
# per-node field)
TOK, PAR, DEP, CHILD, NEXT, OUT, PIN, FRONT = range(8)
TRIE_FIELDS = 8
# a node on the chain drafter's path scores PINNED + (k - depth): above every voted score (<= 1)
PINNED = 2.0


@numba.njit(cache=True, nogil=True)
def _src_tok(history, corpus_tokens, corpus_offsets, src, pos):
    """Token `pos` of source `src` (history rows first, then corpus documents)."""
    if src < history.shape[0]:
        return history[src, pos]
    return corpus_tokens[corpus_offsets[src - history.shape[0]] + pos]


@numba.njit(cache=True, nogil=True)
def _src_len(history, corpus_offsets, indexed, src):
    if src < history.shape[0]:
        return indexed[src]
    d = src - history.shape[0]
    return corpus_offsets[d + 1] - corpus_offsets[d]


@numba.njit(cache=True, nogil=True)
def _match(history, corpus_tokens, corpus_offsets, row, n_len, src, p, max_ngram):
    """How many tokens ending at source position p equal the row's suffix (>= 1: p holds the
    row's last token), at most max_ngram."""
    m = 1
    while m < max_ngram and p - m >= 0 and n_len - 1 - m >= 0 and \
            _src_tok(history, corpus_tokens, corpus_offsets, src, p - m) == history[row, n_len - 1 - m]:
        m += 1
    return m


@numba.njit(cache=True, nogil=True)
def _tree_row(history, rows, lengths, max_depth, k, budget, max_cand, max_ngram, min_ngram, short_weight, decay, min_score,
              prev_own, cross, any_keys, any_vals, e_src, e_pos, e_prev, corpus_tokens, corpus_offsets, indexed,
              tokens, parents, num_nodes, i, t, cand_s, cand_c, cand_m, trie, t_w, level):
    """Row i's tree, built in scratch slice t."""
    for j in range(budget):
        tokens[i, j] = -1
        parents[i, j] = -1
    num_nodes[i] = 0
    b = rows[i]
    n_len = lengths[i]
    cap = min(k, max_depth[i])
    budget = min(budget, max_depth[i])  # no more nodes than tokens the row may still emit (its cache reservation)
    if cap <= 0 or budget <= 0 or n_len < 2:
        return
    # 1. earlier occurrences of the last token with their match lengths, newest first: the row's
    #    own (up to max_cand), then the other sources' (up to as many again)
    #    The newest own occurrence with the longest match is the chain drafter's (`pin`).
    found = 0
    best_m = 0
    pin = -1
    p = prev_own[b, n_len - 1]
    while p >= 0 and found < max_cand:
        m = _match(history, corpus_tokens, corpus_offsets, b, n_len, b, p, max_ngram)
        if m >= min_ngram:
            cand_s[t, found] = b
            cand_c[t, found] = p + 1
            cand_m[t, found] = m
            if m > best_m:
                best_m = m
                pin = found
            found += 1
        p = prev_own[b, p]
    if cross:
        last = history[b, n_len - 1]
        h = _slot_any(any_keys, last)
        e = any_vals[h] if any_keys[h] == last else -1
        own = found
        while e >= 0 and found < own + max_cand:
            src, q = e_src[e], e_pos[e]
            if src != b and q + 1 < _src_len(history, corpus_offsets, indexed, src):
                m = _match(history, corpus_tokens, corpus_offsets, b, n_len, src, q, max_ngram)
                if m >= min_ngram:
                    cand_s[t, found] = src
                    cand_c[t, found] = q + 1
                    cand_m[t, found] = m
                    found += 1
                    best_m = max(best_m, m)
            e = e_prev[e]
    if found == 0:
        return
    # 2. a trie of all their continuations; a node's weight sums the weights of the occurrences
    #    through it (longest-match occurrences 1, shorter ones short_weight). Children hang off
    #    first-child / next-sibling links (creation order), so finding a child scans its siblings.
    #    The pinned occurrence's nodes are marked: the tree always holds the chain's draft.
    n_trie = 0
    total = 0.0
    root_child = -1
    for j in range(found):
        src, c = cand_s[t, j], cand_c[t, j]
        w = 1.0 if cand_m[t, j] == best_m else short_weight
        if w <= 0.0 and j != pin:
            continue
        total += w
        node = -1  # the root
        end = n_len if src == b else _src_len(history, corpus_offsets, indexed, src)
        for d in range(min(cap, end - c)):
            tok = _src_tok(history, corpus_tokens, corpus_offsets, src, c + d)
            child = root_child if node < 0 else trie[t, CHILD, node]
            last = -1
            while child >= 0 and trie[t, TOK, child] != tok:
                last = child
                child = trie[t, NEXT, child]
            if child < 0:
                child = n_trie
                trie[t, TOK, child] = tok
                trie[t, PAR, child] = node
                trie[t, DEP, child] = d + 1
                trie[t, CHILD, child] = -1
                trie[t, NEXT, child] = -1
                trie[t, PIN, child] = 0
                t_w[t, child] = 0.0
                if last >= 0:
                    trie[t, NEXT, last] = child
                elif node < 0:
                    root_child = child
                else:
                    trie[t, CHILD, node] = child
                n_trie += 1
            t_w[t, child] += w
            if j == pin:
                trie[t, PIN, child] = 1
            node = child
    # 3. score = share of the weight through the node, times decay per level (the chain's path:
    #    PINNED + k - depth, first); keep the best `budget` nodes scoring >= min_score, best first
    #    (ties: creation order). A child never outscores its parent and is created after it, so
    #    the next best node is always a child of a kept one: pick it from the frontier of kept
    #    nodes' children (parents come first).
    for d in range(cap):  # level[d]: the decay at depth d + 1 (a power, as the reference computes it)
        level[t, d] = decay[i] ** d
    n_front = 0
    child = root_child
    while child >= 0:
        trie[t, FRONT, n_front] = child
        n_front += 1
        child = trie[t, NEXT, child]
    n = 0
    while n < budget and n_front > 0:
        best, best_score = -1, -1.0
        for f in range(n_front):
            q = trie[t, FRONT, f]
            if trie[t, PIN, q] == 1:
                sc = PINNED + k - trie[t, DEP, q]
            else:
                sc = t_w[t, q] / total * level[t, trie[t, DEP, q] - 1]
            if sc > best_score or (sc == best_score and q < trie[t, FRONT, best]):
                best, best_score = f, sc
        if best_score < min_score:
            break
        q = trie[t, FRONT, best]
        n_front -= 1
        trie[t, FRONT, best] = trie[t, FRONT, n_front]
        tokens[i, n] = trie[t, TOK, q]
        parents[i, n] = 0 if trie[t, PAR, q] < 0 else trie[t, OUT, trie[t, PAR, q]]
        n += 1
        trie[t, OUT, q] = n  # trie node -> output node (1-based)
        child = trie[t, CHILD, q]
        while child >= 0:
            trie[t, FRONT, n_front] = child
            n_front += 1
            child = trie[t, NEXT, child]
    num_nodes[i] = n


@numba.njit(parallel=True, cache=True, nogil=True)
def propose_tree_batch(history, rows, lengths, max_depth, k, budget, max_cand, max_ngram, min_ngram, short_weight, decay,
                       min_score, prev_own, cross, any_keys, any_vals, e_src, e_pos, e_prev, corpus_tokens,
                       corpus_offsets, indexed, tokens, parents, num_nodes, cand_s, cand_c, cand_m, trie, t_w, level):
    """Fill tokens/parents [B, budget] (-1 where unused) and num_nodes [B] for history rows
    `rows` [B], in parallel: task t of the scratch arrays' T takes rows t, t + T, ... in slice t."""
    tasks = cand_s.shape[0]
    for t in numba.prange(tasks):
        for i in range(t, rows.shape[0], tasks):
            _tree_row(history, rows, lengths, max_depth, k, budget, max_cand, max_ngram, min_ngram, short_weight, decay,
                      min_score, prev_own, cross, any_keys, any_vals, e_src, e_pos, e_prev, corpus_tokens, corpus_offsets,
                      indexed, tokens, parents, num_nodes, i, t, cand_s, cand_c, cand_m, trie, t_w, level)


@numba.njit(cache=True, nogil=True)
def propose_tree_serial(history, rows, lengths, max_depth, k, budget, max_cand, max_ngram, min_ngram, short_weight, decay,
                        min_score, prev_own, cross, any_keys, any_vals, e_src, e_pos, e_prev, corpus_tokens,
                        corpus_offsets, indexed, tokens, parents, num_nodes, cand_s, cand_c, cand_m, trie, t_w, level):
    """`propose_tree_batch` on one thread (small batches), in scratch slice 0."""
    for i in range(rows.shape[0]):
        _tree_row(history, rows, lengths, max_depth, k, budget, max_cand, max_ngram, min_ngram, short_weight, decay, min_score,
                  prev_own, cross, any_keys, any_vals, e_src, e_pos, e_prev, corpus_tokens, corpus_offsets, indexed,
                  tokens, parents, num_nodes, i, 0, cand_s, cand_c, cand_m, trie, t_w, level)


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
        self._scratch: tuple[np.ndarray, ...] = ()
        hist = np.array([[1, 2, 1, 2, 1]] * PARALLEL_MIN_BATCH, dtype=np.int64)  # warm both kernels
        self.propose(hist[:1], np.array([5], dtype=np.int64))
        self.propose(hist, np.full(PARALLEL_MIN_BATCH, 5, dtype=np.int64))

    def _buffers(self) -> tuple[np.ndarray, ...]:
        """Scratch arrays, one slice per parallel task (numba's thread count; small, so each stays
        in its core's cache): candidates [T, 2C] (source, start, match length), the trie's integer
        fields [T, TRIE_FIELDS, 2C * k], its weights [T, 2C * k], the decay per level [T, k]."""
        threads = numba.get_num_threads()
        if not self._scratch or self._scratch[0].shape[0] != threads:
            c = 2 * self.max_candidates
            t = c * self.k
            self._scratch = (np.empty((threads, c), np.int64), np.empty((threads, c), np.int64),
                             np.empty((threads, c), np.int64), np.empty((threads, TRIE_FIELDS, t), np.int64),
                             np.empty((threads, t)), np.empty((threads, self.k)))
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
        tokens = np.empty((batch, self.budget), dtype=np.int64)
        parents = np.empty((batch, self.budget), dtype=np.int64)
        num = np.empty(batch, dtype=np.int64)
        kernel = propose_tree_batch if batch >= self._parallel_min else propose_tree_serial
        kernel(history, rows, lengths, max_depth, self.k, self.budget, self.candidates(batch, index.cross), self.max_ngram,
               self.min_ngram,
               self.short_weight, decay, float(min_score), *index.arrays(), tokens, parents, num,
               *self._buffers())
        return tokens, parents, num


def batch_min_score(base: float, batch: int, k: int, fixed_tokens: float | None) -> float:
    """The per-step budget of a batch: `base` (the min score that pays at batch 1) scaled by how
    much dearer a fed token is in a step of `batch` rows. With a step costing `fixed_tokens` + N
    tokens' worth for N fed tokens, a node pays when its score beats the step's yield times one
    token's share of the step; the yield grows with the batch, the share falls more slowly:
    base * batch * (F + 1 + k) / (F + batch * (1 + k)), at most 1. None: `base` at any batch."""
    if fixed_tokens is None or batch <= 1:
        return base
    return min(1.0, base * batch * (fixed_tokens + 1 + k) / (fixed_tokens + batch * (1 + k)))


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
