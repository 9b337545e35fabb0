"""Draft acceptance."""

from __future__ import annotations

import numpy as np


def greedy_accept(drafts: np.ndarray, targets: np.ndarray) -> int:
    """Number of leading drafts equal to the model's argmax at their position.

    drafts: [m] proposed tokens; targets: [m + 1] argmax after the last token and after each draft.
    The token appended after them is `targets[returned]` (a correction, or the bonus when all match).
    """
    m = len(drafts)
    if len(targets) != m + 1:
        raise ValueError(f"targets must have len(drafts) + 1 = {m + 1} entries, got {len(targets)}")
    mismatch = np.flatnonzero(drafts != targets[:m])
    return int(mismatch[0]) if len(mismatch) else m
