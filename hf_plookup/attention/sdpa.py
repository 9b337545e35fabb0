"""Torch backend: write K/V into the pages, gather each sequence's keys, one SDPA call per layer.

Runs on any device. In invariant mode (an `attention.invariant` layout is active) each query
is computed on its own instead. Queries of a step are laid out as a padded `[B, H, Tq, D]` grid
(a free view when every sequence feeds the same number of tokens, as verify steps do) and
keys/values as `[B, H_kv, Lk, D]` gathered from the pages by slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .invariant import current_layout, invariant_attend
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


def pad_queries(meta: AttentionMetadata, query: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] packed -> [B, H, Tq, D] padded."""
    h, d = query.shape[1], query.shape[3]
    q = query[0]  # [H, T, D]
    if meta.q_gather is not None:
        q = q.index_select(1, meta.q_gather)  # [H, B*Tq, D]
    return q.view(h, meta.num_seqs, meta.max_query_len, d).transpose(0, 1)


def unpad_output(meta: AttentionMetadata, out: torch.Tensor) -> torch.Tensor:
    """[B, H, Tq, D] padded -> [1, T, H, D] packed, HF's layout for attention outputs."""
    b, h, tq, d = out.shape
    out = out.transpose(1, 2).reshape(b * tq, h, d)
    if meta.q_scatter is not None:
        out = out.index_select(0, meta.q_scatter)
    return out[None]


def softcapped_attention(q, k, v, mask, scaling: float, softcap: float | None) -> torch.Tensor:
    """Plain attention (q [B, H, Tq, D], k/v [B, H_kv, Lk, D], mask broadcastable to
    [B, H, Tq, Lk], True = attend) with tanh logit soft-capping when `softcap` is given (SDPA has
    no softcap argument)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def sdpa_attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Packed queries `[1, H, T, D]` over one layer's pages (K/V already written): `[1, T, H, D]`."""
    k, v = gather_kv(meta, k_cache, v_cache)
    q = pad_queries(meta, query)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if softcap:
        out = softcapped_attention(q, k, v, meta.mask(sliding_window), scale, softcap)
    else:
        mask = meta.sdpa_mask(sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return unpad_output(meta, out)


def sdpa_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D] after RoPE
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    meta: AttentionMetadata,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Returns `[1, T, H, D]`."""
    write_kv(meta, module.layer_idx, key, value)
    k_cache, v_cache = meta.kv_cache.layer(module.layer_idx)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layout = current_layout()
    if layout is not None:  # invariant mode: each query over exactly its keys (attention.invariant)
        return invariant_attend(layout, query, k_cache, v_cache, scale, sliding_window, softcap)
    return sdpa_attend(query, k_cache, v_cache, meta, scale, sliding_window, softcap)
