"""Batched n-gram (prompt-lookup) proposer: numpy in, numpy out, one numba call per step.

For each row the suffix of length n (n = max_ngram down to min_ngram) is looked up in the
row's earlier tokens; the longest n that matches wins, and among matches of that n the most
recent one. The tokens that followed the match (up to the row's cap) are the drafts.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["NgramProposer", "propose_batch", "propose_serial"]


@numba.njit(cache=True, nogil=True)
def _propose_row(history, lengths, max_drafts, k, max_ngram, min_ngram, drafts, num_drafts, b):
    """Row b of `propose_batch`.

    One backward pass: for each continuation start c (newest first) the match length
    m(c) = largest j <= min(max_ngram, c) with t[c-j:c] == t[n-j:n]. The answer is the first c
    (i.e. the most recent) reaching the largest m(c) >= min_ngram; the pass stops early once a
    match of length max_ngram is found, since nothing can beat it.
    """
    for j in range(k):
        drafts[b, j] = -1
    num_drafts[b] = 0
    n_len = lengths[b]
    cap = min(k, max_drafts[b])
    if cap <= 0 or n_len < 2:
        return
    row = history[b]
    last = row[n_len - 1]
    best_n = 0
    best_c = -1
    # c = start of the continuation; c <= n_len - 1 keeps the suffix itself out of the search.
    for c in range(n_len - 1, 0, -1):
        if row[c - 1] != last:
            continue
        lim = min(max_ngram, c)
        m = 1
        while m < lim and row[c - 1 - m] == row[n_len - 1 - m]:
            m += 1
        if m > best_n and m >= min_ngram:
            best_n = m
            best_c = c
            if m == max_ngram:
                break
    if best_c < 0:
        return
    cnt = min(cap, n_len - best_c)
    for j in range(cnt):
        drafts[b, j] = row[best_c + j]
    num_drafts[b] = cnt


@numba.njit(parallel=True, cache=True, nogil=True)
def propose_batch(history, lengths, max_drafts, k, max_ngram, min_ngram, drafts, num_drafts):
    """Fill drafts [B, k] (-1 where unused) and num_drafts [B] for every row in one call,
    rows in parallel. history: [B, L] int64, row b's tokens are history[b, :lengths[b]];
    lengths, max_drafts: [B]."""
    for b in numba.prange(lengths.shape[0]):
        _propose_row(history, lengths, max_drafts, k, max_ngram, min_ngram, drafts, num_drafts, b)


@numba.njit(cache=True, nogil=True)
def propose_serial(history, lengths, max_drafts, k, max_ngram, min_ngram, drafts, num_drafts):
    """`propose_batch` on one thread: for small batches, where waking numba's worker threads
    costs more than the search (and, on a small CPU, competes with torch's threads)."""
    for b in range(lengths.shape[0]):
        _propose_row(history, lengths, max_drafts, k, max_ngram, min_ngram, drafts, num_drafts, b)


# batches below this many rows are searched on one thread
PARALLEL_MIN_BATCH = 32


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class NgramProposer:
    """Prompt-lookup drafts for a whole batch (HF's argument meanings, most-recent match)."""

    def __init__(self, k: int, max_ngram: int = 2, min_ngram: int = 1):
        self.k = _check_int("prompt_lookup_num_tokens", k)
        self.max_ngram = _check_int("max_matching_ngram_size", max_ngram)
        self.min_ngram = _check_int("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"min_ngram ({self.min_ngram}) must be <= max_matching_ngram_size ({self.max_ngram})"
            )
        self._warm_up()

    def _warm_up(self) -> None:
        # Compiles (or loads from numba's on-disk cache) the specialization real calls use.
        hist = np.array([[1, 2, 1, 2, 1]], dtype=np.int64)  # [1, 5]
        self.propose(hist, np.array([5], dtype=np.int64))
        many = np.repeat(hist, PARALLEL_MIN_BATCH, axis=0)  # [32, 5]: the parallel kernel
        self.propose(many, np.full(PARALLEL_MIN_BATCH, 5, dtype=np.int64))

    def propose(
        self,
        history: np.ndarray,
        lengths: np.ndarray,
        max_drafts: np.ndarray | None = None,
        out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return (drafts [B, k] int64, -1 where unused; num_drafts [B] int64)."""
        history = np.ascontiguousarray(history, dtype=np.int64)  # [B, L]
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)  # [B]
        if history.ndim != 2:
            raise ValueError(f"history must be 2-D [B, L], got shape {history.shape}")
        batch, width = history.shape
        if lengths.shape != (batch,):
            raise ValueError(f"lengths must have shape ({batch},), got {lengths.shape}")
        if batch and (lengths.min() < 0 or lengths.max() > width):
            raise ValueError(f"lengths must lie in [0, {width}]")
        if max_drafts is None:
            max_drafts = np.full(batch, self.k, dtype=np.int64)  # [B]
        else:
            max_drafts = np.ascontiguousarray(max_drafts, dtype=np.int64)  # [B]
            if max_drafts.shape != (batch,):
                raise ValueError(f"max_drafts must have shape ({batch},), got {max_drafts.shape}")
        if out is None:
            drafts = np.empty((batch, self.k), dtype=np.int64)  # [B, k]
            num = np.empty(batch, dtype=np.int64)  # [B]
        else:
            d_buf, n_buf = out
            if (d_buf.dtype != np.int64 or n_buf.dtype != np.int64 or d_buf.ndim != 2
                    or d_buf.shape[0] < batch or d_buf.shape[1] != self.k
                    or n_buf.ndim != 1 or n_buf.shape[0] < batch):
                raise ValueError(
                    f"out must be int64 buffers of shapes [>={batch}, {self.k}] and [>={batch}]"
                )
            drafts, num = d_buf[:batch], n_buf[:batch]  # views [B, k], [B]
        kernel = propose_batch if batch >= PARALLEL_MIN_BATCH else propose_serial
        kernel(history, lengths, max_drafts, self.k, self.max_ngram, self.min_ngram, drafts, num)
        return drafts, num
