"""Prompt keys and values a sequence gets without prefilling them: pooled pages of earlier prompts
(the prefix pool, `PrefixPool`) and the caller's own `past_key_values` (`copy_caller_kv`).

The pool itself (registered pages keyed by the hash chain of their tokens, reference counts,
least-recently-used eviction) lives in `kv_cache.BlockManager`; this module decides, for one
engine loop, which of its pages a sequence takes, which it computes, and when it waits for
another sequence that is computing them. Exactness: a pooled page holds the bits a fresh prefill
computes only where prompts are cut into chunks at fixed offsets (invariant mode), so the pool
works in whole chunk units (`unit_pages` pages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..attention.pages import store_kv

if TYPE_CHECKING:
    from .batch import Batch
    from .kv_cache import BlockManager, PagedKVCache
    from .sequence import Sequence


def copy_caller_kv(batch: Batch, blocks: BlockManager, cache: PagedKVCache, seq: Sequence) -> bool:
    """Write the caller's `past_key_values` for `seq`'s row (past what it already holds) into its
    pages, as HF reads a given cache instead of computing it again; True if any was written. The
    last prompt token is always left to prefill (its logits start the generation), and a cache
    not laid out as the pages are (other layer count or head shapes) is left alone.

    Example: a 10-token prompt whose caller passed a cache of its first 8 tokens and no pooled
    page: positions 0-7 are copied (num_cached 8), positions 8 and 9 are prefilled."""
    call = batch.call_of_row[seq.row]
    if call.cfg.prompt_kv is None:
        return False
    cols, layers = call.cfg.prompt_kv[call.seqs.index(seq)]
    start, end = seq.num_cached, min(len(cols), seq.prompt_len - 1)
    if end <= start or len(layers) != len(cache.keys) or any(
            x.shape[0] != p.shape[2] or x.shape[2] != p.shape[3]
            for (k, v), pk, pv in zip(layers, cache.keys, cache.values) for x, p in ((k, pk), (v, pv))):
        return False
    blocks.ensure(seq.seq_id, end)
    slots = torch.from_numpy(blocks.slots(seq.seq_id, np.arange(start, end)))
    for pages_k, pages_v, (k, v) in zip(cache.keys, cache.values, layers):
        idx = cols[start:end].to(k.device)
        store_kv(pages_k, pages_v, slots.to(pages_k.device), k.index_select(1, idx)[None].to(pages_k.device),
                 v.index_select(1, idx)[None].to(pages_v.device))
    call.stats.cached_prompt_tokens += end - start
    seq.num_cached = end
    return True


class PrefixPool:
    """One engine loop's use of the prefix pool: the scheduler calls `admit` for each new
    sequence and `defer` before each of its prompt chunks, the batch calls `register` after each.

    * admit: a new sequence starts from the longest pooled run of whole units of its prompt
      (leaving at least one token to prefill); then the caller's `past_key_values`, if given,
      fill its pages up to the cache's end (those pages are never pooled: they hold the caller's
      bits, not a fresh prefill's); it claims the units after that which no live sequence has
      claimed: it will compute them;
    * defer: before each prompt chunk, a sequence takes the units that have entered the pool
      since (another row computed them), then waits while its next unit is claimed by another
      sequence still prefilling it. Rows of one call, or calls joining a loop, that share a
      beginning thus compute it once. Claims go to the earlier sequence, so the one a row waits
      on never waits on it;
    * register: after each prompt chunk, the prompt's whole units enter the pool.

    Example (units of 128 tokens): rows A and B share their first 300 tokens and are admitted
    together. A claims its units 0 and 1 (and the rest of its own); B waits; after A's first
    chunk B takes unit 0 from the pool, after A's second unit 1, then prefills from token 256 on.
    """

    def __init__(self, batch: Batch, blocks: BlockManager, cache: PagedKVCache, unit_pages: int):
        self.batch, self.blocks, self.cache = batch, blocks, cache
        self.unit = unit_pages
        self.bs = blocks.block_size
        self.hashes: dict[int, list[bytes]] = {}  # seq id -> its prompt's page hashes (whole units)
        self.owner: dict[bytes, Sequence] = {}  # a unit's last page hash -> the sequence computing it

    def _usable_pages(self, seq: Sequence) -> int:
        """Pages of `seq`'s prompt it may take from the pool: whole units, one prompt token left
        to prefill (its logits)."""
        return (seq.prompt_len - 1) // self.bs // self.unit * self.unit

    def _computing(self, seq: Sequence, page: int) -> bool:
        """`seq` is live and has not yet computed that page."""
        return not seq.finished and seq.num_cached < (page + 1) * self.bs

    def _take_pooled(self, seq: Sequence) -> None:
        h = self.hashes[seq.seq_id]
        before = len(self.blocks.tables.get(seq.seq_id, ()))
        got = self.blocks.match(seq.seq_id, h[: self._usable_pages(seq)], self.unit)
        seq.num_cached = got * self.bs
        self.batch.call_of_row[seq.row].stats.cached_prompt_tokens += (got - before) * self.bs

    def admit(self, seq: Sequence) -> None:
        pages = seq.prompt_len // self.bs // self.unit * self.unit  # whole units: what a fresh prefill computes as full chunks
        self.hashes[seq.seq_id] = h = self.blocks.page_hashes(self.batch.history[seq.row], pages)
        self._take_pooled(seq)
        pooled = seq.num_cached // self.bs
        if copy_caller_kv(self.batch, self.blocks, self.cache, seq):  # the caller's bits: never pooled
            self.hashes[seq.seq_id] = h = h[:pooled]
        for last in range(seq.num_cached // self.bs + self.unit - 1, len(h), self.unit):
            o = self.owner.get(h[last])
            if o is None or not self._computing(o, last):
                self.owner[h[last]] = seq

    def defer(self, seq: Sequence) -> bool:
        h = self.hashes.get(seq.seq_id)
        if (not h or seq.num_cached % (self.unit * self.bs)
                or seq.num_cached != len(self.blocks.tables.get(seq.seq_id, ())) * self.bs):
            return False  # mid-unit: nothing to share
        shareable = min(self._usable_pages(seq), len(h))
        if seq.num_cached < shareable * self.bs:
            self._take_pooled(seq)
        last = seq.num_cached // self.bs + self.unit - 1
        if last >= shareable:
            return False
        o = self.owner.get(h[last])
        return o is not None and o is not seq and self._computing(o, last)

    def register(self, seq: Sequence) -> None:
        h = self.hashes.get(seq.seq_id)
        if h:
            self.blocks.register(seq.seq_id, h[: seq.num_cached // self.bs])
            if seq.num_cached >= seq.prompt_len:
                del self.hashes[seq.seq_id]
