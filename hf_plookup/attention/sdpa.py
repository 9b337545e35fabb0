"""Torch backend: write K/V into the pages, gather each sequence's keys, one SDPA call per layer.

Runs on any device. In invariant mode (an `invariant.attention` layout is active) each query
is computed on its own instead. Queries of a step are laid out as a padded `[B, H, Tq, D]` grid
(a free view when every sequence feeds the same number of tokens, as verify steps do) and
keys/values as `[B, H_kv, Lk, D]` gathered from the pages by slot.
"""

from __future__ import annotations

import torch

from ..base.dense import attend
from ..invariant.attention import current_layout, invariant_attend
from .metadata import AttentionMetadata
from .pages import gather_kv, write_kv


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


def sdpa_attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None, softcap: float | None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Packed queries `[1, H, T, D]` over one layer's pages (K/V already written): `[1, T, H, D]`."""
    k, v = gather_kv(meta, k_cache, v_cache)
    q = pad_queries(meta, query)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    explicit = softcap or sinks is not None  # the explicit form takes a boolean mask (dense.attend)
    out = attend(q, k, v, meta.mask(sliding_window) if explicit else meta.sdpa_mask(sliding_window), scale, softcap,
                 sinks=sinks)
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
    sinks: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss), or None
) -> torch.Tensor:
    """Returns `[1, T, H, D]`."""
    write_kv(meta, module.layer_idx, key, value)
    k_cache, v_cache = meta.kv_cache.layer(module.layer_idx)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layout = current_layout()
    if layout is not None:  # invariant mode: each query over exactly its keys (invariant.attention)
        return invariant_attend(layout, query, k_cache, v_cache, scale, sliding_window, softcap, sinks)
    return sdpa_attend(query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
