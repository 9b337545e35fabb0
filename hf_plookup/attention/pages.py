"""Page I/O shared by every backend: write a step's keys/values into a layer's pages, pack the
queries for the kernels that read pages themselves, gather a sequence's keys back out.

A layer's pages are two tensors `[num_blocks, block_size, H_kv, D]` (values `Dv` wide); a token's
flat slot is `block * block_size + offset` (`engine.kv_cache`).
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """Store keys/values `[1, H_kv, T, D]` (values `Dv`) at the flat slots `slot_mapping` [T] of one
    layer's pages `[num_blocks, block_size, H_kv, D]`."""
    k_cache.view(-1, *k_cache.shape[-2:]).index_copy_(0, slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[-2:]).index_copy_(0, slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))


def write_kv(meta: AttentionMetadata, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Store this step's keys/values ([1, H_kv, T, D]) at `meta.slot_mapping`."""
    store_kv(*meta.kv_cache.layer(layer_idx), meta.slot_mapping, key, value)


def write_and_pack(meta: AttentionMetadata, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the kernels that read the pages themselves (flash, triton): write this step's K/V,
    then return the packed queries `[T, H, D]` in the cache's dtype and the layer's pages
    (`[num_blocks, block_size, H_kv, D]` each)."""
    write_kv(meta, layer_idx, key, value)
    k_cache, v_cache = meta.kv_cache.layer(layer_idx)
    q = query[0].transpose(0, 1)  # [T, H, D]
    return (q if q.dtype == k_cache.dtype else q.to(k_cache.dtype)), k_cache, v_cache


def gather_kv(meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values of every sequence as `[B, H_kv, Lk, D]` from one layer's pages (positions
    past a context are padding)."""
    idx = meta.kv_slots.reshape(-1)
    k, v = (c.view(-1, *c.shape[-2:]).index_select(0, idx).view(meta.num_seqs, meta.max_context_len, *c.shape[-2:])
            .transpose(1, 2) for c in (k_cache, v_cache))
    return k, v
