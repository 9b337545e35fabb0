"""The step layout (base.layout.StepLayout) engine.layout builds from scheduled chunks, written
out by hand for a small step, and its CUDA-graph padding (steps.graphs.pad_layout) against it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_plookup.attention.metadata import AttentionMetadata
from hf_plookup.base.layout import StepLayout, step_tensors
from hf_plookup.steps.graphs import Staging, batch_bucket, context_bucket, dummy_layout, pad_layout
from hf_plookup.engine.layout import lay_out, lay_out_staged
from hf_plookup.engine.scheduler import ScheduledChunk

BS, SCRATCH = 4, 9  # page size; the scratch page's id


def _runner(tables: dict[int, list[int]], pad_to=None) -> SimpleNamespace:
    """Something with `layout(chunks, history, parents)`: engine.layout.lay_out over these page tables."""
    blocks = SimpleNamespace(block_size=BS, table=lambda seq_id: tables[seq_id])
    return SimpleNamespace(layout=lambda chunks, history, parents: lay_out(chunks, history, blocks, SCRATCH, parents,
                                                                           width=pad_to))


def _chunk(row, start, n, prefill, prompt_len):
    return ScheduledChunk(SimpleNamespace(row=row, seq_id=10 + row, prompt_len=prompt_len), start, n, prefill)


HISTORY = np.arange(3)[:, None] * 100 + np.arange(10)[None, :] + 100  # row r holds 100r+100, 100r+101, ...
# row 1: a chain of 2 drafts as the batch's parents array holds it; row 2: drafts 1 and 2 are
# children of the root, draft 3 a child of draft 1; row 0 (a prompt chunk) has none
PARENTS = np.array([[-1, -1, -1], [0, 1, -1], [0, 0, 1]])


def test_layout_of_prefill_chain_and_tree_chunks():
    """One prompt chunk that ends its prompt (3 tokens from position 0), one chain verify chunk
    (last token + 2 drafts, 5 cached), one tree chunk (root + 3 nodes, 2 cached), block_size 4."""
    runner = _runner({10: [2], 11: [3, 4], 12: [5, 6]})
    chunks = [_chunk(0, 0, 3, True, 3), _chunk(1, 5, 3, False, 2), _chunk(2, 2, 4, False, 1)]
    lay = runner.layout(chunks, HISTORY, PARENTS)
    assert lay.input_ids.tolist() == [100, 101, 102, 205, 206, 207, 302, 303, 304, 305]
    assert lay.depth.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 1, 2]
    assert lay.positions.tolist() == [0, 1, 2, 5, 6, 7, 2, 3, 3, 4]  # tree nodes at start + depth
    # cache position start + j whatever the depth: row 0 page 2, row 1 pages 3-4, row 2 pages 5-6
    assert lay.slot_mapping.tolist() == [8, 9, 10, 17, 18, 19, 22, 23, 24, 25]
    assert lay.keep.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]  # the prompt's last token, every fed decode token
    assert lay.prefill.tolist() == [True, False, False] and not lay.is_decode
    assert lay.query_pos.tolist() == [[0, 1, 2, -1], [5, 6, 7, -1], [2, 3, 3, 4]]
    assert lay.context_lens.tolist() == [3, 8, 6]
    assert lay.cu_seqlens_q.tolist() == [0, 3, 6, 10] and lay.cu_seqlens_k.tolist() == [0, 3, 11, 17]
    assert lay.block_tables.tolist() == [[2, SCRATCH], [3, 4], [5, 6]]
    pad = SCRATCH * BS
    assert lay.kv_slots.tolist() == [[8, 9, 10, pad, pad, pad, pad, pad], list(range(12, 20)),
                                     [20, 21, 22, 23, 24, 25, pad, pad]]
    assert lay.q_scatter.tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]
    assert lay.q_gather.tolist() == [0, 1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 9]
    chain = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]  # a padding row sees the root and itself
    tree = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert lay.tree_mask.astype(int).tolist() == [chain, chain, tree]
    # without parents every chunk is a chain and the step has no tree mask
    chains = runner.layout(chunks, HISTORY, None)
    assert chains.tree_mask is None and chains.positions.tolist() == [0, 1, 2, 5, 6, 7, 2, 3, 4, 5]
    assert chains.depth.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 3]
    # the device half: int32 where the kernels take it, the same values
    meta = AttentionMetadata.of(step_tensors(lay, "cpu"))
    assert meta.block_tables.dtype == meta.cu_seqlens_q.dtype == meta.cache_seqlens.dtype == torch.int32
    assert meta.cache_seqlens.tolist() == [3, 8, 6]
    assert (meta.num_seqs, meta.max_query_len, meta.max_context_len) == (3, 4, 8)


def test_graph_padded_layout_equals_eager_on_real_rows():
    """A uniform verify step (pad_to = 4: a chain of 2 drafts padded, a tree of 3 nodes) padded to
    its bucket: the real rows are the eager layout's, dummy rows are chains in the scratch page."""
    runner = _runner({10: [2], 11: [3, 4, 7], 12: [5, 6]}, pad_to=4)
    lay = runner.layout([_chunk(1, 7, 3, False, 2), _chunk(2, 2, 4, False, 1)], HISTORY, PARENTS)
    assert lay.uniform and lay.is_decode and lay.keep.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert lay.positions.tolist() == [7, 8, 9, 10, 2, 3, 3, 4]  # the padded draft at position 10
    bb, lkb = 4, context_bucket(lay.max_context_len, BS)
    padded = pad_layout(lay, bb, lkb, BS, SCRATCH)
    b, t, q, lk = lay.num_seqs, lay.num_tokens, lay.max_query_len, lay.max_context_len
    assert isinstance(padded, StepLayout) and (padded.num_seqs, padded.max_context_len) == (bb, lkb)
    for name in ("input_ids", "positions", "depth", "slot_mapping"):
        assert np.array_equal(getattr(padded, name)[:t], getattr(lay, name)), name
    for name in ("prefill", "query_pos", "context_lens", "tree_mask"):
        assert np.array_equal(getattr(padded, name)[:b], getattr(lay, name)), name
    assert np.array_equal(padded.keep, lay.keep)
    assert np.array_equal(padded.kv_slots[:b, :lk], lay.kv_slots)
    assert (padded.kv_slots[:b, lk:] == SCRATCH * BS).all()
    assert np.array_equal(padded.block_tables[:b, : lay.block_tables.shape[1]], lay.block_tables)
    assert np.array_equal(padded.cu_seqlens_q[: b + 1], lay.cu_seqlens_q)
    assert np.array_equal(padded.cu_seqlens_k[: b + 1], lay.cu_seqlens_k)
    # dummy rows: token 0 at positions 0..q-1 in the scratch page, attending to their own q keys
    assert (padded.input_ids[t:] == 0).all() and padded.positions[t:].tolist() == list(range(q)) * (bb - b)
    assert padded.slot_mapping[t:].tolist() == list(range(SCRATCH * BS, SCRATCH * BS + q)) * (bb - b)
    assert padded.context_lens[b:].tolist() == [q] * (bb - b) and (padded.block_tables[b:] == SCRATCH).all()
    assert (padded.tree_mask[b:] == np.tril(np.ones((q, q), bool))).all()
    with pytest.raises(ValueError, match="uniform decode"):
        pad_layout(runner.layout([_chunk(0, 0, 3, True, 3)], HISTORY, None), 1, 8, BS, SCRATCH)


def test_dummy_rows_wider_than_a_page_wrap_in_the_scratch_page():
    """A tree of 5 nodes (6 tokens a row) over pages of 4: the real row keeps its own slots, the
    dummy rows' tokens write and read scratch slots 0, 1, 2, 3, 0, 1, never a page past it."""
    runner = _runner({11: [3, 4, 7]}, pad_to=6)
    parents = np.array([[-1] * 5, [0, 0, 1, 2, 2]])  # row 1's tree
    lay = runner.layout([_chunk(1, 4, 6, False, 2)], HISTORY, parents)
    assert lay.uniform and lay.max_query_len == 6 > BS
    padded = pad_layout(lay, 2, context_bucket(lay.max_context_len, BS), BS, SCRATCH)
    scratch = SCRATCH * BS + np.array([0, 1, 2, 3, 0, 1])
    assert np.array_equal(padded.slot_mapping[:6], lay.slot_mapping)
    assert np.array_equal(padded.slot_mapping[6:], scratch)
    assert np.array_equal(padded.kv_slots[1, :6], scratch) and (padded.kv_slots[1, 6:] == SCRATCH * BS).all()
    assert (padded.block_tables[1] == SCRATCH).all() and padded.context_lens.tolist() == [lay.context_lens[0], 6]


@pytest.mark.parametrize("tree", [False, True])
def test_a_bucket_of_dummy_rows_only(tree):
    """What a width's graph is captured on before a step of that width runs: 2 rows of 3 tokens,
    every one a dummy in the scratch page, no logits kept."""
    padded = pad_layout(dummy_layout(3, tree), 2, 8, BS, SCRATCH)
    assert (padded.num_seqs, padded.max_query_len, padded.max_context_len) == (2, 3, 8) and padded.uniform
    assert padded.input_ids.tolist() == [0] * 6 and padded.positions.tolist() == [0, 1, 2, 0, 1, 2]
    assert padded.slot_mapping.tolist() == [36, 37, 38] * 2  # scratch page 9 of 4 slots
    assert padded.context_lens.tolist() == [3, 3] and padded.cu_seqlens_k.tolist() == [0, 3, 6]
    assert padded.cu_seqlens_q.tolist() == [0, 3, 6] and padded.keep.tolist() == []
    assert (padded.block_tables == SCRATCH).all() and (padded.kv_slots[:, :3] == [36, 37, 38]).all()
    assert (padded.kv_slots[:, 3:] == 36).all() and not padded.prefill.any()
    assert (padded.tree_mask is not None) == tree
    if tree:
        assert (padded.tree_mask == np.tril(np.ones((3, 3), bool))).all()


def _staging(q: int, bb: int, lkb: int) -> Staging:
    """A bucket's buffer as the graph runner keeps it (on CPU), holding a step of dummy rows."""
    return Staging(pad_layout(dummy_layout(q, False), bb, lkb, BS, SCRATCH), torch.device("cpu"), SCRATCH)


def _assert_same_layout(got: StepLayout, want: StepLayout) -> None:
    for name in ("input_ids", "positions", "depth", "slot_mapping", "keep", "prefill", "query_pos", "kv_slots",
                 "context_lens", "block_tables", "cu_seqlens_q", "cu_seqlens_k"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert got.tree_mask is None and want.tree_mask is None and got.uniform


def test_staged_layout_literal():
    """The module docstring's chunks fed 3 tokens each in a bucket of 2 rows and 16 keys: the padded
    layout, written into the bucket's buffer, with the device's int32 copies beside it."""
    tables = {11: [3, 4, 7], 12: [5, 6]}
    blocks = SimpleNamespace(block_size=BS, tables=tables, table=lambda seq_id: tables[seq_id])
    staging = _staging(3, 2, 16)
    lay = lay_out_staged([_chunk(1, 7, 3, False, 2), _chunk(2, 4, 2, False, 1)], HISTORY, blocks, staging)
    assert lay is staging.layout
    assert lay.positions.tolist() == [7, 8, 9, 4, 5, 6] and lay.context_lens.tolist() == [10, 7]
    assert lay.input_ids.tolist() == [207, 208, 209, 304, 305, 0] and lay.keep.tolist() == [0, 1, 2, 3, 4]
    assert lay.slot_mapping.tolist() == [19, 28, 29, 24, 25, 26]  # positions 7-9: pages 4, 7; 4-6: page 6
    assert lay.block_tables.tolist() == [[3, 4, 7, SCRATCH], [5, 6, SCRATCH, SCRATCH]]
    assert staging.arrays["block_tables"].dtype == np.int32 and staging.arrays["block_tables"].tolist() == \
        lay.block_tables.tolist()
    assert staging.arrays["cache_seqlens"].tolist() == [10, 7]
    assert staging.arrays["cu_seqlens_k"].tolist() == [0, 10, 17]
    assert lay.kv_slots[1].tolist() == [20, 21, 22, 23, 24, 25, 26] + [SCRATCH * BS] * 9
    with pytest.raises(ValueError, match="more than pad_to=3"):
        lay_out_staged([_chunk(1, 7, 4, False, 2)], HISTORY, blocks, staging)


def test_staged_layout_is_the_padded_layout():
    """Random uniform chain steps laid out into their bucket's buffer equal lay_out then
    pad_layout, rows that were real in the step before included (the buffer is reused)."""
    rng = np.random.default_rng(0)
    history = rng.integers(1, 1000, (12, 64))
    for q, bb, lkb in ((1, 4, 32), (3, 8, 64), (5, 8, 64), (6, 2, 32)):
        staging = _staging(q, bb, lkb)
        for _ in range(20):
            b = int(rng.integers(1, bb + 1))
            rows = rng.permutation(12)[:b]
            starts = rng.integers(0, lkb - q + 1, b)
            starts[0] = max(starts[0], lkb // 2 - q + 1)  # the bucket's context: more than half of lkb
            fed = rng.integers(1, q + 1, b)
            tables = {10 + int(r): rng.permutation(40)[: -(-int(s + n) // BS)].tolist()
                      for r, s, n in zip(rows, starts, fed)}
            blocks = SimpleNamespace(block_size=BS, tables=tables, table=lambda seq_id: tables[seq_id])
            chunks = [_chunk(int(r), int(s), int(n), False, 1) for r, s, n in zip(rows, starts, fed)]
            plain = lay_out(chunks, history, blocks, SCRATCH, None, width=q)
            assert (batch_bucket(b) <= bb) and context_bucket(plain.max_context_len, BS) == lkb
            want = pad_layout(plain, bb, lkb, BS, SCRATCH)
            _assert_same_layout(lay_out_staged(chunks, history, blocks, staging), want)
            assert np.array_equal(staging.arrays["block_tables"], want.block_tables)
            assert np.array_equal(staging.arrays["cache_seqlens"], want.context_lens)
            assert np.array_equal(staging.arrays["cu_seqlens_k"], want.cu_seqlens_k)


def test_staging_holds_a_written_step_and_uploads_its_kept_rows():
    """`write` copies a padded step into the buffer the static tensors view (on CPU the same
    memory: no copy); `upload` gives the kept rows of the step written last."""
    padded = pad_layout(dummy_layout(2, False), 2, 8, BS, SCRATCH)
    staging = Staging(padded, torch.device("cpu"), SCRATCH)
    assert staging.device is staging.host and staging.upload().tolist() == []
    tables = {11: [3, 4]}
    blocks = SimpleNamespace(block_size=BS, tables=tables, table=lambda seq_id: tables[seq_id])
    step = pad_layout(lay_out([_chunk(1, 5, 2, False, 2)], HISTORY, blocks, SCRATCH, None, width=2), 2, 8, BS,
                      SCRATCH)
    staging.write(step)
    _assert_same_layout(staging.layout, step)
    assert staging.inputs["positions"].tolist() == [5, 6, 0, 1]  # the static tensors see it in place
    assert staging.inputs["cu_seqlens_q"].dtype == torch.int32 and staging.upload().tolist() == [0, 1]
