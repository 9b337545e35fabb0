"""Earlier calls as a drafting source: the text a model generated before, kept per wrapped model.

A model's outputs repeat themselves across calls (the openings and turns of phrase of its
summaries, a format it fills in, a reply it gives again), which a row's own prompt does not hold.
`DraftMemory` keeps the generated tokens of the rows of earlier calls, newest last, up to a
bounded number of tokens (the oldest rows are dropped first), and candidate trees search them as
they search a user's `draft_corpus` (drafting.suffix: other sources, newest first). Drafts never
change a token (verification is exact), so the memory changes only how many tokens a forward
accepts. Prompts are not kept: in draft replays of the shipped summaries, earlier prompts as a
source lowered the tokens per forward that earlier outputs raised (docs/results.md, "Draft budgets").

Example: capacity 5; rows [1, 2, 3] then [4, 5, 6] are added: the first is dropped (6 tokens
would exceed 5), docs() == [[4, 5, 6]]; a row longer than the capacity keeps its last 5 tokens.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class DraftMemory:
    """The generated tokens of earlier rows, at most `capacity` tokens in all (0: keeps nothing;
    `wrap`'s option `draft_memory_tokens`, checked there)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._rows: deque[np.ndarray] = deque()
        self._tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        """Keep one row's generated tokens [n] (its last `capacity` of them), dropping the oldest rows
        past the capacity."""
        row = np.array(tokens[-self.capacity:] if self.capacity else tokens[:0], dtype=np.int64)
        if len(row) < 2:  # nothing a suffix could match and continue
            return
        self._rows.append(row)
        self._tokens += len(row)
        while self._tokens > self.capacity:
            self._tokens -= len(self._rows.popleft())

    def docs(self) -> list[np.ndarray]:
        """The kept rows, oldest first (the suffix index then offers the newest first)."""
        return list(self._rows)

    def __len__(self) -> int:
        return self._tokens
