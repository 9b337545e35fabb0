"""Batched n-gram (prompt-lookup) proposer: numpy in, numpy out, one numba call per step.

Every earlier occurrence of a row's last token (the newest CHAIN_SCAN) is a candidate, ranked
by its match length: how many tokens ending there equal the row's suffix, measured up to
`match_cap(max_ngram)` tokens (at least min_ngram). The candidates vote for what followed them,
the longest matches with weight 1 and shorter ones with SHORT_WEIGHT per token shorter (and
RECENT_WEIGHT times that among the row's last RECENT_WINDOW tokens: `vote`): the draft takes,
token by token, the continuation with the most votes among the candidates that agree with the
draft so far (ties: the most recent voter's token). A long match pins down where the row is
copying from; where it pins several places, the continuation they share most is the likelier
one, where HF's rule (longest n-gram up to max_ngram, then its most recent occurrence) takes
the newest.

Example (k=2, max_ngram=2): the row `1 2 3 1 2 3 1 2 4 1 2` ends in `1 2`, which occurred at
positions 0-1, 3-4 and 6-7, each matching two suffix tokens (the token before each differs from
the `4` before the suffix, or there is none), followed by `3 1`, `3 1` and (newest) `4 1`; all lie
among the last RECENT_WINDOW tokens, so they weigh alike. `3` has two votes against one: the
draft is `3 1` (HF's rule gives `4 1`).
"""

from __future__ import annotations

import numba
import numpy as np

from ..base.checks import positive_int

__all__ = ["NgramProposer", "match_cap", "parallel_search", "propose_batch", "propose_serial", "vote"]

# match lengths are measured up to this many tokens (or max_ngram if larger): a longer match
# tells apart occurrences that a short n-gram cannot
LONG_MATCH = 16
# a candidate's vote is SHORT_WEIGHT ** (how many tokens its match falls short of the longest):
# shorter matches only break ties and fill in where the longest ones' continuations end
SHORT_WEIGHT = 0.135
# occurrences among the row's last RECENT_WINDOW tokens vote RECENT_WEIGHT times: a row tends to
# repeat its own recent phrasing rather than an older wording of the same words
RECENT_WINDOW = 32
RECENT_WEIGHT = 3.0
# the most candidates that vote, the longest matches first (newest first within a length),
# among the newest CHAIN_SCAN occurrences
CHAIN_CANDIDATES = 64
CHAIN_SCAN = 256


@numba.njit(cache=True, nogil=True)
def vote(short_weight, shortfall, pos, recent_from, recent_weight):
    """An occurrence's vote (the chain's and the trees' rule): short_weight ** shortfall (how many
    tokens its match falls short of the longest), times recent_weight if its last matched token,
    at `pos`, lies among the row's last tokens: pos >= recent_from (the row's length less
    RECENT_WINDOW; pos < 0: another source, never recent). The kernels take RECENT_WINDOW and
    RECENT_WEIGHT as arguments, so numba's cache never keeps stale ones.

    Example: short_weight 0.135, a match one token short of the longest, at position 70 of a
    100-token row (recent_from 68), recent_weight 3: 0.405; at position 60: 0.135."""
    w = short_weight ** shortfall
    if pos >= 0 and pos >= recent_from:
        w *= recent_weight
    return w


def match_cap(max_ngram: int) -> int:
    """The longest match length the drafters measure: max(max_ngram, LONG_MATCH)."""
    return max(int(max_ngram), LONG_MATCH)


@numba.njit(cache=True, nogil=True)
def _propose_row(history, rows, lengths, max_drafts, k, longest, min_ngram, recent, drafts, num_drafts, b, scratch):
    """Entry b of `propose_batch` (its tokens: history row rows[b]), in `scratch` [4, W] (the
    occurrences' continuation starts and match lengths, then the voters').

    One backward pass finds the newest CHAIN_SCAN occurrences of the last token (continuation
    start c) and their match lengths m(c) = largest j <= min(longest, c) with
    t[c-j:c] == t[n-j:n]; the voters are the CHAIN_CANDIDATES longest; then the vote (`vote`),
    one depth at a time (candidates whose continuation ends, at the row's end, stop voting).
    """
    for j in range(k):
        drafts[b, j] = -1
    num_drafts[b] = 0
    n_len = lengths[b]
    cap = min(k, max_drafts[b])
    if cap <= 0 or n_len < 2:
        return
    row = history[rows[b]]
    last = row[n_len - 1]
    found = 0
    best = 0
    # c = start of the continuation; c <= n_len - 1 keeps the suffix itself out of the search.
    walked = 0
    for c in range(n_len - 1, 0, -1):
        if row[c - 1] != last:
            continue
        if walked == CHAIN_SCAN:
            break
        walked += 1
        lim = min(longest, c)
        m = 1
        while m < lim and row[c - 1 - m] == row[n_len - 1 - m]:
            m += 1
        if m >= min_ngram:
            scratch[0, found] = c
            scratch[1, found] = m
            found += 1
            best = max(best, m)
    if found == 0:
        return
    # the voters: the CHAIN_CANDIDATES longest matches (newest first within the shortest
    # length taken), kept in recency order (as a trie of the same occurrences adds their votes)
    count = np.zeros(best + 1, dtype=np.int64)
    for i in range(found):
        count[scratch[1, i]] += 1
    cut, room, taken = min_ngram, found, 0
    for m in range(best, min_ngram - 1, -1):
        if taken + count[m] >= CHAIN_CANDIDATES:
            cut, room = m, CHAIN_CANDIDATES - taken
            break
        taken += count[m]
    n = 0
    for i in range(found):
        m = scratch[1, i]
        if m > cut or (m == cut and room > 0):
            room -= m == cut
            scratch[2, n] = scratch[0, i]
            scratch[3, n] = m
            n += 1
    voters, match = scratch[2], scratch[3]
    # the vote, depth by depth, among the voters that agree with the draft so far: each distinct
    # next token (in the order the voters, newest first, name it) adds up its votes
    tokens = scratch[0]  # free once the voters are out
    votes = np.empty(n)
    cnt = 0
    while cnt < cap:
        distinct = 0
        for i in range(n):
            c = voters[i]
            if c + cnt >= n_len:
                continue
            tok = row[c + cnt]
            j = 0
            while j < distinct and tokens[j] != tok:
                j += 1
            if j == distinct:
                tokens[j] = tok
                votes[j] = 0.0
                distinct += 1
            votes[j] += vote(recent[0], best - match[i], c - 1, n_len - recent[1], recent[2])
        if distinct == 0:
            break
        top = 0
        for j in range(1, distinct):
            if votes[j] > votes[top]:
                top = j
        pick = tokens[top]
        drafts[b, cnt] = pick
        kept = 0
        for i in range(n):
            c = voters[i]
            if c + cnt < n_len and row[c + cnt] == pick:
                voters[kept] = c
                match[kept] = match[i]
                kept += 1
        n = kept
        cnt += 1
    num_drafts[b] = cnt


@numba.njit(parallel=True, cache=True, nogil=True)
def propose_batch(history, rows, lengths, max_drafts, k, longest, min_ngram, recent, drafts, num_drafts, scratch):
    """Fill drafts [B, k] (-1 where unused) and num_drafts [B] for every entry in one call,
    entries in parallel. history: [R, L] int64, entry b's tokens are history[rows[b], :lengths[b]];
    rows, lengths, max_drafts: [B]; longest: match_cap(max_ngram); recent: (SHORT_WEIGHT, RECENT_WINDOW,
    RECENT_WEIGHT), `vote`'s constants; scratch [T, 4, L] int64: task t of T takes rows t, t + T, ..."""
    tasks = scratch.shape[0]
    for t in numba.prange(tasks):
        for b in range(t, lengths.shape[0], tasks):
            _propose_row(history, rows, lengths, max_drafts, k, longest, min_ngram, recent, drafts, num_drafts, b,
                         scratch[t])


@numba.njit(cache=True, nogil=True)
def propose_serial(history, rows, lengths, max_drafts, k, longest, min_ngram, recent, drafts, num_drafts, scratch):
    """`propose_batch` on one thread (scratch slice 0): for small batches, where waking numba's
    worker threads costs more than the search (and, on a small CPU, competes with torch's threads)."""
    for b in range(lengths.shape[0]):
        _propose_row(history, rows, lengths, max_drafts, k, longest, min_ngram, recent, drafts, num_drafts, b,
                     scratch[0])


# batches below this many rows, or whose rows hold fewer than PARALLEL_MIN_TOKENS tokens in all,
# are searched on one thread: the search's work grows with the tokens scanned, and waking numba's
# worker threads costs more than a serial search of fewer tokens; far more where the host's other
# cores are busy (other processes, a GPU's launching thread), as a worker then waits for a core
PARALLEL_MIN_BATCH = 32
PARALLEL_MIN_TOKENS = 1 << 17


def parallel_search(lengths: np.ndarray) -> bool:
    """Whether a batch of rows of `lengths` [B] tokens is searched in parallel (`propose_batch`)
    rather than on one thread (`propose_serial`).

    Example: 64 rows of 400 tokens: False (25,600 tokens); 64 rows of 4,096: True."""
    return len(lengths) >= PARALLEL_MIN_BATCH and int(lengths.sum()) >= PARALLEL_MIN_TOKENS


class NgramProposer:
    """Prompt-lookup drafts for a whole batch: HF's argument meanings (k drafts, suffixes of
    min_ngram tokens or more), the draft chosen by the vote of the longest matches (module
    docstring) rather than HF's most recent match of at most max_ngram tokens."""

    def __init__(self, k: int, max_ngram: int = 2, min_ngram: int = 1):
        self.k = positive_int("prompt_lookup_num_tokens", k)
        self.max_ngram = positive_int("max_matching_ngram_size", max_ngram)
        self.min_ngram = positive_int("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"min_ngram ({self.min_ngram}) must be <= max_matching_ngram_size ({self.max_ngram})"
            )
        self._warm_up()

    def _warm_up(self) -> None:
        # Compiles (or loads from numba's on-disk cache) the specializations real calls use: both kernels.
        hist = np.array([[1, 2, 1, 2, 1]], dtype=np.int64)  # [1, 5]
        self.propose(hist, np.array([5], dtype=np.int64))
        self.propose(hist, np.array([5], dtype=np.int64), parallel=True)

    def propose_rows(self, history: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                     max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`propose(history, lengths, max_drafts, rows=rows)` of the engine's own arrays, which
        it keeps well-formed (int64, contiguous, `rows` within `history`, `lengths` within its
        width, one of each per row): without `propose`'s checks, a dozen numpy calls of fixed
        cost on every step."""
        drafts = np.empty((len(rows), self.k), dtype=np.int64)  # [B, k]
        num = np.empty(len(rows), dtype=np.int64)  # [B]
        kernel = propose_batch if parallel_search(lengths) else propose_serial
        scratch = np.empty((numba.get_num_threads() if kernel is propose_batch else 1, 4, history.shape[1]),
                           dtype=np.int64)
        kernel(history, rows, lengths, max_drafts, self.k, match_cap(self.max_ngram), self.min_ngram,
               (float(SHORT_WEIGHT), RECENT_WINDOW, float(RECENT_WEIGHT)), drafts, num, scratch)
        return drafts, num

    def propose(
        self,
        history: np.ndarray,
        lengths: np.ndarray,
        max_drafts: np.ndarray | None = None,
        out: tuple[np.ndarray, np.ndarray] | None = None,
        rows: np.ndarray | None = None,
        parallel: bool | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return (drafts [B, k] int64, -1 where unused; num_drafts [B] int64) for the B rows
        `rows` of `history` [R, L] (default: every row, B = R), whose tokens are
        history[rows[b], :lengths[b]]; the rows are read in place, not copied. `parallel`: the
        parallel kernel or the serial one (None: by the batch's size, `parallel_search`).

        Example: NgramProposer(4).propose([[7, 1, 2, 1, 2, 1]], [6]) gives drafts [[2, 1, 2, 1]]
        and num_drafts [4] (the last token, 1, was followed by 2, 1, 2, 1); with history
        [[5, 5, 5, 5, 5, 5], [7, 1, 2, 1, 2, 1]] and rows [1], the same."""
        history = np.ascontiguousarray(history, dtype=np.int64)  # [R, L]
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)  # [B]
        if history.ndim != 2:
            raise ValueError(f"history must be 2-D [B, L], got shape {history.shape}")
        width = history.shape[1]
        if rows is None:
            rows = np.arange(history.shape[0], dtype=np.int64)
        else:
            rows = np.ascontiguousarray(rows, dtype=np.int64)  # [B]
            if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= history.shape[0])):
                raise ValueError(f"rows must be 1-D indices of history's {history.shape[0]} rows")
        batch = len(rows)
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
        if parallel is None:
            parallel = parallel_search(lengths)
        kernel = propose_batch if parallel else propose_serial
        # per call (the proposer keeps no state): only the pages a row's occurrences fill are touched
        scratch = np.empty((numba.get_num_threads() if kernel is propose_batch else 1, 4, width), dtype=np.int64)
        kernel(history, rows, lengths, max_drafts, self.k, match_cap(self.max_ngram), self.min_ngram,
               (float(SHORT_WEIGHT), RECENT_WINDOW, float(RECENT_WEIGHT)), drafts, num, scratch)
        return drafts, num
