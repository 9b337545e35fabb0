"""Paged attention against dense SDPA on random tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_plookup.attention.metadata import AttentionMetadata, attention_context, current_metadata
from hf_plookup.attention.sdpa import sdpa_paged_attention
from tests.conftest import FixedPages, OneLayer, dense_causal


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("layout", ["uniform", "ragged", "one-token", "one-seq"])
def test_paged_matches_dense(window, softcap, layout):
    g = torch.Generator().manual_seed(0)
    h, h_kv, d, bs, num_blocks = 6, 2, 16, 4, 64
    cached, new = {
        "uniform": ([0, 7, 13, 22], [3, 3, 3, 3]),  # tokens already cached / fed, per sequence
        "ragged": ([0, 7, 13, 22], [1, 5, 2, 9]),
        "one-token": ([17], [1]),  # single sequence paths (no mask / lower-right causal bias)
        "one-seq": ([17], [6]),
    }[layout]
    b = len(cached)
    uniform = layout != "ragged"
    k_cache = torch.randn(num_blocks, bs, h_kv, d, generator=g)  # garbage where nothing is written
    v_cache = torch.randn(num_blocks, bs, h_kv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered block tables
    tables, full_k, full_v = [], [], []
    for i in range(b):
        total = cached[i] + new[i]
        table = [perm.pop() for _ in range(-(-total // bs))]
        tables.append(table)
        kk = torch.randn(h_kv, total, d, generator=g)
        vv = torch.randn(h_kv, total, d, generator=g)
        full_k.append(kk)
        full_v.append(vv)
        for p in range(cached[i]):  # pre-fill the cached part
            k_cache[table[p // bs], p % bs] = kk[:, p]
            v_cache[table[p // bs], p % bs] = vv[:, p]
    qs = [torch.randn(h, new[i], d, generator=g) for i in range(b)]
    tq, lk = max(new), max(c + n for c, n in zip(cached, new))
    kv_slots = np.zeros((b, lk), dtype=np.int64)
    query_pos = np.full((b, tq), -1, dtype=np.int64)
    slot_mapping, q_scatter = [], []
    for i in range(b):
        total = cached[i] + new[i]
        for p in range(total):
            kv_slots[i, p] = tables[i][p // bs] * bs + p % bs
        for j in range(new[i]):
            query_pos[i, j] = cached[i] + j
            slot_mapping.append(kv_slots[i, cached[i] + j])
            q_scatter.append(i * tq + j)
    q_scatter = torch.tensor(q_scatter)
    q_gather = torch.zeros(b * tq, dtype=torch.long)
    q_gather[q_scatter] = torch.arange(len(q_scatter))
    meta = AttentionMetadata(
        kv_cache=FixedPages(k_cache, v_cache),
        slot_mapping=torch.tensor(slot_mapping),
        query_pos=torch.from_numpy(query_pos),
        kv_slots=torch.from_numpy(kv_slots),
        context_lens=torch.tensor([c + n for c, n in zip(cached, new)]),
        q_gather=None if uniform else q_gather,
        q_scatter=None if uniform else q_scatter,
    )
    query = torch.cat(qs, dim=1)[None]  # [1, H, T, D]
    key = torch.cat([full_k[i][:, cached[i] :] for i in range(b)], dim=1)[None]
    value = torch.cat([full_v[i][:, cached[i] :] for i in range(b)], dim=1)[None]
    scale = 0.37
    out = sdpa_paged_attention(OneLayer(), query, key, value, meta, scaling=scale, sliding_window=window, softcap=softcap)
    assert out.shape == (1, sum(new), h, d)
    off = 0
    for i in range(b):
        ref = dense_causal(qs[i], full_k[i], full_v[i], scale, window, softcap)  # [H, n, D]
        got = out[0, off : off + new[i]].transpose(0, 1)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
        off += new[i]
    # the new keys/values were written into the pages at their slots
    for i in range(b):
        p = cached[i] + new[i] - 1
        torch.testing.assert_close(k_cache[tables[i][p // bs], p % bs], full_k[i][:, p])


def test_dense_sdpa_agrees_with_reference():
    """The reference itself against torch's SDPA (causal, no window) so it cannot drift."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 9, 8, generator=g) for _ in range(3))
    ref = dense_causal(q, k, v, 8**-0.5)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), ref, atol=1e-5, rtol=1e-5)


def test_context_is_reset_even_on_error():
    meta = AttentionMetadata(
        kv_cache=None,
        slot_mapping=torch.zeros(1, dtype=torch.long),
        query_pos=torch.zeros(1, 1, dtype=torch.long),
        kv_slots=torch.zeros(1, 1, dtype=torch.long),
        context_lens=torch.ones(1, dtype=torch.long),
        q_gather=None,
        q_scatter=None,
    )
    with pytest.raises(KeyError):
        with attention_context(meta):
            assert current_metadata() is meta
            raise KeyError("boom")
    with pytest.raises(RuntimeError, match="outside an engine forward"):
        current_metadata()


def test_metadata_validates_shapes():
    with pytest.raises(ValueError, match="query_pos"):
        AttentionMetadata(
            kv_cache=None,
            slot_mapping=torch.zeros(2, dtype=torch.long),
            query_pos=torch.zeros(1, 3, dtype=torch.long),
            kv_slots=torch.zeros(2, 2, dtype=torch.long),  # B = 2 rows of keys for B = 1 of queries
            context_lens=torch.ones(1, dtype=torch.long),
            q_gather=None,
            q_scatter=None,
        )
