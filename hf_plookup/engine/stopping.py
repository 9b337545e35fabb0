"""HF stopping criteria (user criteria, stop strings, max_time) called exactly as HF's `generate`
calls them: once per sequence length, with the whole batch `input_ids [B, length]` in the caller's
row order, rows that stopped earlier padded with `pad_token_id`.

Rows of a speculative batch grow at different speeds (one accepts 4 drafts, another 0), so the
checks lag behind: `BatchCriteria.checked` is the longest length checked so far. It advances one
length at a time while every row that is still going has a token at that length; a row ahead
keeps running, and its tokens past `checked` stay provisional until the checks for their lengths
have run. A check that says stop for a row cuts the row right after that length (the engine
drops the tokens after it). Criteria with per-row state (lm-eval's `MultiTokenEOSCriteria`) and
criteria returning one bool for the batch (broadcast by `StoppingCriteriaList` as in HF) thus see
the very sequence of calls HF makes.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import StoppingCriteriaList


class BatchCriteria:
    """The criteria calls of one `generate` call (its rows are rows 0..B-1 of `hf_rows`).

    `pad_finished`: HF pads rows that stopped when the call has EOS tokens (its
    `has_eos_stopping_criteria`); without EOS tokens a row stopped by a criterion keeps
    generating in HF until every row has stopped, and so it does here."""

    def __init__(self, criteria: StoppingCriteriaList, width: int, batch: int, pad_token_id: int | None,
                 pad_finished: bool, device: torch.device | str = "cpu"):
        self.criteria = criteria
        self.width = width  # W: HF's input width; checks start at length W + 1
        self.checked = width  # the longest length whose check ran
        self.pad = pad_token_id if pad_token_id is not None else 0
        self.pad_finished = pad_finished
        self.device = device
        self.stopped = np.zeros(batch, dtype=bool)  # [B] a criterion said stop (no-EOS mode: row still runs)
        self.step_scores: list[torch.Tensor] = []  # [B, V] per checked step (only when scores are recorded)
        self.calls = 0

    def advance(
        self,
        hf_rows: np.ndarray,  # [B, L] int64 rows in HF's layout (tokens valid up to `lengths`)
        lengths: np.ndarray,  # [B] int64 HF length of each row now (W + tokens generated)
        ended: np.ndarray,  # [B] bool row ended at its length (EOS, max_new_tokens, or cut earlier)
        scores_of=None,  # callable(step) -> [B, V] (HF's `scores` tuple gets one per step) or None
    ) -> dict[int, int]:
        """Run every check that can run now. Returns {row: new length} of rows to cut (and
        finish) there; `lengths` and `ended` are updated in place to match."""
        cuts: dict[int, int] = {}
        while True:
            nxt = self.checked + 1
            gone = ended & (lengths < nxt)  # rows that ended before this length: padded in HF
            if gone.all() or not np.all(gone | (lengths >= nxt)):
                return cuts  # every row is done, or a row still going has not reached this length
            ids = hf_rows[:, :nxt].copy()
            if self.pad_finished:
                for r in np.flatnonzero(gone):
                    ids[r, lengths[r]:] = self.pad
            scores = None
            if scores_of is not None:
                self.step_scores.append(scores_of(nxt - 1 - self.width))
                scores = tuple(self.step_scores)
            fired = self.criteria(torch.from_numpy(ids).to(self.device), scores)
            fired = np.broadcast_to(np.asarray(torch.as_tensor(fired).cpu(), dtype=bool), lengths.shape)
            self.calls += 1
            self.checked = nxt
            if self.pad_finished:
                # rows still counted at this length that did not end exactly here: stop right after it
                for r in np.flatnonzero(fired & ~gone & ~(ended & (lengths == nxt))):
                    lengths[r], ended[r] = nxt, True
                    cuts[r] = nxt
            else:
                self.stopped |= fired & ~gone
                # HF's loop ends when every row is stopped or at its length limit: all cut here
                if (self.stopped | (ended & (lengths <= nxt))).all():
                    for r in np.flatnonzero(~ended | (lengths > nxt)):
                        lengths[r], ended[r] = nxt, True
                        cuts[r] = nxt
