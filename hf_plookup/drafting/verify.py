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

import numba
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


@numba.njit(cache=True, nogil=True)
def _walk(targets, offsets, num_drafts, drafts, parents, paths, accepted, final):
    for s in range(len(offsets)):
        node, n = 0, 0
        while True:
            want = targets[offsets[s] + node]
            child = 0
            for i in range(num_drafts[s]):
                if parents[s, i] == node and drafts[s, i] == want:
                    child = i + 1
                    break
            if child == 0:
                break
            paths[s, n] = child
            n += 1
            node = child
        accepted[s], final[s] = n, want


def accept_paths(
    targets: np.ndarray,  # [N] int64: the token each fed position emits (argmax or draw)
    offsets: np.ndarray,  # [S] int64: each sequence's first fed position
    num_drafts: np.ndarray,  # [S] int64
    drafts: np.ndarray,  # [S, K] int64: draft tokens in node order
    parents: np.ndarray,  # [S, K] int64: each draft's parent (chunk index: 0 the root, j + 1 draft j)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walk every sequence's drafts by the targets: a draft is accepted when its parent was and
    its token is its parent's target; the first target no child matches is the next token. A
    chain is the tree whose draft j has parent j, so both take this one walk.

    Returns (accepted [S], paths [S, K] the accepted drafts' chunk indices in order, -1 after
    them, next token [S]). Example, one chain of 3 drafts [5, 6, 7] with targets [5, 6, 9, 8]
    (the root emits 5, draft 1 emits 6, draft 2 emits 9): accepted [2], paths [[1, 2, -1]],
    next token [9].
    """
    s, k = drafts.shape
    paths = np.full((s, max(k, 1)), -1, dtype=np.int64)
    accepted = np.zeros(s, dtype=np.int64)
    final = np.zeros(s, dtype=np.int64)
    if s:
        _walk(np.ascontiguousarray(targets, dtype=np.int64), np.ascontiguousarray(offsets, dtype=np.int64),
              np.ascontiguousarray(num_drafts, dtype=np.int64), np.ascontiguousarray(drafts, dtype=np.int64),
              np.ascontiguousarray(parents, dtype=np.int64), paths, accepted, final)
    return accepted, paths, final


def chain_parents(k: int) -> np.ndarray:
    """[k] the parents of a chain of k drafts as a tree: draft j's parent is chunk index j."""
    return np.arange(k, dtype=np.int64)
