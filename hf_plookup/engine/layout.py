"""Lays one step out: the scheduled chunks as one `StepLayout` (base.layout), the arrays every way
of running the step reads (steps/).

Each chunk's tokens are packed after the previous chunk's, at positions counted from its row's
cached length (a tree node at its depth); its keys go to the cache slots its pages give, and padded
drafts (a uniform step's rows fed to its width) to the scratch page.

Example: two decode chunks feeding 3 and 2 tokens from cached lengths 7 and 4, pages of 4 tokens,
width None: `input_ids` packs 5 tokens, `positions` = [7, 8, 9, 4, 5], `cu_seqlens_q` = [0, 3, 5],
`context_lens` = [10, 6], and all 5 rows are kept (a verify step scores every fed token).

A uniform chain step whose bucket the graph runner has met is laid out straight into that
bucket's buffer, padded as `steps.graphs.pad_layout` pads (`lay_out_staged`): one compiled pass
over the rows instead of the dozens of numpy calls of laying out and then padding, each of which
costs the host more than its work on a few rows.
"""

from __future__ import annotations

import itertools

import numba
import numpy as np

from ..base.layout import StepLayout
from ..drafting.tree import ancestor_mask, depths
from .kv_cache import BlockManager
from .scheduler import ScheduledChunk


def fed_tokens(chunks: list[ScheduledChunk], width: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(real tokens [B], tokens fed [B], prompt chunk or not [B]): a decode-only step whose rows
    are padded feeds every row `width` tokens."""
    n_real = np.array([c.num_tokens for c in chunks], dtype=np.int64)
    prefill = np.array([c.is_prefill for c in chunks], dtype=bool)
    n = n_real
    if not prefill.any() and width is not None:
        if (n_real > width).any():
            raise ValueError(f"a decode chunk feeds {int(n_real.max())} tokens, more than pad_to={width}")
        n = np.full_like(n_real, width)
    return n_real, n, prefill


def _tokens(chunks, history, parents, offsets, tables, blocks, tq):
    """Each chunk's tokens, depths, tree mask, page table and kept rows, row by row."""
    t = int(offsets[-1])
    ids = np.zeros(t, dtype=np.int64)
    depth = np.arange(t) - np.repeat(offsets[:-1], np.diff(offsets))  # chains; tree nodes below
    trees = parents is not None and not all(c.is_prefill for c in chunks)
    tree_mask = np.zeros((len(chunks), tq, tq), dtype=bool) if trees else None
    keep = []
    for i, c in enumerate(chunks):
        lo, m = offsets[i], c.num_tokens
        ids[lo : lo + m] = history[c.seq.row, c.start : c.start + m]
        if trees:
            par = np.arange(m - 1) if c.is_prefill else parents[c.seq.row, : m - 1]  # [m-1]
            depth[lo : lo + m] = depths(par)
            tree_mask[i] = ancestor_mask(par, tq)
        table = blocks.table(c.seq.seq_id)
        tables[i, : len(table)] = table
        if not c.is_prefill:
            keep.extend(range(lo, lo + m))
        elif c.start + m == c.seq.prompt_len:
            keep.append(lo + m - 1)
    return ids, depth, tree_mask, np.asarray(keep, dtype=np.int64)


def lay_out(chunks: list[ScheduledChunk], history: np.ndarray, blocks: BlockManager, scratch: int | None,
            parents: np.ndarray | None = None, pads: np.ndarray | None = None, width: int | None = None,
            embed: bool = False) -> StepLayout:
    """Lay out one step. `history`: [B_all, L] int64 token rows (drafts already written after
    each row's last token). `scratch`: the cache's scratch page (None: page 0 takes padding).
    `parents`: [B_all, K] int64, the batch's draft-node parents (a row's first `num_tokens - 1`
    entries are its chunk's), or None for chains. With parents, every decode chunk is a tree (a
    chain is the tree whose node j has parent j - 1) and the step carries a tree mask; prompt
    chunks stay chains. `pads`: [B_all] int64 each row's left pads in its call's input, for
    `embed_positions` (with `embed` only). `width`: tokens every row of a decode step feeds
    (missing drafts padded), or None."""
    bs = blocks.block_size
    pad_page = scratch if scratch is not None else 0
    n_real, n, prefill = fed_tokens(chunks, width)
    start = np.array([c.start for c in chunks], dtype=np.int64)  # [B]
    ctx = start + n  # [B]
    b, tq, lk = len(chunks), int(n.max()), int(ctx.max())
    offsets = np.zeros(b + 1, dtype=np.int64)  # [B+1]
    np.cumsum(n, out=offsets[1:])
    t = int(offsets[-1])
    seq_of_token = np.repeat(np.arange(b), n)  # [T]
    index = np.arange(t) - offsets[seq_of_token]  # [T] each token's index in its chunk
    tables = np.full((b, -(-lk // bs)), pad_page, dtype=np.int64)  # [B, W]
    ids, depth, tree_mask, keep = _tokens(chunks, history, parents, offsets, tables, blocks, tq)
    pos = start[seq_of_token] + depth  # [T]
    query_pos = np.full((b, tq), -1, dtype=np.int64)  # [B, Tq]
    query_pos[seq_of_token, index] = pos
    key_pos = np.arange(lk, dtype=np.int64)  # [Lk]
    # positions past a sequence's blocks (padded drafts) land in the scratch page via the table
    kv_slots = tables[:, key_pos // bs] * bs + key_pos % bs  # [B, Lk]
    kv_slots[key_pos[None, :] >= ctx[:, None]] = pad_page * bs
    # token j of a chunk is stored at cache position start + j (a tree node too, whatever its depth)
    slot_mapping = kv_slots[seq_of_token, start[seq_of_token] + index]  # [T]
    q_gather = q_scatter = None
    if (n != tq).any():
        q_scatter = seq_of_token * tq + index  # [T]
        q_gather = np.zeros(b * tq, dtype=np.int64)  # [B*Tq]
        q_gather[q_scatter] = np.arange(t)
    cu_k = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ctx, out=cu_k[1:])
    rows = np.array([c.seq.row for c in chunks], dtype=np.int64)
    embed_pos = pos + pads[rows][seq_of_token] if embed and pads is not None else None  # [T]
    return StepLayout(input_ids=ids, positions=pos, depth=depth, slot_mapping=slot_mapping, keep=keep,
                      prefill=prefill, query_pos=query_pos, kv_slots=kv_slots, context_lens=ctx,
                      block_tables=tables, cu_seqlens_q=offsets, cu_seqlens_k=cu_k, q_gather=q_gather,
                      q_scatter=q_scatter, tree_mask=tree_mask, embed_positions=embed_pos,
                      seq_ids=np.array([c.seq.seq_id for c in chunks], dtype=np.int64), num_real=n_real)


@numba.njit(cache=True, nogil=True)
def _fill_staged(history, rows, starts, n_real, tables, table_lens, block_size, pad_page, input_ids, positions,
                 slot_mapping, query_pos, kv_slots, context_lens, block_tables, cu_seqlens_k, keep, ctx32, tables32,
                 cu_k32):
    """`lay_out` then `pad_layout` of a uniform chain step, written into the bucket's arrays (their
    shapes are the bucket's: [Bb * q], [Bb, q], [Bb, Lkb], [Bb, W]); `tables`: the rows' page
    tables end to end, `table_lens` [B] long each. Returns how many rows are kept (their packed
    indices in keep[:n])."""
    bb, q = query_pos.shape
    lkb, width = kv_slots.shape[1], block_tables.shape[1]  # lkb == width * block_size (a bucket)
    b = rows.shape[0]
    pad_slot = pad_page * block_size
    at = 0  # the row's table in `tables`
    kept = 0
    total = 0
    cu_seqlens_k[0] = 0
    cu_k32[0] = 0
    for i in range(bb):
        lo = i * q
        if i < b:
            start, m, row, nt = starts[i], n_real[i], rows[i], table_lens[i]
            for w in range(width):
                page = tables[at + w] if w < nt else pad_page
                block_tables[i, w] = page
                tables32[i, w] = page
            at += nt
            ctx = start + q
            for w in range(width):  # page by page: no division per key
                # positions past the row's pages (padded drafts) land in the scratch page via the table
                first = block_tables[i, w] * block_size
                for o in range(block_size):
                    k = w * block_size + o
                    kv_slots[i, k] = first + o if k < ctx else pad_slot
            for j in range(q):
                p = start + j
                input_ids[lo + j] = history[row, p] if j < m else 0
                positions[lo + j] = p
                query_pos[i, j] = p
                slot_mapping[lo + j] = kv_slots[i, p]
            for j in range(m):
                keep[kept] = lo + j
                kept += 1
        else:  # a dummy row: token 0 at positions 0..q-1 as a chain, its keys in the scratch page
            ctx = q
            for w in range(width):
                block_tables[i, w] = pad_page
                tables32[i, w] = pad_page
            kv_slots[i, :] = pad_slot
            for j in range(min(q, lkb)):
                kv_slots[i, j] = pad_slot + j % block_size
            for j in range(q):
                input_ids[lo + j] = 0
                positions[lo + j] = j
                query_pos[i, j] = j
                slot_mapping[lo + j] = pad_slot + j % block_size
        context_lens[i] = ctx
        ctx32[i] = ctx
        total += ctx
        cu_seqlens_k[i + 1] = total
        cu_k32[i + 1] = total
    return kept


def lay_out_staged(chunks: list[ScheduledChunk], history: np.ndarray, blocks: BlockManager, staging) -> StepLayout:
    """A uniform decode step of chains (every row feeding `q` tokens, its drafts then padding)
    laid out into `staging` (a steps.graphs.Staging: the bucket's buffer, from
    `GraphRunner.staged`), padded to the bucket as `lay_out` then `pad_layout` give it, and its
    host layout returned (the one `GraphRunner.run` then uploads as it is).

    Example: the module docstring's two chunks (from cached lengths 7 and 4), fed 3 tokens each in
    a bucket of 2 rows and 16 keys: `positions` = [7, 8, 9, 4, 5, 6], `context_lens` = [10, 7],
    kept rows [0, 1, 2, 3, 4] (the second row's third token is padding)."""
    lay, arrays = staging.layout, staging.arrays
    q, bs = lay.max_query_len, blocks.block_size
    fed = [c.num_tokens for c in chunks]
    if max(fed) > q:
        raise ValueError(f"a decode chunk feeds {max(fed)} tokens, more than pad_to={q}")
    n_real = np.array(fed, dtype=np.int64)  # [B]
    starts = np.array([c.start for c in chunks], dtype=np.int64)  # [B]
    rows = np.array([c.seq.row for c in chunks], dtype=np.int64)  # [B]
    tables = [blocks.tables[c.seq.seq_id] for c in chunks]
    lens = np.array([len(t) for t in tables], dtype=np.int64)  # [B]
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    kept = _fill_staged(history, rows, starts, n_real, flat, lens, bs, staging.pad_page, lay.input_ids, lay.positions,
                        lay.slot_mapping, lay.query_pos, lay.kv_slots, lay.context_lens, lay.block_tables,
                        lay.cu_seqlens_k, staging.keep_host, arrays["cache_seqlens"], arrays["block_tables"],
                        arrays["cu_seqlens_k"])
    staging.keep_rows(kept)
    return lay
