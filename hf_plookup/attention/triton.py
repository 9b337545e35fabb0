"""Triton backend: attention read straight from the pages through the block table (no gather).

One program computes, for one sequence and one KV head, softmax(q k^T) v for a block of that
sequence's query tokens times the query heads that share the KV head (GQA/MQA): the block's
rows are (query token, head) pairs, so a whole verify chunk is one `[rows, D] x [D, keys]`
`tl.dot` per key tile (tensor cores on a GPU) and each key tile is read once for all the heads
of its group. The context is walked in tiles of `BLOCK_N` keys (online softmax, fp32
accumulation). With `num_splits > 1` (flash-decoding) the tiles of a sequence are divided among
that many programs, each writing a partial result (running max, sum and unnormalised output),
and a second kernel merges them: for small batches, where one program per (sequence, KV head)
leaves most of a GPU idle.

Layout: queries packed `[T, H, D]` with `cu_seqlens_q [B+1]`; query `i` of sequence `b` sits at
cache position `context_lens[b] - q_len_b + i` (the chunk's keys are already written into the
pages), so the causal mask is aligned to the bottom right. A query at position p sees keys in
`(p - sliding_window, p]` when a window is given (HF's meaning). Candidate trees
(`tree_mask [B, Tq, Tq]`, drafting.tree): query `i` sees every key before its chunk (the window
measured from its real position `query_pos[b, i]`) and, inside the chunk, the nodes its
tree_mask row marks (its ancestors and itself). Only tensors are read on the device, never
host-side lengths, so a step is capturable in a CUDA graph: grid sizes depend on `B`, `H_kv`,
the group size and `max_query_len` alone.

`triton` is imported when this module is imported, which the registry does only when the
backend is asked for; on CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1),
which is how the default test suite checks them against dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..base.device import INTERPRETED
from .metadata import AttentionMetadata
from .pages import write_and_pack

# Query tokens per program. 16-row query blocks of the earlier kernel (one head per program,
# no tl.dot) gave wrong results on an H100 with triton 3.6 while the interpreter agreed with
# dense attention; the cap stays at 8 tokens until a GPU run of tests/attention/test_triton.py
# shows a larger one is right (this tl.dot kernel is not yet verified on a GPU).
MAX_QUERY_BLOCK = 8
MAX_ROWS = 128  # (query token, head) rows per program: bounds registers for large GQA groups
MIN_ROWS = 16  # tl.dot needs at least 16 rows on a GPU; spare rows are masked
BLOCK_N = 32  # keys per tile
# Under the interpreter (triton 3.9) tl.dot of bf16/fp16 operands returns garbage, so there the
# products are taken in fp32; on a GPU half-precision operands go to tensor cores as they are.
# fp32 caches always use exact fp32 products (not TF32), to stay close to HF's fp32 attention.
# Invariant calls (`paged_attention(invariant=True)`) split a context at fixed key offsets: this
# many tiles (512 keys) per split, and this many splits on CUDA whatever the batch.
INVARIANT_SPLIT_TILES = 16
INVARIANT_SPLITS = 4


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # q/out [T, H, D]; k/v [num_pages, PAGE, H_kv, D]
    part_m_ptr, part_l_ptr, part_o_ptr,  # partials [S, T, H] (m, l) and [S, T, H, D] when NUM_SPLITS > 1
    block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,  # [B, W] int32, [B] int32, [B+1] int32
    tree_ptr, query_pos_ptr,  # [B, Tq, Tq] uint8 and [B, Tq] int64 when IS_TREE (else unused)
    scale, softcap, window, num_tokens,  # window 0: none; softcap 0.0: none; num_tokens = T
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_tb, stride_tq, stride_pb,
    num_heads: tl.constexpr, groups: tl.constexpr, head_dim: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_TREE: tl.constexpr, FP32_DOT: tl.constexpr,
    SPLIT_TILES: tl.constexpr, SUM_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    h_kv = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    qb_split = tl.program_id(2)
    qb = qb_split // NUM_SPLITS
    split = qb_split % NUM_SPLITS

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    ctx = tl.load(context_lens_ptr + b)
    chunk_start = ctx - q_len  # cache position of the chunk's first token (a tree's root)
    offs_m = tl.arange(0, BLOCK_M)  # row = (query token, head of the group)
    tok = qb * BLOCK_Q + offs_m // BLOCK_G  # [BLOCK_M] query index within the chunk
    g = hb * BLOCK_G + offs_m % BLOCK_G  # head within the KV head's group
    head = h_kv * groups + g
    row_ok = (offs_m // BLOCK_G < BLOCK_Q) & (tok < q_len) & (g < groups)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    rows = q_start + tok  # packed token index
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if IS_TREE:  # a node's position is start + its depth, not its slot
        q_pos = tl.load(query_pos_ptr + b * stride_pb + tok, mask=row_ok, other=0)
    else:
        q_pos = chunk_start + tok

    # key tiles this program walks: those holding keys some of its queries can see (a query's
    # keys never lie past its own slot, trees included). A tile may span several pages (each
    # key's page comes from the block table), so tile shapes never depend on the page size.
    last_pos = tl.minimum(chunk_start + qb * BLOCK_Q + BLOCK_Q - 1, ctx - 1)
    num_tiles = tl.cdiv(last_pos + 1, BLOCK_N)
    first_tile = 0
    if HAS_WINDOW:  # a tree node sits at or after the root's position
        lowest = chunk_start if IS_TREE else chunk_start + qb * BLOCK_Q
        first_tile = tl.maximum(lowest - window + 1, 0) // BLOCK_N
    if SPLIT_TILES > 0:  # invariant: split s walks tiles from s * SPLIT_TILES, the last one to the end
        tile_lo = tl.maximum(first_tile, split * SPLIT_TILES)
        tile_hi = tl.where(split == NUM_SPLITS - 1, num_tiles, tl.minimum((split + 1) * SPLIT_TILES, num_tiles))
    else:
        per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
        if SUM_DOT:  # products and sums of plain fp32 arithmetic (see SUM_DOT in paged_attention)
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        elif FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        if IS_TREE:
            rel = k_pos - chunk_start  # chunk node held by each key (negative: before the chunk)
            in_chunk = (rel >= 0) & in_ctx
            anc = tl.load(tree_ptr + b * stride_tb + tok[:, None] * stride_tq + rel[None, :],
                          mask=row_ok[:, None] & in_chunk[None, :], other=0)
            ok = ((rel < 0)[None, :] | (anc != 0)) & in_ctx[None, :] & row_ok[:, None]
            if HAS_WINDOW:
                node_pos = tl.load(query_pos_ptr + b * stride_pb + rel, mask=in_chunk, other=0)
                key_pos = tl.where(in_chunk, node_pos, k_pos)  # [BLOCK_N] real positions
                ok = ok & (key_pos[None, :] > q_pos[:, None] - window)
        else:
            ok = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :] & row_ok[:, None]
            if HAS_WINDOW:
                ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if SUM_DOT:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        elif FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # a partial: running max, sum and unnormalised output, merged by _merge_splits_kernel
        ml = (split * num_tokens + rows) * num_heads + head  # [BLOCK_M] index into [S, T, H]
        tl.store(part_m_ptr + ml, m, mask=row_ok)
        tl.store(part_l_ptr + ml, l, mask=row_ok)
        tl.store(part_o_ptr + ml[:, None] * head_dim + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


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


@dataclass(frozen=True)
class _LaunchPlan:
    """Block shapes and grid of one call (see `_launch_plan`)."""

    block_g: int  # heads of one KV head's group per program
    head_blocks: int  # programs along a group (more than one only when it exceeds MAX_ROWS)
    block_q: int  # query tokens per program
    block_m: int  # rows per program: block_q * block_g, at least MIN_ROWS
    q_blocks: int  # programs along a sequence's queries
    num_splits: int  # programs along a sequence's keys (1: no partials, no merge)
    block_d: int  # head_dim padded to a power of two, at least 16 (tl.dot's minimum)

    def grid(self, b: int, h_kv: int) -> tuple[int, int, int]:
        """(sequence, KV head x head block, query block x split), the kernel's program ids."""
        return (b, h_kv * self.head_blocks, self.q_blocks * self.num_splits)


def _check_args(q, k_cache, block_tables, max_query_len, tree_mask, query_pos, max_query_block) -> None:
    """Refuse, before anything is allocated or launched, arguments outside what the kernel is
    written for, with a message naming them rather than a compile error or a wrong result: page
    and query-block sizes are powers of two, the query heads split evenly into KV-head groups, and
    a tree's mask and positions have the `[B, Tq, Tq]` / `[B, Tq]` shape the kernel indexes by."""
    h, page, h_kv = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    if page & (page - 1) or h % h_kv:
        raise ValueError(f"block_size must be a power of two and heads a multiple of kv heads, got {page}, {h}/{h_kv}")
    if max_query_block < 1 or max_query_block & (max_query_block - 1):
        raise ValueError(f"max_query_block must be a power of two >= 1, got {max_query_block}")
    b = block_tables.shape[0]
    if (tree_mask is not None) != (query_pos is not None):
        raise ValueError("tree_mask and query_pos go together")
    if tree_mask is not None and (tuple(tree_mask.shape) != (b, max_query_len, max_query_len)
                                  or tuple(query_pos.shape) != (b, max_query_len)):
        raise ValueError(f"tree_mask must be [B={b}, Tq, Tq] and query_pos [B, Tq] with Tq={max_query_len}, "
                         f"got {list(tree_mask.shape)} and {list(query_pos.shape)}")


def _launch_plan(b: int, h: int, h_kv: int, d: int, max_query_len: int, max_query_block: int,
                 num_splits: int | None, invariant: bool, on_cuda: bool) -> _LaunchPlan:
    """Block sizes and key splits, from shapes alone (never from tensor values, so a step stays
    capturable in a CUDA graph).

    A program holds `block_q` query tokens times `block_g` heads of one group, at most MAX_ROWS
    rows (registers), at least MIN_ROWS (tl.dot). `num_splits` None: on CUDA, split the context
    when the batch is small (fewer than 128 programs leave most of a GPU idle; flash-decoding);
    elsewhere (the interpreter) 1.

    `invariant`: a query's result must not depend on what else the call holds, so the program's
    shape no longer follows `max_query_len` (always `max_query_block` tokens: a query runs the same
    instructions in a 1-token step as in a verify chunk) and the context splits at fixed key
    offsets (`INVARIANT_SPLIT_TILES` tiles per split, the last split to the end; `num_splits` None:
    `INVARIANT_SPLITS` on CUDA, 1 elsewhere), never at offsets chosen from the batch. Tiles a
    query sees nothing of leave its running max, sum and output exactly as they were, so walking
    more of them changes no bit."""
    groups = h // h_kv
    block_g = min(triton.next_power_of_2(groups), MAX_ROWS)
    head_blocks = triton.cdiv(groups, block_g)
    wanted = max_query_block if invariant else triton.next_power_of_2(max(max_query_len, 1))
    block_q = min(wanted, max_query_block, max(MAX_ROWS // block_g, 1))
    q_blocks = triton.cdiv(max_query_len, block_q)
    if num_splits is None and invariant:
        num_splits = INVARIANT_SPLITS if on_cuda else 1
    if num_splits is None:
        programs = b * h_kv * head_blocks * q_blocks
        few = on_cuda and programs < 128 and max_query_len <= 16
        num_splits = min(16, triton.next_power_of_2(triton.cdiv(128, programs))) if few else 1
    return _LaunchPlan(block_g=block_g, head_blocks=head_blocks, block_q=block_q,
                       block_m=max(block_q * block_g, MIN_ROWS), q_blocks=q_blocks, num_splits=num_splits,
                       block_d=max(triton.next_power_of_2(d), 16))


def _split_partials(q: torch.Tensor, out: torch.Tensor, num_splits: int):
    """fp32 (running max, sum, unnormalised output) of every split, merged by the second kernel;
    with one split there is nothing to merge, and `out` stands in for the unused pointers."""
    if num_splits <= 1:
        return out, out, out
    t, h, d = q.shape
    part_m = torch.empty((num_splits, t, h), dtype=torch.float32, device=q.device)
    return part_m, torch.empty_like(part_m), torch.empty((num_splits, t, h, d), dtype=torch.float32, device=q.device)


def _tree_args(tree_mask, query_pos, block_tables):
    """(tree, query_pos, their strides) as the kernel reads them: the bool mask viewed as uint8
    bytes (no copy). Without a tree (IS_TREE false) the kernel reads neither, so any int tensor
    fills their places and their strides are 0."""
    if tree_mask is None:
        return block_tables, block_tables, (0, 0, 0)
    tree = tree_mask.contiguous().view(torch.uint8)
    return tree, query_pos, (tree.stride(0), tree.stride(1), query_pos.stride(0))


def _launch(plan: _LaunchPlan, q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q,
            tree_mask, query_pos, scale, sliding_window, softcap, invariant) -> None:
    """The split kernel, then (with several splits) the merge of its partials into `out`: two
    launches whose grids follow `plan` alone.

    fp32 caches take exact fp32 products (not TF32), as does the interpreter, whose half-precision
    tl.dot is wrong. Invariant calls under the interpreter take the products as elementwise
    multiplies and per-row sums (`SUM_DOT`): the interpreter's `tl.dot` is numpy's BLAS matmul,
    which rounds a row differently by its place in the block (measured, OpenBLAS 0.3.31 on the
    project's CPU), while on a GPU each row of a `tl.dot` is one tensor-core reduction whatever
    row of the block it sits in."""
    t, h, d = q.shape
    page, h_kv = k_cache.shape[1], k_cache.shape[2]
    partials = _split_partials(q, out, plan.num_splits)
    tree, query_pos, tree_strides = _tree_args(tree_mask, query_pos, block_tables)
    _paged_attention_kernel[plan.grid(block_tables.shape[0], h_kv)](
        q, k_cache, v_cache, out, *partials, block_tables, context_lens, cu_seqlens_q, tree, query_pos,
        float(scale), float(softcap or 0.0), int(sliding_window or 0), t,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *tree_strides,
        num_heads=h, groups=h // h_kv, head_dim=d, PAGE=page, BLOCK_Q=plan.block_q, BLOCK_G=plan.block_g,
        BLOCK_M=plan.block_m, BLOCK_N=BLOCK_N, BLOCK_D=plan.block_d, NUM_SPLITS=plan.num_splits,
        HEAD_BLOCKS=plan.head_blocks, HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(sliding_window),
        IS_TREE=tree_mask is not None,
        FP32_DOT=k_cache.dtype == torch.float32 or INTERPRETED, SPLIT_TILES=INVARIANT_SPLIT_TILES if invariant else 0,
        SUM_DOT=invariant and INTERPRETED,
    )
    if plan.num_splits > 1:
        _merge_splits_kernel[(t, h)](out, *partials, q.stride(0), q.stride(1), t,
                                     num_heads=h, head_dim=d, BLOCK_D=triton.next_power_of_2(d),
                                     NUM_SPLITS=plan.num_splits)


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
    tree_mask: torch.Tensor | None = None,  # [B, Tq, Tq] bool, Tq = max_query_len: candidate trees
    query_pos: torch.Tensor | None = None,  # [B, Tq] int64 real positions (with tree_mask)
    max_query_block: int = MAX_QUERY_BLOCK,
    invariant: bool = False,
) -> torch.Tensor:
    """Attention of every packed query over its sequence's pages; returns `[T, H, D]` in q's dtype.
    `num_splits` None: chosen by `_launch_plan`. `tree_mask` and `query_pos` go together.
    `invariant`: every query's result is bitwise the same whatever else the call holds (engine
    invariant mode; fixed program shapes and key splits, `_launch_plan`; exact sums, `_launch`)."""
    _check_args(q, k_cache, block_tables, max_query_len, tree_mask, query_pos, max_query_block)
    t, h, d = q.shape
    plan = _launch_plan(block_tables.shape[0], h, k_cache.shape[2], d, max_query_len, max_query_block,
                        num_splits, invariant, q.device.type == "cuda")
    q = q.contiguous()
    out = torch.empty_like(q)
    _launch(plan, q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, tree_mask, query_pos,
            scale, sliding_window, softcap, invariant)
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
    tree = meta.tree_mask
    out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cache_seqlens, meta.cu_seqlens_q,
                          meta.max_query_len, scaling if scaling is not None else query.shape[-1] ** -0.5,
                          sliding_window, softcap, tree_mask=tree, query_pos=None if tree is None else meta.query_pos,
                          invariant=meta.invariant)
    return out[None].to(query.dtype)
