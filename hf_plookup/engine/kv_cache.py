"""Paged K/V storage per layer and the BlockManager that hands out its blocks."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention.probe import probe_key_layouts
from ..base.device import input_device

logger = logging.getLogger("hf_plookup")


@dataclass(slots=True)
class LayerSpec:
    """Where and how one layer keeps its pages. A layer without keys (a recurrent mixer's, whose
    state mixers.recurrent keeps, or one that mixes no tokens) has 0 KV heads and empty pages,
    so the pages stay indexed by the model's layer index."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    # values' head size where it differs from the keys' (multi-head latent attention: DeepSeek V2/V3,
    # MiniCPM3, ...); None: head_dim
    value_head_dim: int | None = None
    sinks: bool = False  # its attention adds per-head sinks to the softmax (gpt-oss): sdpa only

    def __post_init__(self) -> None:
        if self.num_kv_heads == 0 and self.head_dim == 0 and self.value_head_dim is None:
            return  # a layer without keys
        if self.num_kv_heads < 1 or self.head_dim < 1 or (self.value_head_dim is not None and self.value_head_dim < 1):
            raise ValueError("num_kv_heads, head_dim and value_head_dim must be >= 1 (or all 0: a layer without keys)")

    @property
    def v_dim(self) -> int:
        return self.value_head_dim or self.head_dim

    @property
    def has_keys(self) -> bool:
        return self.num_kv_heads > 0

    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_dim) * torch.empty((), dtype=self.dtype).element_size()


# tokens of cache for a model none of whose layers keeps keys (pure state-space models): the
# blocks then only count positions, and their pages are empty
STATE_ONLY_TOKENS = 1 << 20


def layer_specs(model: torch.nn.Module, notes: list[str] | None = None,
                grad_mode=torch.inference_mode) -> list[LayerSpec]:
    """One spec per layer, from the keys each layer really hands to its attention function (a
    probe forward, attention.probe), on that layer's device and dtype: models split by accelerate
    keep each layer's pages next to its weights, and config fields an architecture ignores (a
    GPT-NeoX config's `num_key_value_heads`) play no part. Layers without keys get empty pages on
    the model's input device. Raises `ValueError` naming the architecture when the model cannot
    run on the paged cache. `notes`: where the probe's note on a quantized model's arithmetic goes
    (attention.probe); `grad_mode`: the probe's (probe_key_layouts)."""
    layouts = probe_key_layouts(model, notes=notes, grad_mode=grad_mode)
    device = input_device(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return [LayerSpec(0, 0, dtype, device) if k is None else
            LayerSpec(k.num_kv_heads, k.head_dim, k.dtype, k.device, k.value_head_dim, k.sinks) for k in layouts]


def default_num_tokens(
    specs: list[LayerSpec],
    fraction: float = 0.25,
    model: torch.nn.Module | None = None,
    warmup_tokens: int = 1024,
    logits_rows: int | None = None,
) -> int:
    """Cache capacity in tokens from available memory.

    CPU: `fraction` of available RAM (CPU pages are allocated lazily by the OS).
    CUDA: `fraction` of the memory that is free once the model is resident and has run, i.e.
    when `model` is given, a warm-up forward of `warmup_tokens` tokens (the largest prefill
    step) runs first, and the free memory it leaves (CUDA context, cuBLAS workspaces and the
    allocator's cache included) is reduced by that forward's peak activation memory and by
    fp32 logits for `logits_rows` rows (default `warmup_tokens`), which every step needs again.
    """
    per_token = sum(s.bytes_per_token() for s in specs)
    if per_token == 0:
        return STATE_ONLY_TOKENS
    device = next(s.device for s in specs if s.has_keys)
    if device.type == "cuda":
        free = None
        if model is not None:
            config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            n = min(warmup_tokens, getattr(config, "max_position_embeddings", None) or warmup_tokens)
            try:
                free = free_cuda_memory_after_warmup(model, device, n, logits_rows or warmup_tokens)
            except Exception as e:  # a model that cannot run this plain forward: size from free memory
                logger.warning(f"hf_plookup: warm-up forward for cache sizing failed ({type(e).__name__}: {e}); "
                               "sizing the KV cache from free memory without it")
        if free is None:
            free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(int(free * fraction) // per_token, 1)


def available_memory() -> int | None:
    """Bytes the system can still give this process (Linux MemAvailable: free memory plus what the
    kernel can reclaim, such as clean file pages), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cpu_memory(specs: list[LayerSpec], tokens: int | None, transient: int, weights: int,
                     available: int | None = None) -> None:
    """Raise a ValueError naming the figures, before anything is allocated, when a CPU KV cache of
    `tokens` tokens (None: sized later from what is left, `default_num_tokens`) and `transient` bytes
    that `wrap` needs for a while (packing one weight at a time: cpu.packed_weight) do not fit in the
    memory available now (`available`, default `available_memory()`); `weights`: the model's bytes,
    for the message. A process killed for memory loses everything; this says why first.

    Example: 28 layers of 8 KV heads of 128 values in bf16 take 114,688 bytes a token, so
    `tokens=100_000` needs 10.7 GiB: with 8 GiB available this raises."""
    available = available_memory() if available is None else available
    if available is None:
        return
    cache = (tokens or 0) * sum(s.bytes_per_token() for s in specs)
    if cache + transient > available:
        gib = 2**30
        raise ValueError(
            f"hf_plookup.wrap: a KV cache of {tokens} tokens needs {cache / gib:.2f} GiB"
            + (f" and packing the weights {transient / gib:.2f} GiB more for a while" if transient else "")
            + f", but {available / gib:.2f} GiB of memory are available (the model's weights, already loaded, "
            f"take {weights / gib:.2f} GiB); lower `max_cache_tokens` (or `num_blocks`), or leave it unset to size "
            "the cache from the memory left")


def free_cuda_memory_after_warmup(model: torch.nn.Module, device: torch.device, num_tokens: int,
                                  logits_rows: int | None = None) -> int:
    """Bytes left on `device` for the KV cache: free memory after a warm-up forward of
    `num_tokens` tokens, less that forward's peak and fp32 logits for `logits_rows` rows."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=input_device(model))  # [1, T]
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del ids
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 0
    logits = 2 * 4 * vocab * (logits_rows if logits_rows is not None else num_tokens)  # logits and their fp32 copy
    return max(free - peak - logits, 0)


class PagedKVCache:
    """K and V pages for every layer: `[num_blocks, block_size, H_kv, D]` each (values `Dv`
    wide where a layer's values have another head size than its keys).

    With `scratch=True` one more page (id `num_blocks`, zero-filled, never handed out by the
    BlockManager) follows the managed ones: padded draft positions and the dummy rows of a
    CUDA-graph batch write their K/V there and block tables point their spare entries at it."""

    def __init__(self, specs: list[LayerSpec], num_blocks: int, block_size: int, scratch: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block: int | None = num_blocks if scratch else None
        self.keys = []  # per layer [num_blocks (+1 scratch), block_size, H_kv, D]
        self.values = []
        total = num_blocks + int(scratch)
        for s in specs:
            shape = (total, block_size, s.num_kv_heads, s.head_dim)
            self.keys.append(torch.empty(shape, dtype=s.dtype, device=s.device))
            self.values.append(torch.empty((*shape[:3], s.v_dim), dtype=s.dtype, device=s.device))
            if scratch:
                self.keys[-1][num_blocks].zero_()
                self.values[-1][num_blocks].zero_()

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[idx], self.values[idx]

    def move_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy every layer's keys/values at flat slots `src` [M] to `dst` [M] (all reads before
        any write, so the two may overlap): an accepted tree path's KV moved into place."""
        if len(src) != len(dst):
            raise ValueError(f"src and dst must have equal length, got {len(src)} and {len(dst)}")
        if not len(src):
            return
        device = self.keys[0].device
        s = torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64)).to(device)
        d = torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64)).to(device)
        for pages in (*self.keys, *self.values):
            if not pages.numel():  # a layer without keys
                continue
            flat = pages.view(-1, *pages.shape[2:])
            flat.index_copy_(0, d, flat.index_select(0, s))


@dataclass(slots=True)
class BlockManager:
    """Free list of block ids, each sequence's block table, and the prefix pool.

    Prefix pool: full pages of prefilled prompt tokens are *registered* under the hash chain of
    their tokens (`page_hashes`). A registered block outlives its sequence: when no table holds
    it any more it waits, evictable, least recently used first, and a later sequence whose prompt
    starts with the same pages `match`es it instead of computing them again. Evictable blocks
    count as free: `ensure` takes truly free blocks first, then evicts.

    Example, 4-token pages: a first sequence prefills `[5, 6, 7, 8, 9, 10, 11, 12, 13]` and
    registers its two full pages; a second sequence whose prompt starts with the same 8 tokens
    matches both and prefills from token 8 on; one that starts `[5, 6, 7, 8, 0, ...]` matches
    the first page only.
    """

    num_blocks: int
    block_size: int
    free_blocks: list[int] = field(init=False)
    tables: dict[int, list[int]] = field(init=False, default_factory=dict)  # seq id -> block ids
    hash_of: dict[int, bytes] = field(init=False, default_factory=dict)  # registered block -> its page hash
    block_of: dict[bytes, int] = field(init=False, default_factory=dict)  # page hash -> registered block
    refs: dict[int, int] = field(init=False, default_factory=dict)  # registered block -> tables holding it
    evictable: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)  # LRU first

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        # popped from the end: low ids first, so a sequence's blocks tend to be contiguous
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get: free ones and evictable pooled ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_pooled(self) -> int:
        """Registered blocks (in use or evictable)."""
        return len(self.hash_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def slots(self, seq_id: int, positions: np.ndarray) -> np.ndarray:
        """Flat cache slots [N] int64 of a sequence's token positions [N] (through its block table)."""
        table = np.asarray(self.table(seq_id), dtype=np.int64)
        bs = self.block_size
        return table[positions // bs] * bs + positions % bs

    def _take(self) -> int:
        if self.free_blocks:
            return self.free_blocks.pop()
        block, _ = self.evictable.popitem(last=False)  # the least recently used pooled page
        self._forget(block)
        return block

    def _forget(self, block: int) -> None:
        del self.block_of[self.hash_of.pop(block)]
        self.refs.pop(block, None)

    def _release(self, block: int) -> None:
        """A table lets go of `block`: a registered one waits in the pool when no table holds it."""
        if block in self.hash_of:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.evictable[block] = None
        else:
            self.free_blocks.append(block)

    def ensure(self, seq_id: int, num_tokens: int) -> None:
        """Grow `seq_id`'s table to hold `num_tokens` tokens."""
        table = self.tables.setdefault(seq_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return
        if need > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            table.append(self._take())

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Shrink `seq_id`'s table to what `num_tokens` tokens need; freed blocks return to the pool."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq_id: int) -> None:
        for b in reversed(self.tables.pop(seq_id, [])):
            self._release(b)

    def free_all(self) -> None:
        for seq_id in list(self.tables):
            self.free(seq_id)

    # -- prefix pool --------------------------------------------------------------------------
    def page_hashes(self, tokens: np.ndarray, num_pages: int) -> list[bytes]:
        """The hash chain of the first `num_pages` full pages of `tokens`: page i's hash covers
        pages 0..i, so equal hashes mean equal prefixes."""
        out, prev = [], b""
        bs = self.block_size
        for i in range(num_pages):
            prev = hashlib.blake2b(prev + np.ascontiguousarray(tokens[i * bs : (i + 1) * bs], dtype=np.int64).tobytes(),
                                   digest_size=16).digest()
            out.append(prev)
        return out

    def match(self, seq_id: int, hashes: list[bytes], unit_pages: int = 1) -> int:
        """Extend `seq_id`'s table, which holds the pages of the first `len(table)` of `hashes` (none
        for a new sequence), with the pooled blocks of the longest further run of `hashes`, cut to
        a multiple of `unit_pages`. Returns the pages the table then holds.

        Example (one-page units): the pool holds pages h0, h1; a new table matches [h0, h1, h2] to
        2 pages; once another sequence registers h2, `match` again with the same hashes gives 3.
        """
        table = self.tables.setdefault(seq_id, [])
        start = len(table)
        if start % unit_pages:
            raise ValueError(f"sequence {seq_id} holds {start} pages, not whole units of {unit_pages}")
        for h in hashes[start:]:
            block = self.block_of.get(h)
            if block is None:
                break
            table.append(block)
            self.refs[block] += 1
            self.evictable.pop(block, None)
        while len(table) % unit_pages:
            self._release(table.pop())
        return len(table)

    def register(self, seq_id: int, hashes: list[bytes]) -> None:
        """Record that `seq_id`'s first `len(hashes)` blocks hold the pages of those hashes (a page
        another block already holds stays with that block)."""
        table = self.tables[seq_id]
        for block, h in zip(table, hashes):
            if block in self.hash_of or h in self.block_of:
                continue
            self.hash_of[block], self.block_of[h], self.refs[block] = h, block, 1

    def clear_prefixes(self) -> None:
        """Forget every pooled page (its KV was computed with weights that have changed)."""
        for block in list(self.evictable):
            self._forget(block)
            self.free_blocks.append(block)
        self.evictable.clear()
        for block in list(self.hash_of):  # still held by a table: freed normally when let go
            self._forget(block)
