"""Paged attention as a PyTorch custom op, and the attention function's work in compiled steps.

`torch.compile(fullgraph=True)` traces the HF model's own code (steps.graphs; one decoder layer
at a time, steps.regional); when its attention modules call the hf_plookup attention function,
`hf_plookup::paged_attention(query, key, value, k_cache, v_cache, slot_mapping, <step tensors>,
backend, scale, window, softcap, invariant) -> out` does the layer's attention work as one opaque
op (the compiler cannot trace into a Triton launch, nor into sdpa's per-query invariant calls):
it writes the step's keys and values into the layer's pages (`pages.store_kv`, in place), then
runs the sdpa backend (gather + SDPA or soft-capped attention) or the Triton kernel, with the
step's layout passed as tensors and plain ints; with `invariant`, the backend's invariant form
(invariant.linears). Its fake (meta) implementation only states the output shape.

The op declares the pages as mutated (`mutates_args`), so the compiler hands it the pages
themselves and the write happens in place. The write used to be traced code (an `index_copy_`
into a view of the pages, a graph input); inductor then wrote it in place in some torch
versions, but others (2.11) functionalized it into a new copy of the layer's whole pages plus a
copy back, two full passes over the cache per layer and step, however few tokens were written:
with a KV cache sized as wrap sizes it on a GPU, most of a step's time (docs/results.md, "GPU end
to end").

Eager steps call the backends directly (a custom op's dispatch costs microseconds per layer);
compiled steps go through `compiled_paged_attention`, with identical results (tests/test_compile.py).
"""

from __future__ import annotations

import torch

from ..invariant.attention import current_layout, invariant_attend
from .metadata import AttentionMetadata, compiled_layer_kv, step_mask
from .pages import store_kv
from .sdpa import sdpa_attend


@torch.library.custom_op("hf_plookup::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]: this step's keys, written into k_cache at slot_mapping
    value: torch.Tensor,  # [1, H_kv, T, Dv]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    kv_slots: torch.Tensor,  # [B, Lk] int64
    query_pos: torch.Tensor,  # [B, Tq] int64
    context_lens: torch.Tensor,  # [B] int64
    block_tables: torch.Tensor,  # [B, W] int32
    cache_seqlens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    q_gather: torch.Tensor | None,
    q_scatter: torch.Tensor | None,
    mask: torch.Tensor | None,  # sdpa: [B, 1, Tq, Lk] bool (metadata.step_mask), None: built here;
    # triton: the candidate trees' [B, Tq, Tq] bool tree_mask, None for chains
    backend: str,
    scale: float,
    sliding_window: int,
    softcap: float,
    invariant: bool,
) -> torch.Tensor:
    """Write the step's keys/values into the pages, then attention of the packed queries over the
    pages; `[1, T, H, D]` in the query's dtype. `invariant` (engine invariant mode): the Triton
    kernel's invariant form, or sdpa's per-query calls over the layout the engine made current for
    this step (read when the op runs)."""
    store_kv(k_cache, v_cache, slot_mapping, key, value)
    tq = query_pos.shape[1]
    if invariant and backend == "sdpa":
        return invariant_attend(current_layout(), query, k_cache, v_cache, scale, sliding_window or None, softcap or None)
    if backend == "triton":
        from .triton import paged_attention as kernel

        q = query[0].transpose(0, 1)
        q = q if q.dtype == k_cache.dtype else q.to(k_cache.dtype)
        out = kernel(q, k_cache, v_cache, block_tables, cache_seqlens, cu_seqlens_q, tq, scale,
                     sliding_window or None, softcap or None, tree_mask=mask,
                     query_pos=None if mask is None else query_pos, invariant=invariant)
        return out[None].to(query.dtype)
    # the step's K/V are written above, so no slot_mapping here
    meta = AttentionMetadata.of(dict(slot_mapping=kv_slots.new_empty(0), query_pos=query_pos, kv_slots=kv_slots,
                                     context_lens=context_lens, q_gather=q_gather, q_scatter=q_scatter),
                                static_shapes=True)
    if mask is not None:
        meta._masks[sliding_window or None] = mask
    return sdpa_attend(query, k_cache, v_cache, meta, scale, sliding_window or None, softcap or None).contiguous()


@paged_attention.register_fake
def _(query, key, value, k_cache, v_cache, slot_mapping, kv_slots, query_pos, context_lens, block_tables,
      cache_seqlens, cu_seqlens_q, q_gather, q_scatter, mask, backend, scale, sliding_window, softcap, invariant):
    _, h, t, _ = query.shape
    return query.new_empty((1, t, h, v_cache.shape[-1]))  # values may be narrower than keys (MLA)


# the backends with a branch in the op above; flash-attn's kernels are not wrapped as an op, so
# steps on them run eagerly (captured in CUDA graphs, not compiled)
COMPILABLE_BACKENDS = ("sdpa", "triton")


def check_compilable(backend: str) -> None:
    """Raise unless compiled steps can run on attention `backend`."""
    if backend not in COMPILABLE_BACKENDS:
        raise ValueError(f"compiled steps support attn_backend {COMPILABLE_BACKENDS}, got {backend!r}")


def compiled_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The attention function's work in a compiled step: the op above on the layer's pages (in a
    regionally compiled layer, the pages it was given), which writes the step's keys and values
    into them and attends. Returns `[1, T, H, D]`. The sdpa mask is built here, in traced code:
    the compiler fuses it into a kernel and, in a whole-forward graph where every layer builds the
    same one, keeps a single copy (common subexpressions are merged)."""
    k_cache, v_cache = compiled_layer_kv() or meta.kv_cache.layer(module.layer_idx)
    mask = meta.tree_mask  # triton: the kernel applies the tree itself
    if meta.backend == "sdpa" and not meta.invariant:
        mask = step_mask(meta.query_pos, meta.context_lens, meta.max_context_len, sliding_window, meta.tree_mask)
    return torch.ops.hf_plookup.paged_attention(
        query, key, value, k_cache, v_cache, meta.slot_mapping, meta.kv_slots, meta.query_pos, meta.context_lens,
        meta.block_tables, meta.cache_seqlens, meta.cu_seqlens_q, meta.q_gather, meta.q_scatter, mask, meta.backend,
        float(scaling if scaling is not None else query.shape[-1] ** -0.5), int(sliding_window or 0),
        float(softcap or 0.0), meta.invariant,
    )
