"""Draft acceptance for one step: every fed position gets one target token, and drafts are
accepted while they equal it.

Layout of a step (vectorised over the batch): `S` sequences; sequence s owns the
`num_drafts[s] + 1` consecutive score rows starting at `offsets[s]`: row `offsets[s] + j`
scores the token after its last token plus `drafts[s, :j]`.

Greedy: the target is the argmax. Sampling: the target is a draw by inverse CDF whose uniform
is a fixed function of the row's seed and the output position the row scores
(`position_uniforms`: a splitmix64 hash, no generator state). The token emitted at output
position t is then `F_t^-1(u_t)` where `F_t` is the model's distribution given the tokens before
it and `u_t` is independent of everything before: exactly plain sampling, whatever was drafted.
Drafts only decide how many positions one forward settles, never which token comes out: with
the same seed a row samples the same tokens with or without drafts, chains or trees, and (the
logits being the same in invariant mode) in any batch. A row's seed comes from the call's seed
(drawn from torch's generator, so `torch.manual_seed` fixes it) and the row's index in the call.
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 arrays (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_seeds(call_seed: int, rows: int) -> np.ndarray:
    """[rows] uint64: the seed of each row of a call (the call's splitmix64 stream)."""
    idx = np.arange(1, rows + 1, dtype=np.uint64)
    return _splitmix(np.uint64(call_seed) + idx * _GOLDEN)


def position_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[N] float64 in (0, 1): the uniform of output position `positions[i]` of the row seeded
    `seeds[i]` (uint64), the same wherever and whenever it is asked for."""
    z = _splitmix(seeds.astype(np.uint64) + (positions.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def sample_targets(probs: torch.Tensor, uniforms: np.ndarray) -> np.ndarray:
    """[N] int64: per row of `probs` [N, V], the token whose CDF interval holds `uniforms` [N]
    (inverse-CDF sampling; each row's CDF is summed on its own, in float64). Tokens of
    probability 0 are never drawn."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    t = torch.from_numpy(uniforms).to(probs.device) * cdf[:, -1]
    idx = torch.searchsorted(cdf, t[:, None], right=True).squeeze(1)
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # the last token with probability
    return torch.minimum(idx, last).cpu().numpy()


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


def accept_targets(
    targets: np.ndarray,  # [N] int64: the token each fed position emits (argmax or draw)
    offsets: np.ndarray,  # [S] int64
    num_drafts: np.ndarray,  # [S] int64
    drafts: np.ndarray,  # [S, k] int64
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (accepted [S], next token [S]): accept while drafts equal the targets."""
    rows, toks, seg, j = _draft_rows(offsets, num_drafts, drafts)
    accepted = _leading(targets[rows] == toks, seg, j, num_drafts)
    return accepted, targets[offsets + accepted]
