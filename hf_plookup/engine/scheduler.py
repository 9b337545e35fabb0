"""Which sequences run in the next step: admission under the block budget, prefill chunks
under a token budget, then decode/verify steps of every running sequence."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

import numpy as np

from .kv_cache import BlockManager
from .sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position fed (= seq.num_cached)
    num_tokens: int  # tokens fed in this step
    is_prefill: bool


class Scheduler:
    """Admits a waiting sequence only when the free blocks cover its worst case (prompt plus
    `max_new_tokens`) beyond what running sequences may still claim, so no step can run out
    of blocks and nothing needs preempting. Prefill runs before decode; decode steps take all
    running sequences."""

    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_num_seqs: int, aligned_prefill: int | None = None,
                 on_admit: Callable[[Sequence], None] | None = None, defer: Callable[[Sequence], bool] | None = None,
                 units_per_chunk: int | None = None):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        # invariant mode: prompts are cut only at multiples of this many tokens from their start,
        # so a prompt's chunks do not depend on the other rows or on a prefix found in the pool
        # (a chunk that does not fit waits)
        if aligned_prefill is not None and not 1 <= aligned_prefill <= max_batch_tokens:
            raise ValueError(f"aligned_prefill must be in [1, max_batch_tokens], got {aligned_prefill}")
        self.aligned_prefill = aligned_prefill
        # how many of those units one sequence's chunk may span (None: as many as the budget holds;
        # the step still computes each unit apart where that matters, invariant.attention). Models
        # with recurrent mixers take 1: their chunked scans round by the chunk's length.
        if units_per_chunk is not None and units_per_chunk < 1:
            raise ValueError(f"units_per_chunk must be >= 1, got {units_per_chunk}")
        self.units_per_chunk = units_per_chunk
        self.on_admit = on_admit  # gives an admitted sequence its pooled prefix (engine)
        # True: the sequence's next prompt chunk waits, because an earlier sequence is computing
        # the same tokens (rows sharing a beginning; the engine's prefix pool). It may extend the
        # sequence's pooled prefix first.
        self.defer = defer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _outstanding(self) -> int:
        """Blocks running sequences may still claim."""
        b = self.blocks
        return sum(b.blocks_for(s.max_tokens) - len(b.tables.get(s.seq_id, ())) for s in self.running)

    def _admit(self) -> None:
        b = self.blocks
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if b.num_free - self._outstanding() < b.blocks_for(seq.max_tokens):
                break
            self.waiting.popleft()
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            b.tables.setdefault(seq.seq_id, [])

    def retire_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if done:
            self.running = [s for s in self.running if not s.finished]
            for s in done:
                self.blocks.free(s.seq_id)
        return done

    def schedule(self, propose: Callable[[list[Sequence]], Sequence_[int]] | None = None) -> list[ScheduledChunk]:
        """Next step's chunks. For a decode step, `propose(running)` gives each running
        sequence's number of drafts (fed after its last token)."""
        self._admit()
        if not self.running:
            if self.waiting:
                raise RuntimeError("KV cache too small for any waiting sequence")
            return []
        prefill = [s for s in self.running if s.in_prefill]
        chunks = []
        if prefill:
            budget = self.max_batch_tokens
            for s in prefill:
                if self.defer is not None and self.defer(s):
                    continue
                n = min(s.prompt_len - s.num_cached, budget)
                if self.aligned_prefill:
                    # to the end of the current unit, then whole units while the budget holds them
                    unit = self.aligned_prefill
                    first = unit - s.num_cached % unit
                    more = max(budget - first, 0) // unit
                    if self.units_per_chunk is not None:
                        more = min(more, self.units_per_chunk - 1)
                    n = min(s.prompt_len - s.num_cached, first + more * unit)
                    if n > budget:
                        break
                if n <= 0:
                    break
                chunks.append(ScheduledChunk(s, s.num_cached, n, True))
                budget -= n
            if not chunks:  # never every sequence waiting on another (the engine's rule forbids it)
                raise RuntimeError("every prefilling sequence was deferred")
        else:
            drafts = propose(self.running) if propose is not None else [0] * len(self.running)
            if isinstance(drafts, np.ndarray):
                drafts = drafts.tolist()  # Python ints: one conversion, not one per row
            chunks = [ScheduledChunk(s, s.num_cached, 1 + int(d), False) for s, d in zip(self.running, drafts)]
        ensure = self.blocks.ensure
        for c in chunks:
            ensure(c.seq.seq_id, c.start + c.num_tokens)
        return chunks
