"""How many tokens each row feeds in a uniform verify step, from what steps measured to cost.

Where verify steps are uniform (CUDA graphs, compiled steps: every row feeds the same number of
tokens q, missing drafts padded), a step's cost depends on q and the batch, not on how many drafts
a row really has; and on a GPU it grows with q in steps, by the shapes its kernels tile, not in
proportion. So the engine picks one width per step: the q (among a few candidates up to the
drafter's most nodes + 1) that maximizes the tokens the step is expected to emit per second of
step, each row's drafts cut to its first q - 1. Every draft comes with its chance to be accepted
(a chain's draft j: rate**(j + 1), the row's acceptance estimate; a tree's node: what nodes of its
score were accepted so far, engine.budget.Acceptance), best first, so a row feeding its first m
drafts emits 1 + (their chances' sum) tokens on average. The seconds come from the steps
themselves (`StepCosts`, per width and batch bucket); a width not yet measured at a bucket is
tried once, then judged by its measurement.
"""

from __future__ import annotations

import numba
import numpy as np


def candidate_widths(k: int, nodes: int = 0) -> tuple[int, ...]:
    """The widths a call drafting chains of up to k tokens (or trees of `nodes` nodes) chooses
    among: plain decoding (1), a chain's k drafts (k + 1), from k = 3 about half of them, and a
    tree's every node (nodes + 1); few, as each width is a graph (or a compiled step) per bucket
    of its own.

    Example: candidate_widths(8) == (1, 5, 9); candidate_widths(2) == (1, 3);
    candidate_widths(8, nodes=16) == (1, 5, 9, 17)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, got {nodes}")
    return tuple(sorted({1, k // 2 + 1 if k >= 3 else 1, k + 1} | ({nodes + 1} if nodes else set())))


def chain_chances(rates: np.ndarray, k: int) -> np.ndarray:
    """[B, k] the chance that each of a chain's drafts is accepted: rate**(j + 1) for draft j
    (the rows' acceptance estimates `rates` [B]).

    Example: chain_chances([0.5], 3) == [[0.5, 0.25, 0.125]]."""
    r = np.clip(np.asarray(rates, dtype=np.float64), 0.0, 1.0)
    return r[:, None] ** np.arange(1, k + 1)[None, :]


def expected_tokens(chances: np.ndarray, drafts: np.ndarray, width: int) -> float:
    """Tokens a step of `width` tokens per row is expected to emit over rows whose drafts have
    `chances` [B, K] to be accepted (best first) and `drafts` [B] drafts available: sum over rows
    of 1 + the chances of its first m drafts, m its drafts cut to width - 1.

    Example: chances [[0.5, 0.25, 0.125, 0.0625], [0.8, 0.64, 0, 0]], drafts [4, 1], width 3:
    (1 + 0.5 + 0.25) + (1 + 0.8) = 3.55."""
    chances = np.asarray(chances, dtype=np.float64)
    m = np.minimum(np.asarray(drafts, dtype=np.int64), width - 1)
    fed = np.arange(chances.shape[1])[None, :] < m[:, None]  # [B, K]
    return float(len(m) + (chances * fed).sum())


class StepCosts:
    """Seconds of uniform steps, per (width, batch bucket): a running mean that follows drift
    (each new step weighs `weight`), from steps that neither compiled nor captured anything."""

    def __init__(self, weight: float = 0.2):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.seconds: dict[tuple[int, int], float] = {}
        self.fixed = False  # costs given, not measured: steps recorded later are left out

    @classmethod
    def given(cls, seconds: dict[tuple[int, int], float]) -> "StepCosts":
        """Costs given rather than measured (tests: widths that do not depend on the machine's
        speed), by (width, batch bucket); no step recorded later changes them.

        Example: StepCosts.given({(1, 1): 3e-3, (5, 1): 4e-3}).get(5, 1) == 4e-3."""
        costs = cls()
        costs.seconds = {(int(w), int(b)): float(t) for (w, b), t in seconds.items()}
        costs.fixed = True
        return costs

    def record(self, width: int, bucket: int, seconds: float) -> None:
        if self.fixed:
            return
        key = (width, bucket)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + self.weight * (seconds - old)

    def get(self, width: int, bucket: int) -> float | None:
        return self.seconds.get((width, bucket))


def choose_width(costs: StepCosts, bucket: int, widths: tuple[int, ...], chances: np.ndarray,
                 drafts: np.ndarray) -> int:
    """The width of the next uniform step of a batch in `bucket`, among the candidates up to the
    first that feeds every row's drafts: the widest whose cost at this bucket is not measured yet
    (tried once), else the one that emits the most tokens per second of step by `expected_tokens`
    (`chances` [B, K] and `drafts` [B] as there) and the measured costs.

    Example: costs at bucket 1 of 3.0 ms (width 1), 3.6 ms (width 5) and 4.8 ms (width 9), one row
    of 8 drafts with chances 0.5, 0.25, 0.125, ... (a rate of 0.5): tokens per ms 0.33, 0.54 and
    0.42, so width 5."""
    drafts = np.asarray(drafts, dtype=np.int64)
    most = max(drafts.tolist(), default=0) + 1  # the width that feeds every draft (a list's max: no numpy call)
    cover = min((w for w in widths if w >= most), default=max(widths))
    usable = [w for w in widths if w <= cover]  # wider ones would only feed padding
    unmeasured = [w for w in usable if costs.get(w, bucket) is None]
    if unmeasured:
        return max(unmeasured)
    tokens = expected_tokens_by_width(chances, drafts, max(usable))
    return max(usable, key=lambda w: (tokens[w - 1] / costs.get(w, bucket), -w))


def expected_tokens_by_width(chances: np.ndarray, drafts: np.ndarray, widest: int) -> np.ndarray:
    """[widest] `expected_tokens` of every width 1..widest at once (entry w - 1: width w): one
    compiled pass over the rows instead of a few numpy calls per width (a step's choice is on the
    host's critical path).

    Example: chances [[0.5, 0.25, 0.125, 0.0625], [0.8, 0.64, 0, 0]], drafts [4, 1], widest 3:
    [2.0, 3.3, 3.55]."""
    out = np.empty(widest)
    _tokens_by_width(np.ascontiguousarray(chances, dtype=np.float64), np.ascontiguousarray(drafts, dtype=np.int64),
                     out)
    return out


@numba.njit(cache=True, nogil=True)
def _tokens_by_width(chances, drafts, out):
    b, k = chances.shape
    per_draft = np.zeros(k)  # draft j's chances, summed over the rows that have it
    for i in range(b):
        for j in range(min(drafts[i], k)):
            per_draft[j] += chances[i, j]
    fed = 0.0
    for w in range(out.shape[0]):  # width w + 1 feeds drafts 0..w-1
        if 0 < w <= k:
            fed += per_draft[w - 1]
        out[w] = b + fed
