"""Recycled successors: the tokens the model itself ranked highest after each token, kept from the
verify steps that computed them, as a draft source where the text has nothing to copy.

A verify step computes logits at every fed position anyway. For each position on the accepted
path (the row's last token and its accepted drafts: their logits are the model's predictions in
the true context), the `width` best-ranked next tokens are written into a table keyed by the
token at that position, overwriting what an earlier occurrence left (Token Recycling, Luo et al.,
2024). A tree then grows from the row's last token through the table (`drafting.tree`): its
successors as alternatives at the first level, each continued through the top-ranked successor of
its own last token.

Example (width 2): verified positions holding tokens 5, 9, 5 with top-2 predictions [9, 7],
[4, 1], [3, 9] leave table[5] = [3, 9] (the newer occurrence wins) and table[9] = [4, 1]. A row
ending in 5 then drafts 3 and 9 under the root, 9 continued by 4."""

from __future__ import annotations

import numpy as np

from ..base.checks import positive_int


class SuccessorTable:
    """`succ` [V, width] int64: each token's successors, best first (-1: never seen verified).
    One table per engine loop, shared by its rows (successors generalise across documents); it
    starts empty, or, kept by the engine across calls, where earlier calls left it."""

    def __init__(self, vocab_size: int, width: int):
        self.vocab_size = positive_int("vocab_size", vocab_size)
        self.width = positive_int("draft_recycled", width)
        self.succ = np.full((self.vocab_size, self.width), -1, dtype=np.int64)

    def update(self, tokens: np.ndarray, top: np.ndarray) -> None:
        """Write `top` [n, width] (each position's best-ranked next tokens) under `tokens` [n] (the
        token at each position), in position order: a token seen twice keeps its later row. A
        token outside the table's vocabulary (an id the LM head does not score) is skipped."""
        tokens = np.asarray(tokens, dtype=np.int64)
        top = np.asarray(top, dtype=np.int64)
        if top.shape != (len(tokens), self.width):
            raise ValueError(f"top must have shape ({len(tokens)}, {self.width}), got {top.shape}")
        inside = (tokens >= 0) & (tokens < self.vocab_size)
        tokens, top = tokens[inside], top[inside]
        if not len(tokens):
            return
        _, first_of_reversed = np.unique(tokens[::-1], return_index=True)
        last = len(tokens) - 1 - first_of_reversed  # each token's last position
        self.succ[tokens[last]] = top[last]

    def clear(self) -> None:
        self.succ.fill(-1)
