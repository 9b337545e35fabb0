"""Stop checks inside an accepted run: HF stopping criteria (user criteria, stop strings,
max_time) evaluated after each candidate token, so nothing past a stop is emitted."""

from __future__ import annotations

import numpy as np
import torch
from transformers import StoppingCriteriaList

from ..drafting.sampling import rows_by_length


def first_stops(
    criteria: StoppingCriteriaList,
    rows: np.ndarray,  # [S] int64 row in `hf_rows` of each sequence
    starts: np.ndarray,  # [S] int64 where each sequence's candidates begin in its row
    counts: np.ndarray,  # [S] int64 number of candidate tokens (already written into hf_rows)
    hf_rows: np.ndarray,  # [B, L] int64 rows in HF's layout
    scores: torch.Tensor,  # [C, V] score row that produced each candidate (sequence-major, C = counts.sum())
) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: how many candidates to keep (up to and including the first token after
    which a criterion fires; `counts[s]` when none fires) and whether one fired ([S] bool)."""
    keep = counts.copy()
    if not criteria or counts.sum() == 0:
        return keep, np.zeros(len(counts), dtype=bool)
    seg = np.repeat(np.arange(len(rows)), counts)  # [C]
    i = np.arange(len(seg)) - np.repeat(np.cumsum(counts) - counts, counts)  # [C] candidate index
    lengths = starts[seg] + i + 1  # context length after candidate i
    fired = np.zeros(len(seg), dtype=bool)
    for idx, ids, sel in rows_by_length(hf_rows, rows[seg], lengths, scores.device):
        fired[idx] = criteria(ids, scores[sel]).cpu().numpy().astype(bool)
    np.minimum.at(keep, seg[fired], i[fired] + 1)
    stopped = np.zeros(len(counts), dtype=bool)
    stopped[seg[fired]] = True
    return keep, stopped
