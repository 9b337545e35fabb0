"""Incremental occurrence index over every drafting source: each row's prompt and generated
tokens and, opt-in, the other rows of the same engine loop and a user corpus (`draft_corpus`).

What a drafter asks: "where did the row's last token occur before, newest first, and how many
tokens before it match the row's suffix?". Scanning the history for that costs O(history) per
row and step; this index answers it by walking only the occurrences of the last token, through
links set once when each token is appended (amortized O(1) per token, no rescans):

- own row: `prev_own[r, p]` = the previous position of row r holding the same token as
  position p (-1: none). The walk starts at `prev_own[r, n - 1]` (the last token's previous
  occurrence) and follows the links.
- other sources (cross rows, corpus): one entry per indexed token (source, position, previous
  entry with the same token), newest first from `head_any[token]`.

Tokens are keyed by open-addressing hash tables (numpy arrays, numba kernels; one per row for
the own-row links, so rows are indexed in parallel, and one shared table for the other
sources), so the index needs no vocabulary size. Sources: history rows 0..R-1, then corpus documents R, R+1, ...
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

__all__ = ["SuffixIndex"]

_EMPTY = -1
PARALLEL_MIN_ROWS = 32  # rows from which an update indexes rows in parallel (drafting.ngram's threshold)


@numba.njit(cache=True, nogil=True)
def _slot(keys, key):
    """Slot of `key` in the table (where it is, or the empty slot where it would go)."""
    mask = keys.shape[0] - 1
    h = (key * 0x9E3779B97F4A7C15) & mask  # Fibonacci hashing (wraps in int64: fine for a hash)
    while keys[h] != _EMPTY and keys[h] != key:
        h = (h + 1) & mask
    return h


@numba.njit(cache=True, nogil=True)
def _index_own_row(history, r, start, stop, prev_own, own_keys, own_vals):
    """Link positions start..stop-1 of row r to the previous position holding the same token
    (the row's own table: token -> its newest position)."""
    keys, vals = own_keys[r], own_vals[r]
    for p in range(start, stop):
        tok = history[r, p]
        h = _slot(keys, tok)
        if keys[h] == _EMPTY:
            keys[h] = tok
            prev_own[r, p] = -1
        else:
            prev_own[r, p] = vals[h]
        vals[h] = p


@numba.njit(parallel=True, cache=True, nogil=True)
def _index_own_batch(history, rows, lengths, indexed, prev_own, own_keys, own_vals):
    """Own-row links of every row in `rows`, rows in parallel (each row has its own table)."""
    for i in numba.prange(rows.shape[0]):
        r = rows[i]
        _index_own_row(history, r, indexed[r], lengths[i], prev_own, own_keys, own_vals)
        if lengths[i] > indexed[r]:
            indexed[r] = lengths[i]


@numba.njit(cache=True, nogil=True)
def _index_own_serial(history, rows, lengths, indexed, prev_own, own_keys, own_vals):
    """`_index_own_batch` on one thread (small batches)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        _index_own_row(history, r, indexed[r], lengths[i], prev_own, own_keys, own_vals)
        if lengths[i] > indexed[r]:
            indexed[r] = lengths[i]


@numba.njit(cache=True, nogil=True)
def _link(tok, src, pos, n, e_src, e_pos, e_prev, any_keys, any_vals):
    """Entry n: token `tok` at position `pos` of source `src`, linked to the previous entry of
    the same token in the shared table."""
    h = _slot(any_keys, tok)
    e_src[n] = src
    e_pos[n] = pos
    if any_keys[h] == _EMPTY:
        any_keys[h] = tok
        e_prev[n] = -1
    else:
        e_prev[n] = any_vals[h]
    any_vals[h] = n


@numba.njit(cache=True, nogil=True)
def _index_cross(history, rows, lengths, indexed, e_src, e_pos, e_prev, n_entries, any_keys, any_vals):
    """Entries of the shared table (other-row sources) for positions indexed[r]..lengths[i]-1 of
    each row r = rows[i], serial (one table for every row). Returns the new entry count."""
    n = n_entries
    for i in range(rows.shape[0]):
        r = rows[i]
        for p in range(indexed[r], lengths[i]):
            _link(history[r, p], r, p, n, e_src, e_pos, e_prev, any_keys, any_vals)
            n += 1
    return n


@numba.njit(cache=True, nogil=True)
def _index_corpus(tokens, offsets, first_src, e_src, e_pos, e_prev, n_entries, any_keys, any_vals):
    n = n_entries
    for d in range(offsets.shape[0] - 1):
        for p in range(offsets[d], offsets[d + 1]):
            _link(tokens[p], first_src + d, p - offsets[d], n, e_src, e_pos, e_prev, any_keys, any_vals)
            n += 1
    return n


def _capacity(n: int) -> int:
    return 1 << max(int(2 * max(n, 1) - 1).bit_length(), 4)  # power of two >= 2n


def _table(n: int) -> tuple[np.ndarray, np.ndarray]:
    cap = _capacity(n)
    return np.full(cap, _EMPTY, dtype=np.int64), np.empty(cap, dtype=np.int64)


NO_SUCCESSORS = np.full((1, 1), -1, dtype=np.int64)  # Sources.successors where none are kept


class Sources(NamedTuple):
    """Where candidates come from: history rows 0..R-1, then the corpus documents (`SuffixIndex`)."""

    history: np.ndarray         # [R, W] int64, the rows' tokens
    indexed: np.ndarray         # [R] how many of each row's tokens the index holds
    prev_own: np.ndarray        # [R, W] the previous position of the same token in the row (-1: none)
    cross: bool                 # whether other sources are indexed at all
    any_keys: np.ndarray        # hash table token -> newest entry of other sources ...
    any_vals: np.ndarray        # ... (entry index, -1 where the key is not there)
    entry_source: np.ndarray    # [E] an entry's source (history row or R + document)
    entry_pos: np.ndarray       # [E] its position in that source
    entry_prev: np.ndarray      # [E] the entry before it with the same token (-1: none)
    corpus_tokens: np.ndarray   # every document's tokens, concatenated
    corpus_offsets: np.ndarray  # [D + 1] where each document starts
    successors: np.ndarray      # [V, width] recycled successors (drafting.recycle), or [1, 1] -1: none


class SuffixIndex:
    """The index of one engine loop (or of one stateless `TreeProposer.propose` call).

    `rows`/`width`: history rows and their capacity; `cross_rows`: other rows are sources too;
    `corpus`: token sequences (list of int arrays) that are sources for every row. Rows are
    indexed up to their current length by `update` before each query."""

    def __init__(self, rows: int, width: int, cross_rows: bool = False, corpus: list[np.ndarray] | None = None):
        self.rows, self.width = rows, width
        self.cross_rows = cross_rows
        docs = [np.asarray(d, dtype=np.int64) for d in (corpus or []) if len(d)]
        self.corpus_offsets = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in docs], out=self.corpus_offsets[1:])
        self.corpus_tokens = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        self.cross = cross_rows or bool(docs)  # whether the cross-source entries are kept at all
        self.indexed = np.zeros(rows, dtype=np.int64)  # [R] positions indexed per row
        self.prev_own = np.full((rows, width), -1, dtype=np.int32)  # [R, W]
        # one table per row (token -> newest position), so rows are indexed in parallel
        cap = _capacity(width)
        self.own_keys = np.full((rows, cap), _EMPTY, dtype=np.int64)
        self.own_vals = np.empty((rows, cap), dtype=np.int32)
        n_cross = (rows * width if cross_rows else 0) + len(self.corpus_tokens)
        self.e_src = np.empty(n_cross, dtype=np.int64)
        self.e_pos = np.empty(n_cross, dtype=np.int64)
        self.e_prev = np.empty(n_cross, dtype=np.int64)
        self.any_keys, self.any_vals = _table(n_cross)
        self.n_entries = 0
        # a drafting.recycle.SuccessorTable's array where the trees read recycled successors
        self.successors = NO_SUCCESSORS
        if len(self.corpus_tokens):
            self.n_entries = _index_corpus(self.corpus_tokens, self.corpus_offsets, rows, self.e_src, self.e_pos,
                                           self.e_prev, 0, self.any_keys, self.any_vals)

    def update(self, history: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Index rows `rows` [B] of `history` [R, W] up to `lengths` [B] tokens (their committed
        tokens; anything past them, drafts included, is never indexed)."""
        if history.shape[0] > self.rows or history.shape[1] > self.width:
            raise ValueError(f"history {history.shape} exceeds the index's rows/width ({self.rows}, {self.width})")
        if self.cross_rows:
            cap_ok = self.n_entries + int((lengths - self.indexed[rows]).clip(min=0).sum()) <= len(self.e_src)
            if not cap_ok:
                raise ValueError("index capacity exceeded")
        rows, lengths = rows.astype(np.int64), lengths.astype(np.int64)
        if self.cross_rows:  # before the own pass, which moves `indexed`
            self.n_entries = _index_cross(history, rows, lengths, self.indexed, self.e_src, self.e_pos, self.e_prev,
                                          self.n_entries, self.any_keys, self.any_vals)
        own = _index_own_batch if rows.shape[0] >= PARALLEL_MIN_ROWS else _index_own_serial
        own(history, rows, lengths, self.indexed, self.prev_own, self.own_keys, self.own_vals)

    def grow(self, rows: int, width: int) -> "SuffixIndex":
        """An index for more rows or a wider history holding the same sources (re-indexed by the
        next `update`): rows join an engine loop between steps."""
        corpus = [self.corpus_tokens[a:b] for a, b in zip(self.corpus_offsets[:-1], self.corpus_offsets[1:])]
        grown = SuffixIndex(rows, width, self.cross_rows, corpus)
        grown.successors = self.successors
        return grown

    def sources(self, history: np.ndarray):
        """What the tree kernel reads: `history` [R, W] and this index."""
        return Sources(history=history, indexed=self.indexed, prev_own=self.prev_own, cross=self.cross,
                       any_keys=self.any_keys, any_vals=self.any_vals, entry_source=self.e_src,
                       entry_pos=self.e_pos, entry_prev=self.e_prev, corpus_tokens=self.corpus_tokens,
                       corpus_offsets=self.corpus_offsets, successors=self.successors)
