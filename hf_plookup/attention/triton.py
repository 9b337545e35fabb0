"""Triton backend: attention read straight from the pages through the block table (no gather).

One program computes, for one sequence, one query head and a block of that sequence's query
tokens, softmax(q k^T) v over the sequence's context, walking it in tiles of 16 keys (online softmax,
fp32 accumulation). With `num_splits > 1` (flash-decoding) the pages of a sequence are divided
among that many programs, each writing a partial result (running max, sum and unnormalised
output), and a second kernel merges them: for small batches, where one program per (sequence,
head) leaves most of a GPU idle.

Layout: queries packed `[T, H, D]` with `cu_seqlens_q [B+1]`; query `i` of sequence `b` sits at
position `context_lens[b] - q_len_b + i` (the chunk's keys are already written into the pages),
so the causal mask is aligned to the bottom right. A query at position p sees keys in
`(p - sliding_window, p]` when a window is given (HF's meaning). Only tensors are read on the
device, never host-side lengths, so a step is capturable in a CUDA graph: grid sizes depend on
`B`, `H` and `max_query_len` alone.

`triton` is imported when this module is imported, which the registry does only when the
backend is asked for; on CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1),
which is how the default test suite checks them against dense attention.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from .metadata import AttentionMetadata
from .sdpa import write_and_pack


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # q/out [T, H, D]; k/v [num_pages, PAGE, H_kv, D]
    part_m_ptr, part_l_ptr, part_o_ptr,  # partials [S, T, H] (m, l) and [S, T, H, D] when NUM_SPLITS > 1
    block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,  # [B, W] int32, [B] int32, [B+1] int32
    scale, softcap, window, num_tokens,  # window 0: none; softcap 0.0: none; num_tokens = T
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt,
    num_heads: tl.constexpr, groups: tl.constexpr, head_dim: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    qb_split = tl.program_id(2)
    qb = qb_split // NUM_SPLITS
    split = qb_split % NUM_SPLITS
    h_kv = h // groups

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    ctx = tl.load(context_lens_ptr + b)
    offs_q = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query index within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = offs_q < q_len
    d_ok = offs_d < head_dim
    q_pos = ctx - q_len + offs_q  # [BLOCK_Q] absolute positions
    q = tl.load(q_ptr + (q_start + offs_q)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    # key tiles of BLOCK_N positions this program walks: those holding keys some of its queries
    # can see. A tile may span several pages (each key's page comes from the block table), so
    # tile shapes never depend on the page size.
    last_pos = tl.minimum(ctx - q_len + qb * BLOCK_Q + BLOCK_Q - 1, ctx - 1)
    num_tiles = tl.cdiv(last_pos + 1, BLOCK_N)
    first_tile = 0
    if HAS_WINDOW:
        first_tile = tl.maximum(ctx - q_len + qb * BLOCK_Q - window + 1, 0) // BLOCK_N
    per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for j in range(tile_lo, tile_hi):
        k_pos = j * BLOCK_N + offs_n  # [BLOCK_N]
        in_ctx = k_pos < ctx
        page = tl.load(block_tables_ptr + b * stride_bt + k_pos // PAGE, mask=in_ctx, other=0)
        slot = page.to(tl.int64) * stride_kp + (k_pos % PAGE) * stride_ks
        kv_off = slot[:, None] + h_kv * stride_kh + offs_d[None, :]
        # slots past the context hold whatever the page held before (even NaN): never read them,
        # since a zero probability times a NaN value is still NaN
        kv_ok = in_ctx[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_Q, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        ok = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :] & q_ok[:, None]
        if HAS_WINDOW:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    rows = q_start + offs_q
    if NUM_SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])
    else:  # a partial: running max, sum and unnormalised output, merged by _merge_splits_kernel
        ml = (split * num_tokens + rows) * num_heads + h  # [BLOCK_Q] index into [S, T, H]
        tl.store(part_m_ptr + ml, m, mask=q_ok)
        tl.store(part_l_ptr + ml, l, mask=q_ok)
        tl.store(part_o_ptr + ml[:, None] * head_dim + offs_d[None, :], acc, mask=q_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, stride_qt, stride_qh, num_tokens,
    num_heads: tl.constexpr, head_dim: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """out[t, h] = sum_s w_s o_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    m_max = tl.full([1], float("-inf"), tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + (sp * num_tokens + t) * num_heads + h + tl.zeros([1], tl.int32)))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([1], tl.float32)
    o_sum = tl.zeros([BLOCK_D], tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        idx = (sp * num_tokens + t) * num_heads + h
        w = tl.exp(tl.load(part_m_ptr + idx + tl.zeros([1], tl.int32)) - m_safe)
        l_sum += w * tl.load(part_l_ptr + idx + tl.zeros([1], tl.int32))
        o_sum += w * tl.load(part_o_ptr + idx * head_dim + offs_d, mask=d_ok, other=0.0)
    out = o_sum / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + t * stride_qt + h * stride_qh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention(
    q: torch.Tensor,  # [T, H, D] packed queries
    k_cache: torch.Tensor,  # [num_pages, PAGE, H_kv, D]
    v_cache: torch.Tensor,  # [num_pages, PAGE, H_kv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    context_lens: torch.Tensor,  # [B] int32 keys each sequence attends to (this chunk included)
    cu_seqlens_q: torch.Tensor,  # [B+1] int32 packed query offsets
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of every packed query over its sequence's pages; returns `[T, H, D]` in q's dtype.
    `num_splits` None: split the context when the batch is small (B * H < 128 programs)."""
    t, h, d = q.shape
    page, h_kv = k_cache.shape[1], k_cache.shape[2]
    if page & (page - 1) or h % h_kv:
        raise ValueError(f"block_size must be a power of two and heads a multiple of kv heads, got {page}, {h}/{h_kv}")
    b = block_tables.shape[0]
    # query blocks of at most 8 rows: 16-row blocks gave wrong results on an H100 (triton 3.6)
    # while the interpreter agreed with dense attention
    block_q = min(triton.next_power_of_2(max(max_query_len, 1)), 8)
    q_blocks = triton.cdiv(max_query_len, block_q)
    if num_splits is None:
        num_splits = 1 if b * h * q_blocks >= 128 or max_query_len > 16 else 4
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_splits > 1:
        part_m = torch.empty((num_splits, t, h), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty((num_splits, t, h, d), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_o = out  # unused
    _paged_attention_kernel[(b, h, q_blocks * num_splits)](
        q, k_cache, v_cache, out, part_m, part_l, part_o, block_tables, context_lens, cu_seqlens_q,
        float(scale), float(softcap or 0.0), int(sliding_window or 0), t,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads=h, groups=h // h_kv, head_dim=d, PAGE=page, BLOCK_Q=block_q, BLOCK_N=16,
        BLOCK_D=triton.next_power_of_2(d), NUM_SPLITS=num_splits,
        HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(sliding_window),
    )
    if num_splits > 1:
        _merge_splits_kernel[(t, h)](out, part_m, part_l, part_o, q.stride(0), q.stride(1), t,
                                     num_heads=h, head_dim=d, BLOCK_D=triton.next_power_of_2(d), NUM_SPLITS=num_splits)
    return out


def triton_paged_attention(
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
    q, k_cache, v_cache = write_and_pack(meta, module.layer_idx, query, key, value)  # q [T, H, D]
    out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cache_seqlens, meta.cu_seqlens_q,
                          meta.max_query_len, scaling if scaling is not None else query.shape[-1] ** -0.5,
                          sliding_window, softcap)
    return out[None].to(query.dtype)
