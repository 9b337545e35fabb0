"""How many draft tokens each row feeds in an eager step, from what steps measured to cost and how
often drafts of each score were accepted (CPU; uniform CUDA-graph steps take a width instead:
engine.widths).

Every draft node a drafter offers comes with a score (drafting.tree: its share of the candidates'
votes times a per-level decay; a chain's draft j: the row's acceptance rate to the power j + 1), and
a row's nodes come best first, so any number of its first nodes is a chain prefix or a tree. A node
fed to a step adds a token when verification accepts it, which happens with probability p(score)
(`Acceptance`: counted per score bin over the steps so far, from a prior). A decode step over B rows
that feeds n draft nodes in all emits B + (sum of their p) tokens on average and costs c(B + n)
seconds (`FedCosts`: measured). `choose_drafts` feeds the n most likely nodes of the whole batch for
the n that maximizes tokens per second, n = 0 (plain decoding) included: drafting is not expected
to make a step slower than decoding without it, and a wide step is fed where the text copies well
enough to pay for it. On a CPU a fed token costs little while the weights' stream bounds the step
and about a token's share of the arithmetic once the arithmetic does; where that happens depends on
the machine, the dtype and the batch, hence measured rather than assumed.

Example: one row, nodes with p = 0.6, 0.3, 0.1, and steps that cost 10 ms for 1 fed token, 11 ms
for 2, 12 ms for 3 and 16 ms for 4. Tokens per ms: 1/10 = 0.100, 1.6/11 = 0.145, 1.9/12 = 0.158,
2.0/16 = 0.125: two drafts are fed.
"""

from __future__ import annotations

import numpy as np

# the prior of a node's chance to be accepted, PRIOR_SLOPE * its score with the weight of
# PRIOR_WEIGHT drafts per bin: draft replays of the shipped CNN/DailyMail and BillSum requests
# accepted about 0.6 of a tree node's score and a little less of a chain draft's, bin by bin
# (docs/results.md, "Draft budgets")
PRIOR_SLOPE = 0.6
PRIOR_WEIGHT = 8.0
# score bins: powers of two from 1/64, and the top quarter apart
SCORE_EDGES = np.array([1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4])
# a step's cost in tokens' worth that do not depend on how many are fed (the weights' stream, the
# layers' fixed work), for fed-token counts no step has measured yet: c(N) ~ FIXED_TOKENS + N,
# anchored at the nearest measured count. Larger than what a CPU's steps cost at small widths,
# so that wider steps are tried and measured rather than never fed.
FIXED_TOKENS = 19.0


class Acceptance:
    """How often fed draft nodes were accepted, per bin of their scores (SCORE_EDGES): p(score) =
    (accepted + PRIOR_SLOPE * bin score * PRIOR_WEIGHT) / (fed + PRIOR_WEIGHT), made non-decreasing
    in the score (a higher score never means a smaller chance), so that a row's nodes, best first,
    keep non-increasing chances. One per drafter kind (chain, tree), kept across calls.

    Example: nothing recorded, a score of 0.5 (bin [1/2, 3/4), taken at its middle 0.625) gives
    0.6 * 0.625 = 0.375; after 8 fed nodes of that bin with 1 accepted: (1 + 3) / 16 = 0.25."""

    def __init__(self):
        self.fed = np.zeros(len(SCORE_EDGES) + 1)
        self.accepted = np.zeros(len(SCORE_EDGES) + 1)
        edges = np.concatenate(([0.0], SCORE_EDGES, [1.0]))
        self._prior = PRIOR_SLOPE * (edges[:-1] + edges[1:]) / 2  # [bins] at each bin's middle

    def chances(self, scores: np.ndarray) -> np.ndarray:
        """p for every score (any shape)."""
        p = (self.accepted + self._prior * PRIOR_WEIGHT) / (self.fed + PRIOR_WEIGHT)
        return np.maximum.accumulate(p)[np.searchsorted(SCORE_EDGES, scores, side="right")]

    def record(self, scores: np.ndarray, accepted: np.ndarray) -> None:
        """Fed nodes' scores [n] and whether each was accepted [n] bool."""
        bins = np.searchsorted(SCORE_EDGES, scores, side="right")
        np.add.at(self.fed, bins, 1.0)
        np.add.at(self.accepted, bins, np.asarray(accepted, dtype=np.float64))


def fed_bucket(tokens: int) -> int:
    """The bucket of a step's fed-token count: exact up to 16, then by 8 up to 128, by 32 up to 512,
    by 128 beyond (steps of nearby counts cost alike; fewer buckets fill faster).

    Example: 9 -> 9, 21 -> 17, 130 -> 129, 600 -> 513."""
    if tokens <= 16:
        return tokens
    step = 8 if tokens <= 128 else 32 if tokens <= 512 else 128
    base = 16 if tokens <= 128 else 128 if tokens <= 512 else 512
    return base + 1 + (tokens - base - 1) // step * step


class FedCosts:
    """Seconds of eager decode/verify steps by the tokens they fed: per `fed_bucket` measured at
    least twice, the last `keep` steps' mean fed count and their fastest seconds (a step held up by
    the machine, or the first of its size, only ever adds time), non-decreasing in the count, and
    `seconds(n)` between them by linear interpolation; past the measured counts, or with none
    measured, the shape FIXED_TOKENS + n anchored at the nearest measured count (only ratios of
    costs matter)."""

    def __init__(self, keep: int = 8):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.steps: dict[int, list[tuple[int, float]]] = {}  # bucket -> its last steps (fed tokens, seconds)
        self.fixed = False  # costs given, not measured: steps recorded later are left out

    @classmethod
    def given(cls, seconds: dict[int, float]) -> "FedCosts":
        """Costs given rather than measured (a replay by a step bench's figures; tests): seconds by fed
        tokens, each counted as if measured, and no step recorded later changes them.

        Example: FedCosts.given({1: 0.02, 5: 0.024}).seconds(np.array([3])) == [0.022]."""
        costs = cls()
        for tokens, s in seconds.items():
            costs.steps[fed_bucket(int(tokens))] = [(int(tokens), float(s))] * 2  # (counted from a second step)
        costs.fixed = True
        return costs

    def record(self, tokens: int, seconds: float) -> None:
        if self.fixed:
            return
        last = self.steps.setdefault(fed_bucket(int(tokens)), [])
        last.append((int(tokens), float(seconds)))
        del last[: -self.keep]

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean fed tokens, seconds) per measured bucket, by count; seconds non-decreasing."""
        pts = sorted((float(np.mean([n for n, _ in v])), min(t for _, t in v)) for v in self.steps.values() if len(v) >= 2)
        xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        return xs, np.maximum.accumulate(ys) if len(ys) else ys

    def seconds(self, tokens: np.ndarray) -> np.ndarray:
        """The expected seconds of steps feeding `tokens` [n] tokens each."""
        n = np.asarray(tokens, dtype=np.float64)
        xs, ys = self.points()
        if not len(xs):
            return FIXED_TOKENS + n
        out = np.interp(n, xs, ys)
        lo, hi = n < xs[0], n > xs[-1]
        out[lo] = ys[0] * (FIXED_TOKENS + n[lo]) / (FIXED_TOKENS + xs[0])
        out[hi] = ys[-1] * (FIXED_TOKENS + n[hi]) / (FIXED_TOKENS + xs[-1])
        return out


def choose_drafts(chances: np.ndarray, offered: np.ndarray, costs: FedCosts) -> np.ndarray:
    """[B] int64: how many of its offered draft nodes each row feeds in the next step. `chances` [B, K]:
    each node's chance to be accepted (non-increasing along a row), `offered` [B]: the nodes each row
    has. The n nodes of highest chance over the batch are fed, n maximizing (B + their chances'
    sum) / costs.seconds(B + n), so each row feeds a prefix of its nodes (module docstring).

    Example: chances [[0.6, 0.3, 0.1]] offered [3], costs 10, 11, 12, 16 ms for 1-4 tokens: [2]."""
    rows = len(offered)
    if rows == 0:
        return np.zeros(0, dtype=np.int64)
    keep = np.arange(chances.shape[1])[None, :] < np.asarray(offered)[:, None]  # [B, K]
    p = chances[keep]  # row by row, each row's nodes in order
    row_of = np.nonzero(keep)[0]
    order = np.argsort(-p, kind="stable")  # ties keep a row's own order: its fed nodes are a prefix
    tokens = rows + np.concatenate(([0.0], np.cumsum(p[order])))
    n = int(np.argmax(tokens / costs.seconds(rows + np.arange(len(p) + 1))))
    return np.bincount(row_of[order[:n]], minlength=rows).astype(np.int64)


class DraftBudget:
    """An engine's draft budget for eager steps: the measured costs and the acceptance per drafter
    kind, kept across its calls (module docstring)."""

    def __init__(self):
        self.costs = FedCosts()
        self.acceptance = {"chain": Acceptance(), "tree": Acceptance()}
