"""Draft acceptance for one step: greedy matching and exact rejection sampling.

Layout of a step (vectorised over the batch): `S` sequences; sequence s owns the
`num_drafts[s] + 1` consecutive score rows starting at `offsets[s]`: row `offsets[s] + j`
scores the token after its last token plus `drafts[s, :j]`.
"""

from __future__ import annotations

import numpy as np
import torch


def _draft_rows(offsets: np.ndarray, num_drafts: np.ndarray, drafts: np.ndarray):
    """Flat score-row index and token of every draft: ([D], [D]) with D = num_drafts.sum()."""
    seg = np.repeat(np.arange(len(offsets)), num_drafts)  # [D] owning sequence
    j = np.arange(len(seg)) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)  # [D] draft index
    return offsets[seg] + j, drafts[seg, j], seg, j


def _leading(ok: np.ndarray, seg: np.ndarray, j: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Per sequence, how many leading drafts are accepted ([S] int64)."""
    accepted = num_drafts.copy()
    bad = ~ok
    # first rejection per sequence: the smallest j among its rejected drafts
    np.minimum.at(accepted, seg[bad], j[bad])
    return accepted


def accept_greedy(
    scores: torch.Tensor,  # [N, V] processed scores
    offsets: np.ndarray,  # [S] int64
    num_drafts: np.ndarray,  # [S] int64
    drafts: np.ndarray,  # [S, k] int64
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (accepted [S], next token [S]): accept while drafts equal the argmax."""
    targets = scores.argmax(dim=-1).cpu().numpy()  # [N]
    rows, toks, seg, j = _draft_rows(offsets, num_drafts, drafts)
    accepted = _leading(targets[rows] == toks, seg, j, num_drafts)
    return accepted, targets[offsets + accepted]


def accept_sampling(
    probs: torch.Tensor,  # [N, V] target distribution per row (sums to 1)
    offsets: np.ndarray,
    num_drafts: np.ndarray,
    drafts: np.ndarray,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Speculative sampling with a one-hot draft distribution: accept draft d with probability
    p(d); at the first rejection sample from p with d removed (renormalised); when every draft
    passes, sample the bonus token from the next row. Each emitted token is then distributed
    exactly as plain sampling from p would give it."""
    device = probs.device
    rows, toks, seg, j = _draft_rows(offsets, num_drafts, drafts)
    if len(rows):
        p_draft = probs[torch.from_numpy(rows).to(device), torch.from_numpy(toks).to(device)]  # [D]
        u = torch.rand(len(rows), device=device, generator=generator, dtype=p_draft.dtype)
        ok = (u < p_draft).cpu().numpy()
    else:
        ok = np.zeros(0, dtype=bool)
    accepted = _leading(ok, seg, j, num_drafts)
    final = probs[torch.from_numpy(offsets + accepted).to(device)].clone()  # [S, V]
    rejected = np.flatnonzero(accepted < num_drafts)
    if len(rejected):
        bad_tok = drafts[rejected, accepted[rejected]]
        final[torch.from_numpy(rejected).to(device), torch.from_numpy(bad_tok).to(device)] = 0.0
    tokens = torch.multinomial(final, 1, generator=generator).squeeze(1)  # renormalises implicitly
    return accepted, tokens.cpu().numpy()
