"""A chain step's host work over all its rows in one compiled call each: the drafts' chances
(`chain_chances_of`) before the step, the walk and the appended tokens (`accept_chains`) after it.

What they replace is a few dozen numpy calls a step (acceptance estimates, chances, the walk's
inputs and outputs, the rows' counts), each of which costs the host more than its work on the
few rows of a small batch, and a Python loop that appends a large batch's tokens one by one:
the time a GPU waits through between two replays. Each kernel is checked against the plain
functions it stands for (drafting.tree.acceptance_estimate, engine.widths.chain_chances,
drafting.verify.accept_paths, engine.sequence.Sequence.append) in tests/engine/test_chains.py.
"""

from __future__ import annotations

import numba
import numpy as np

from ..drafting.tree import PRIOR_RATE, PRIOR_WEIGHT, RATE_MAX, RATE_MIN


@numba.njit(cache=True, nogil=True)
def _chain_chances(n_accepted, n_rejected, rows, k, prior, rate_min, rate_max, out):
    for i in range(rows.shape[0]):
        a = n_accepted[rows[i]]
        rate = (a + prior[0] * prior[1]) / (a + n_rejected[rows[i]] + prior[1])
        rate = min(max(rate, rate_min), rate_max)
        for j in range(k):
            out[i, j] = rate ** float(j + 1)


def chain_chances_of(n_accepted: np.ndarray, n_rejected: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """[B, k] the chance that each of a chain's k drafts is accepted, for the batch's `rows` [B]:
    `chain_chances(acceptance_estimate(n_accepted[rows], n_rejected[rows]), k)` in one call.

    Example: a row with 6 drafts accepted and 2 steps that rejected one has the rate
    (6 + 3.2) / (6 + 2 + 4) = 0.767 (PRIOR_RATE 0.8 over PRIOR_WEIGHT 4), so chances
    [0.767, 0.588, 0.451] for k = 3."""
    out = np.empty((len(rows), k))
    _chain_chances(n_accepted, n_rejected, rows, k, (float(PRIOR_RATE), float(PRIOR_WEIGHT)), RATE_MIN, RATE_MAX,
                   out)
    return out


@numba.njit(cache=True, nogil=True)
def _target(scores, given, n):
    """The token fed position n emits: scores[n, 0] where `given` (targets already chosen), else
    the argmax of its logits scores[n] (the first maximum; the first NaN if any, as numpy's)."""
    if given:
        return int(scores[n, 0])
    row = scores[n]
    best, at = row[0], 0
    if best != best:
        return 0
    for v in range(1, row.shape[0]):
        x = row[v]
        if x != x:
            return v
        if x > best:
            best, at = x, v
    return at


@numba.njit(cache=True, nogil=True)
def accept_chains(scores, given, n_pos, rows, drafts, history, num_tokens, remaining, eos, n_accepted, n_rejected,
                  accepted, emitted, finished):
    """Every row of a chain step at once. Row i (batch row rows[i]) fed its last token and its
    first n_pos[i] - 1 drafts (drafts[rows[i]]), whose positions o .. o + n_pos[i] - 1 (o: the
    rows before it, packed) emit the greedy targets of `scores`: [N, V] logits, whose argmax is
    taken only at the positions the walk reaches (`_target`), or, where `given`, [N, 1] targets
    chosen already (on the device). Its drafts are accepted while each equals the target before it
    (drafting.verify.accept_paths' walk on a chain), and the accepted drafts, then the target
    after them, are appended to history[rows[i]] from num_tokens[i] on, stopping after a token
    of `eos` (sorted) or at the row's `remaining` tokens (Sequence.append). Writes accepted[i],
    emitted[i] (tokens appended) and finished[i], and adds the row's accepted drafts to
    n_accepted[rows[i]] and, when it rejected one (took fewer than it fed), 1 to
    n_rejected[rows[i]]."""
    o = np.int64(0)  # (not the literal 0, which numba would compile _target for apart)
    for i in range(rows.shape[0]):
        r, m = rows[i], n_pos[i] - 1
        a = 0
        want = _target(scores, given, o)
        while a < m and drafts[r, a] == want:
            a += 1
            want = _target(scores, given, o + a)
        accepted[i] = a
        n_accepted[r] += a
        n_rejected[r] += a < m
        n, left, e, done = num_tokens[i], remaining[i], 0, False
        for j in range(a + 1):
            t = drafts[r, j] if j < a else want
            history[r, n] = t
            n += 1
            e += 1
            left -= 1
            lo, hi = 0, eos.shape[0]  # t in eos (a binary search of the sorted ids)
            while lo < hi:
                mid = (lo + hi) // 2
                if eos[mid] < t:
                    lo = mid + 1
                else:
                    hi = mid
            if (lo < eos.shape[0] and eos[lo] == t) or left <= 0:
                done = True
                break
        emitted[i], finished[i] = e, done
        o += n_pos[i]


# from this many rows of one call, a chain step's counts are tallied in one compiled pass
# (`count_chain_rows`); fewer take SpecStats' own per-row calls, cheaper than the pass's fixed cost
TALLY_MIN_ROWS = 8


@numba.njit(cache=True, nogil=True)
def _tally(n_pos, accepted, hist, drafted_at, accepted_at):
    drafted, taken = 0, 0
    for i in range(n_pos.shape[0]):
        m, a = n_pos[i] - 1, accepted[i]
        drafted += m
        taken += a
        hist[min(a, hist.shape[0] - 1)] += 1
        for j in range(min(m, drafted_at.shape[0])):
            drafted_at[j] += 1
            accepted_at[j] += j < a
    return drafted, taken


def count_chain_rows(stats, n_pos: np.ndarray, accepted: np.ndarray, emitted: np.ndarray) -> None:
    """What `stats.count_verify(m, a, m)` then `stats.count_emitted(e)` count for every row of a
    chain step of one call (m = n_pos - 1 drafts fed, the deepest being the last; a of them
    accepted; e tokens appended), counted in one pass: SpecStats' calls, row by row, are Python
    calls a large batch pays for on every step. Checked against those calls in
    tests/engine/test_chains.py.

    Example: rows that fed 4 drafts and accepted 2, and fed 2 and accepted 0, appending 3 and 1
    tokens, on stats of k = 4: drafted +6, accepted +2, verify_steps +2, accepted_hist [+1, 0,
    +1, 0, 0], drafted_per_position [+2, +2, +1, +1], accepted_per_position [+1, +1, 0, 0],
    row_steps +2, new_tokens +4."""
    hist = np.zeros(len(stats.accepted_hist), dtype=np.int64)
    drafted_at = np.zeros(len(stats.drafted_per_position), dtype=np.int64)
    accepted_at = np.zeros(len(stats.accepted_per_position), dtype=np.int64)
    drafted, taken = _tally(n_pos, accepted, hist, drafted_at, accepted_at)
    stats.drafted += int(drafted)
    stats.accepted += int(taken)
    stats.verify_steps += len(n_pos)
    for counts, into in ((hist, stats.accepted_hist), (drafted_at, stats.drafted_per_position),
                         (accepted_at, stats.accepted_per_position)):
        for j, c in enumerate(counts.tolist()):
            into[j] += c
    stats.row_steps += len(n_pos)
    stats.new_tokens += int(emitted.sum())
