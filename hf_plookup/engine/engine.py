"""The loop: schedule -> propose -> run -> verify -> commit, over one `generate` call's rows."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..spec.ngram import NgramProposer
from ..spec.verify import greedy_accept
from ..stats import SpecStats
from .kv_cache import BlockManager, PagedKVCache, default_num_tokens, layer_specs
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence


@dataclass(slots=True)
class EngineOptions:
    """Options given to `hf_plookup.wrap(model, **options)`."""

    max_cache_tokens: int | None = None  # KV capacity in tokens (None: from available memory)
    num_blocks: int | None = None  # KV capacity in blocks (overrides max_cache_tokens)
    block_size: int = 16
    max_batch_tokens: int = 1024  # token budget of one prefill step
    max_num_seqs: int = 256  # most sequences running at once
    cache_memory_fraction: float = 0.25  # of free memory, when no capacity is given
    attn_backend: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("max_cache_tokens", "num_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 < self.cache_memory_fraction <= 1.0:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction!r}")
        if self.attn_backend not in ("sdpa",):
            raise ValueError(f"attn_backend must be one of ('sdpa',), got {self.attn_backend!r}")


class Engine:
    """Owns the paged cache (allocated on first use, kept across calls) and runs calls."""

    def __init__(self, model: torch.nn.Module, options: EngineOptions):
        self.model = model
        self.options = options
        self.specs = layer_specs(model)
        self._cache: PagedKVCache | None = None
        self.blocks: BlockManager | None = None  # the cache's blocks; all free between calls
        self._proposers: dict[tuple[int, int], NgramProposer] = {}
        self._ids = itertools.count()

    @property
    def capacity_blocks(self) -> int:
        o = self.options
        if o.num_blocks is not None:
            return o.num_blocks
        tokens = o.max_cache_tokens or default_num_tokens(self.specs, o.cache_memory_fraction)
        return max(-(-tokens // o.block_size), 1)

    def check_fits(self, max_tokens: int) -> None:
        """Raise before any work if one sequence of `max_tokens` can never fit the cache."""
        cap = self.capacity_blocks * self.options.block_size
        if max_tokens > cap:
            raise ValueError(
                f"a prompt plus max_new_tokens needs {max_tokens} cache tokens but the KV cache holds {cap}; "
                "raise `max_cache_tokens` (or `num_blocks`) in hf_plookup.wrap(...)"
            )

    def cache(self) -> PagedKVCache:
        if self._cache is None:
            self._cache = PagedKVCache(self.specs, self.capacity_blocks, self.options.block_size)
            self.blocks = BlockManager(self._cache.num_blocks, self._cache.block_size)
        return self._cache

    def proposer(self, k: int, max_ngram: int) -> NgramProposer:
        key = (k, max_ngram)
        if key not in self._proposers:
            self._proposers[key] = NgramProposer(k, max_ngram)
        return self._proposers[key]

    def generate(
        self,
        prompts: list[np.ndarray],  # each [L_i] int64, padding removed
        max_new_tokens: int,
        eos_token_ids: frozenset[int],
        k: int = 0,  # prompt_lookup_num_tokens; 0 = plain greedy
        max_ngram: int = 2,
        stats: SpecStats | None = None,
    ) -> list[np.ndarray]:
        """Greedy generation (with prompt-lookup drafts when k > 0); returns each row's new tokens."""
        stats = stats if stats is not None else SpecStats()
        stats.num_sequences = len(prompts)
        stats.resize(k)
        stats.attn_backend = self.options.attn_backend
        cache = self.cache()
        blocks = self.blocks
        runner = ModelRunner(self.model, cache, blocks, self.options.attn_backend)
        sched = Scheduler(blocks, self.options.max_batch_tokens, self.options.max_num_seqs)
        width = max(len(p) for p in prompts) + max_new_tokens
        history = np.zeros((len(prompts), width), dtype=np.int64)  # [B, L]
        seqs = []
        for row, p in enumerate(prompts):
            history[row, : len(p)] = p
            seq = Sequence(next(self._ids), row, len(p), max_new_tokens)
            seqs.append(seq)
            sched.add(seq)

        proposer = self.proposer(k, max_ngram) if k > 0 else None
        drafts = np.full((len(prompts), max(k, 1)), -1, dtype=np.int64)  # [B, k]
        n_drafts = np.zeros(len(prompts), dtype=np.int64)  # [B]

        def propose(running: list[Sequence]) -> np.ndarray:
            if proposer is None:
                return np.zeros(len(running), dtype=np.int64)
            rows = np.array([s.row for s in running])
            lengths = np.array([s.num_tokens for s in running], dtype=np.int64)
            cap = np.array([s.remaining - 1 for s in running], dtype=np.int64)
            d, nd = proposer.propose(history[rows], lengths, cap)
            drafts[rows] = d
            n_drafts[rows] = nd
            for s in running:
                history[s.row, s.num_tokens : s.num_tokens + n_drafts[s.row]] = drafts[s.row, : n_drafts[s.row]]
            return nd

        try:
            while not sched.done:
                chunks = sched.schedule(propose)
                logits = runner.run(chunks, history)
                stats.forwards += 1
                targets = logits.argmax(dim=-1).cpu().numpy()  # [N]
                if chunks[0].is_prefill:
                    stats.prefill_forwards += 1
                offset = 0
                for c in chunks:
                    seq = c.seq
                    if c.is_prefill:
                        seq.num_cached += c.num_tokens
                        if seq.in_prefill:
                            continue
                        new = targets[offset : offset + 1]
                        offset += 1
                    else:
                        m = c.num_tokens - 1
                        tgt = targets[offset : offset + c.num_tokens]
                        offset += c.num_tokens
                        a = greedy_accept(drafts[seq.row, :m], tgt)
                        stats.drafted += m
                        stats.accepted += a
                        for j in range(m):
                            stats.drafted_per_position[j] += 1
                            stats.accepted_per_position[j] += j < a
                        new = tgt[: a + 1]
                        if a < m:  # overwrite rejected drafts written into the history
                            history[seq.row, seq.num_tokens + a + 1 : seq.num_tokens + m] = 0
                        seq.num_cached += 1 + a
                    stats.row_steps += 1
                    stats.new_tokens += seq.append(history, new.tolist(), eos_token_ids)
                    if not seq.finished:
                        blocks.trim(seq.seq_id, seq.num_cached)
                sched.retire_finished()
        finally:
            blocks.free_all()
        return [history[s.row, s.prompt_len : s.num_tokens].copy() for s in seqs]
