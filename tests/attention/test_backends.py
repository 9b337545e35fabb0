"""Attention backend selection, the flash backend's plumbing (against a plain-torch stand-in for
flash-attn's kernels), padded verify steps and the CUDA-graph runner's static-buffer path on CPU.

The real flash-attn kernels and graph capture need CUDA: tests/gpu."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch

import hf_plookup
from hf_plookup.attention import registry
from hf_plookup.attention.flash import flash_paged_attention, window_size
from hf_plookup.attention.metadata import AttentionMetadata
from hf_plookup.steps.graphs import BATCH_BUCKETS, GraphRunner, batch_bucket, context_bucket, pad_layout
from tests.conftest import FixedPages, OneLayer, causal_visible, dense_attention, dense_causal, left_padded, tiny_model, wrap_copy


# -- a plain-torch stand-in for flash_attn, written from flash-attn's docstrings ------------------
def _ref_attend(q, k, v, scale, causal, window, softcap):
    """q [sq, H, D], k/v [sk, H_kv, D]; causal and window aligned to the bottom right, as
    flash-attn documents: query i sees keys [i + sk - sq - left, i + sk - sq + right]."""
    left, right = window
    visible = causal_visible(q.shape[0], k.shape[0], left=left, right=0 if causal else right)
    return dense_attention(q, k, v, visible, scale, softcap if softcap > 0 else None).to(q.dtype)


def _pages(cache, table, n):
    """The first n positions of a sequence's pages: [n, H_kv, D]."""
    return cache[table.long()].reshape(-1, *cache.shape[2:])[:n]


def _check_paged(k_cache, block_table):
    assert block_table.dtype == torch.int32
    assert k_cache.shape[1] % 256 == 0, "FA2: paged KV block size must be divisible by 256"


def _fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                 causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                 return_attn_probs=False, block_table=None):
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    _check_paged(k, block_table)
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        sk = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert q1 - q0 <= max_seqlen_q and sk <= max_seqlen_k
        out[q0:q1] = _ref_attend(q[q0:q1], _pages(k, block_table[b], sk), _pages(v, block_table[b], sk),
                                 softmax_scale, causal, window_size, softcap)
    return out


def _fake_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                  cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                  window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                  return_softmax_lse=False):
    assert k is None and v is None and cache_seqlens.dtype == torch.int32
    _check_paged(k_cache, block_table)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        sk = int(cache_seqlens[b])
        out[b] = _ref_attend(q[b], _pages(k_cache, block_table[b], sk), _pages(v_cache, block_table[b], sk),
                             softmax_scale, causal, window_size, softcap)
    return out


@pytest.fixture
def fake_flash(monkeypatch):
    """flash_attn importable (as the stand-in) and allowed on this CPU."""
    mod = types.ModuleType("flash_attn")
    mod.flash_attn_varlen_func = _fake_varlen
    mod.flash_attn_with_kvcache = _fake_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.setattr(registry, "flash_unavailable_reason", lambda devices, dtypes: None)
    return mod


def _fake_fa4_varlen(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
                     softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
                     **rest):
    """FlashAttention-4's `flash_attn.cute.flash_attn_varlen_func` as its docstring and argument
    checks state it: with `page_table` (int32 [B, pages]) keys come from the pages, counted by
    `seqused_k`, and `cu_seqlens_k` is refused; q is [B, Tq, H, D] or packed with `cu_seqlens_q`;
    windows of negative sizes mean none; returns (out, lse)."""
    assert cu_seqlens_k is None and page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
    assert k.shape[:2] == v.shape[:2] and page_table.stride(-1) == 1 and q.is_contiguous()
    window = tuple(-1 if w is None else w for w in window_size)
    if cu_seqlens_q is None:
        rows = [(b, slice(None)) for b in range(q.shape[0])]
    else:
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (page_table.shape[0] + 1,)
        rows = [(b, slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))) for b in range(page_table.shape[0])]
    out = torch.empty_like(q)
    for b, r in rows:
        qb = q[b] if cu_seqlens_q is None else q[r]
        assert max_seqlen_q is None or qb.shape[0] <= max_seqlen_q
        sk = int(seqused_k[b])
        o = _ref_attend(qb, _pages(k, page_table[b], sk), _pages(v, page_table[b], sk), softmax_scale, causal,
                        window, softcap)
        if cu_seqlens_q is None:
            out[b] = o
        else:
            out[r] = o
    return out, None


@pytest.fixture
def fake_flash4(monkeypatch):
    """flash_attn.cute importable (as the FA4 stand-in) and allowed on this CPU."""
    parent = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = _fake_fa4_varlen
    parent.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", parent)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(registry, "flash4_unavailable_reason", lambda devices, dtypes: None)
    return cute


def test_stand_in_matches_dense_reference():
    """The stand-in kernel itself (contiguous, no paging) against the sdpa tests' reference."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    for window in (None, 4):
        ref = dense_causal(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.3, window, 20.0)
        got = _ref_attend(q, k, v, 0.3, True, window_size(window), 20.0)
        torch.testing.assert_close(got.transpose(0, 1), ref, atol=1e-5, rtol=1e-5)


# -- selection ---------------------------------------------------------------------------------
def test_auto_is_sdpa_on_cpu(llama):
    w = wrap_copy(llama, max_cache_tokens=512)
    assert w.options.attn_backend == "auto" and w._engine.options.attn_backend == "sdpa"
    assert w._engine.options.block_size == 16 and not w._engine.use_graphs
    ids, mask = left_padded(2)
    w.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert w.last_stats.attn_backend == "sdpa"


def test_flash_attn_where_it_cannot_run(llama):
    with pytest.raises(ValueError, match="attn_backend='flash_attn' cannot run"):
        wrap_copy(llama, attn_backend="flash_attn")
    reason = registry.flash_unavailable_reason([torch.device("cpu")], [torch.float32])
    assert reason is not None
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        wrap_copy(llama, attn_backend="flash")
    with pytest.raises(ValueError, match="cuda_graphs"):
        wrap_copy(llama, cuda_graphs="yes")


def test_unavailable_reasons(monkeypatch):
    from hf_plookup.attention.flash import flash4_unavailable_reason, flash_unavailable_reason

    mod = types.ModuleType("flash_attn")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)  # "installed"
    mod.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    # FA4 alone installs a bare `flash_attn` package (no FA2 kernels): flash_attn cannot run
    assert "do not import" in flash_unavailable_reason([torch.device("cuda", 0)], [torch.bfloat16])
    assert "not installed" in flash4_unavailable_reason([torch.device("cuda", 0)], [torch.bfloat16])
    mod.flash_attn_varlen_func, mod.flash_attn_with_kvcache = _fake_varlen, _fake_kvcache
    assert "CUDA" in flash_unavailable_reason([torch.device("cpu")], [torch.bfloat16])
    assert "bfloat16" in flash_unavailable_reason([torch.device("cuda", 0)], [torch.float32])
    assert flash_unavailable_reason([torch.device("cuda", 0)], [torch.bfloat16]) is None

    cute = types.ModuleType("flash_attn.cute")
    cute.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    assert "CUDA" in flash4_unavailable_reason([torch.device("cpu")], [torch.bfloat16])
    assert "bfloat16" in flash4_unavailable_reason([torch.device("cuda", 0)], [torch.float32])
    for capability, ok in (((8, 0), False), ((9, 0), True), ((10, 0), True), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        reason = flash4_unavailable_reason([torch.device("cuda", 0)], [torch.bfloat16])
        assert (reason is None) == ok and (ok or "Hopper" in reason), (capability, reason)


def test_flash_block_size(fake_flash, llama):
    assert registry.resolve_backend("auto", [torch.device("cpu")], [torch.float32]) == "flash_attn"
    w = wrap_copy(llama, attn_backend="flash_attn", max_cache_tokens=1024)
    assert w._engine.options.block_size == 256
    with pytest.raises(ValueError, match="block_size must be a multiple of 256"):
        wrap_copy(llama, attn_backend="flash_attn", block_size=16)
    assert wrap_copy(llama, attn_backend="sdpa", block_size=16)._engine.options.block_size == 16


# -- flash backend plumbing against the dense reference --------------------------------------------
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("uniform", [True, False])
def test_flash_backend_matches_dense(fake_flash, window, softcap, uniform):
    g = torch.Generator().manual_seed(0)
    h, h_kv, d, bs, num_blocks = 6, 2, 16, 256, 8
    cached = [0, 7, 300, 22]
    new = [3, 3, 3, 3] if uniform else [1, 5, 2, 9]
    b = len(cached)
    k_cache = torch.randn(num_blocks, bs, h_kv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, h_kv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_k, full_v = [], [], []
    for i in range(b):
        total = cached[i] + new[i]
        tables.append([perm.pop() for _ in range(-(-total // bs))])
        full_k.append(torch.randn(h_kv, total, d, generator=g))
        full_v.append(torch.randn(h_kv, total, d, generator=g))
        for p in range(cached[i]):
            k_cache[tables[i][p // bs], p % bs] = full_k[i][:, p]
            v_cache[tables[i][p // bs], p % bs] = full_v[i][:, p]
    qs = [torch.randn(h, new[i], d, generator=g) for i in range(b)]
    ctx = [c + n for c, n in zip(cached, new)]
    width = max(len(t) for t in tables)
    bt = torch.zeros(b, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    slots = [tables[i][p // bs] * bs + p % bs for i in range(b) for p in range(cached[i], ctx[i])]
    tq, lk = max(new), max(ctx)
    meta = AttentionMetadata(
        kv_cache=FixedPages(k_cache, v_cache),
        slot_mapping=torch.tensor(slots),
        query_pos=torch.zeros(b, tq, dtype=torch.long),  # unused by this backend
        kv_slots=torch.zeros(b, lk, dtype=torch.long),
        context_lens=torch.tensor(ctx),
        q_gather=None if uniform else torch.zeros(b * tq, dtype=torch.long),
        q_scatter=None if uniform else torch.zeros(sum(new), dtype=torch.long),
        backend="flash_attn",
        cu_seqlens_q=torch.tensor(np.concatenate([[0], np.cumsum(new)]), dtype=torch.int32),
        cu_seqlens_k=torch.tensor(np.concatenate([[0], np.cumsum(ctx)]), dtype=torch.int32),
        cache_seqlens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=bt,
    )
    query = torch.cat(qs, dim=1)[None]
    key = torch.cat([full_k[i][:, cached[i] :] for i in range(b)], dim=1)[None]
    value = torch.cat([full_v[i][:, cached[i] :] for i in range(b)], dim=1)[None]
    out = flash_paged_attention(OneLayer(), query, key, value, meta, scaling=0.37, sliding_window=window, softcap=softcap)
    assert out.shape == (1, sum(new), h, d)
    off = 0
    for i in range(b):
        ref = dense_causal(qs[i], full_k[i], full_v[i], 0.37, window, softcap)
        torch.testing.assert_close(out[0, off : off + new[i]].transpose(0, 1), ref, atol=2e-5, rtol=2e-5)
        off += new[i]


def _hf_equal(model, wrapped, batch, k, seed=7, max_new_tokens=30):
    ids, mask = left_padded(batch, seed=seed)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=k)
    return torch.equal(ref, out)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_flash_backend_engine_identical_to_hf(fake_flash, arch):
    """The whole engine on the flash backend (varlen prefill, kvcache verify steps) in fp32."""
    model = tiny_model(arch)
    for pad in (False, True):
        w = wrap_copy(model, attn_backend="flash_attn", max_cache_tokens=2048, pad_drafts=pad)
        for batch, k in ((1, 4), (3, 4), (2, None)):
            assert _hf_equal(model, w, batch, k), (arch, pad, batch, k)
        assert w.last_stats.attn_backend == "flash_attn"


@pytest.mark.parametrize("arch", ["mistral"])
def test_flash4_backend_engine_identical_to_hf(fake_flash4, arch):
    """The engine on the FlashAttention-4 backend (packed prefill chunks and unpadded drafts with
    cu_seqlens_q, uniform verify steps as [B, Tq, H, D]; mistral: sliding window) in fp32, and the
    static-buffer path CUDA graphs replay."""
    model = tiny_model(arch)
    for pad in (False, True):
        w = wrap_copy(model, attn_backend="flash_attn4", max_cache_tokens=2048, pad_drafts=pad)
        assert w._engine.options.block_size == 128
        for batch, k in ((1, 4), (3, 4), (2, None)):
            assert _hf_equal(model, w, batch, k), (arch, pad, batch, k)
        assert w.last_stats.attn_backend == "flash_attn4"
    gr = _eager_graph_runner(w, "flash_attn4")
    assert _hf_equal(model, w, 3, 4) and gr.num_replays > 0


def test_flash4_where_it_cannot_run(llama):
    """Named where it cannot run: a ValueError saying why (here: not installed, or not CUDA)."""
    with pytest.raises(ValueError, match="attn_backend='flash_attn4' cannot run: "):
        wrap_copy(llama, attn_backend="flash_attn4")


# -- padded verify steps ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
def test_pad_drafts_identical_to_hf(arch):
    model = tiny_model(arch)
    # block_size 4 < k + 1: padded positions past a sequence's pages go to the scratch page
    for bs in (4, 16):
        w = wrap_copy(model, max_cache_tokens=4096, block_size=bs, pad_drafts=True)
        for batch, k in ((1, 4), (4, 10), (3, None)):
            assert _hf_equal(model, w, batch, k, seed=batch + 7), (arch, bs, batch, k)
        assert w._engine.blocks.num_free == w._engine.blocks.num_blocks


def test_pad_to_for_padded_verify_steps(llama):
    w = wrap_copy(llama, max_cache_tokens=512, block_size=4, pad_drafts=True)
    eng = w._engine
    assert eng.pad_to(4) == 5 and wrap_copy(llama, max_cache_tokens=512)._engine.pad_to(4) is None


# -- graph runner (static buffers, bucket padding) without CUDA ------------------------------------
def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert [context_bucket(n, 16) for n in (1, 16, 17, 33, 200)] == [32, 32, 32, 64, 256]
    assert context_bucket(300, 256) == 512


def _eager_graph_runner(wrapped, backend="sdpa"):
    eng = wrapped._engine
    eng.use_graphs = True
    eng._graphs = GraphRunner(wrapped, eng.cache(), backend, eng.options.max_num_seqs, capture=False)
    return eng._graphs


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
def test_graph_runner_static_buffers_identical_to_hf(arch):
    """Verify steps through GraphRunner's padded static buffers (dummy rows, bucketed Lk), run
    eagerly: the path a captured graph replays, minus the capture."""
    model = tiny_model(arch)
    w = wrap_copy(model, max_cache_tokens=4096, block_size=16)
    gr = _eager_graph_runner(w)
    for batch, k in ((1, 4), (3, 4), (5, 10), (3, None)):
        assert _hf_equal(model, w, batch, k, seed=batch + 3), (arch, batch, k)
    assert gr.num_replays > 0
    assert {key[1] for key in gr.graphs} >= {1, 4, 8}  # batch buckets with dummy rows
    (q, bb, _, _), g = next(iter(gr.graphs.items()))  # the benchmarks' kernel count: a bucket's last step again
    with torch.inference_mode():
        assert gr._forward(g).shape == (bb * q, model.config.vocab_size)


def _layout(n_tokens, prefill, q=None):
    """A StepLayout of len(n_tokens) rows feeding these many tokens (only its shape matters here)."""
    from hf_plookup.base.layout import StepLayout

    b, tq = len(n_tokens), max(n_tokens)
    t = sum(n_tokens)
    cu = np.concatenate([[0], np.cumsum(n_tokens)])
    gather = None if len(set(n_tokens)) == 1 else (np.zeros(b * tq, np.int64), np.zeros(t, np.int64))
    return StepLayout(input_ids=np.zeros(t, np.int64), positions=np.zeros(t, np.int64), depth=np.zeros(t, np.int64),
                      slot_mapping=np.zeros(t, np.int64), keep=np.arange(t), prefill=np.array(prefill),
                      query_pos=np.zeros((b, tq), np.int64), kv_slots=np.zeros((b, 32), np.int64),
                      context_lens=np.full(b, 32), block_tables=np.zeros((b, 2), np.int64), cu_seqlens_q=cu,
                      cu_seqlens_k=np.arange(b + 1) * 32, q_gather=gather and gather[0], q_scatter=gather and gather[1])


def test_graph_runner_says_which_steps_it_takes(llama):
    """GraphRunner.unsupported on literal layouts: why a step runs eagerly instead."""
    w = wrap_copy(llama, max_cache_tokens=512, block_size=16, max_num_seqs=3)
    gr = GraphRunner(w, w._engine.cache(), "sdpa", 3, capture=False)
    assert gr.max_batch == 4 and gr.path == "static"
    assert gr.unsupported(_layout([5, 5, 5], [False] * 3)) is None and gr.unsupported(_layout([1], [False])) is None
    assert gr.unsupported(_layout([5, 3], [False, True])) == "a prompt chunk"
    assert gr.unsupported(_layout([5, 3], [False, False])) == "rows feed different numbers of tokens"
    assert gr.unsupported(_layout([1] * 5, [False] * 5)) == "more rows than the largest batch bucket (4)"
    assert gr.unsupported(_layout([17], [False])) is None  # wider than a page: dummy rows wrap in the scratch page


def test_step_paths_counted_and_eager_calls_logged(llama, caplog):
    """Each call's decode steps by path: the static buckets while a batch fits them; eager, with
    the reason and one log line, when it does not."""
    w = wrap_copy(llama, max_cache_tokens=4096, block_size=16)
    eng = w._engine
    eng._graphs = GraphRunner(w, eng.cache(), "sdpa", 2, capture=False)  # buckets of 1 and 2 rows
    ids, mask = left_padded(3, seed=4)
    with caplog.at_level("WARNING", logger="hf_plookup"):
        w.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=12)
        s = w.last_stats
        assert s.decode_steps_by_path == {"static": s.forwards - s.prefill_forwards} and s.eager_reasons == {}
        assert not caplog.records
        w.generate(ids, attention_mask=mask, max_new_tokens=12)
    s = w.last_stats
    assert s.decode_steps_by_path == {"eager": 11} and s.eager_reasons == {"more rows than the largest batch bucket (2)": 11}
    assert [r.getMessage() for r in caplog.records] == [
        "hf_plookup: 11 of 11 decode steps of this call ran eagerly, off the captured or compiled steps "
        "(more rows than the largest batch bucket (2): 11)"]
    assert s.as_dict()["decode_steps_by_path"] == {"eager": 11}


def test_graph_runner_flash_static_buffers(fake_flash):
    model = tiny_model("mistral")
    w = wrap_copy(model, attn_backend="flash_attn", max_cache_tokens=2048)
    gr = _eager_graph_runner(w, "flash_attn")
    for batch, k in ((3, 4), (2, None)):
        assert _hf_equal(model, w, batch, k), (batch, k)
    assert gr.num_replays > 0


def test_pad_layout_rejects_bad_buckets(llama):
    w = wrap_copy(llama, max_cache_tokens=512, block_size=8, pad_drafts=True)
    eng = w._engine
    cache = eng.cache()
    from hf_plookup.base.layout import StepLayout

    layout = StepLayout(input_ids=np.zeros(4, np.int64), positions=np.arange(4), depth=np.array([0, 1, 0, 1]),
                        slot_mapping=np.arange(4), keep=np.arange(4), prefill=np.zeros(2, bool),
                        query_pos=np.arange(4).reshape(2, 2), kv_slots=np.zeros((2, 8), np.int64),
                        context_lens=np.array([6, 8]), block_tables=np.zeros((2, 1), np.int64),
                        cu_seqlens_q=np.array([0, 2, 4]), cu_seqlens_k=np.array([0, 6, 14]))
    padded = pad_layout(layout, 4, 16, 8, cache.scratch_block)
    assert padded.input_ids.shape == (8,) and padded.kv_slots.shape == (4, 16)
    assert (padded.block_tables[2:] == cache.scratch_block).all() and list(padded.context_lens) == [6, 8, 2, 2]
    with pytest.raises(ValueError, match="bucket"):
        pad_layout(layout, 1, 16, 8, cache.scratch_block)
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(llama, cache, "sdpa", 8, capture=True)


# -- CUDA cache sizing, with torch.cuda's memory queries faked -------------------------------------
def test_cuda_cache_sizing_after_warmup(monkeypatch, llama):
    from hf_plookup.engine import kv_cache

    # the specs first: layer_specs runs probe forwards of its own, before the warm-up is counted
    specs = [kv_cache.LayerSpec(s.num_kv_heads, s.head_dim, s.dtype, torch.device("cuda")) for s in kv_cache.layer_specs(llama)]
    calls = []
    fake = dict(synchronize=lambda *a: None, empty_cache=lambda: None, reset_peak_memory_stats=lambda *a: None,
                memory_allocated=lambda *a: 1000, max_memory_allocated=lambda *a: 1000 + 500_000,
                mem_get_info=lambda *a: (100_000_000, 200_000_000))
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    orig_forward = llama.forward

    def forward(*a, **kw):
        calls.append(kw["input_ids"].shape)
        return orig_forward(*a, **kw)

    monkeypatch.setattr(llama, "forward", forward)
    per_token = sum(s.bytes_per_token() for s in specs)
    tokens = kv_cache.default_num_tokens(specs, 0.5, llama, warmup_tokens=64, logits_rows=10)
    assert calls == [(1, 64)]  # one warm-up forward of warmup_tokens tokens
    free = 100_000_000 - 500_000 - 2 * 4 * 96 * 10
    assert tokens == int(free * 0.5) // per_token
    assert kv_cache.default_num_tokens(specs, 0.5) == int(100_000_000 * 0.5) // per_token  # no model: no warm-up


@pytest.mark.parametrize("backend", ["triton", "flash_attn", "flash_attn4"])
def test_values_of_another_head_size_run_on_sdpa_only(backend):
    """Multi-head latent attention (values narrower than keys): "auto" picks sdpa, the paged
    kernels that assume one head size are refused by name."""
    model = tiny_model("deepseek_v3")
    assert wrap_copy(model)._engine.options.attn_backend == "sdpa"
    with pytest.raises(ValueError, match=rf"attn_backend='{backend}' cannot run this model: .*multi-head latent"):
        wrap_copy(model, attn_backend=backend)


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_attention_sinks_run_on_sdpa_only(backend):
    """gpt-oss's attention sinks are in the sdpa backend's explicit form only: "auto" picks sdpa,
    the paged kernels are refused by name, and so are compiled steps."""
    model = tiny_model("gpt_oss")
    assert wrap_copy(model)._engine.options.attn_backend == "sdpa"
    with pytest.raises(ValueError, match=rf"attn_backend='{backend}' cannot run this model: .*sinks"):
        wrap_copy(model, attn_backend=backend)


def test_sinks_in_the_softmax_literal():
    """One query over two keys of equal score, value rows [1, 0] and [0, 1]: without a sink each
    key gets 1/2; a sink logit equal to the scores takes a third of the weight; a sink of -inf is
    no sink."""
    from hf_plookup.base.dense import softcapped_attention

    q = torch.zeros(1, 1, 1, 2)
    k = torch.zeros(1, 1, 2, 2)
    v = torch.eye(2)[None, None]
    mask = torch.ones(1, 1, 1, 2, dtype=torch.bool)
    plain = softcapped_attention(q, k, v, mask, 1.0, None)
    assert torch.allclose(plain, torch.tensor([[[[0.5, 0.5]]]]))
    assert torch.allclose(softcapped_attention(q, k, v, mask, 1.0, None, torch.zeros(1)), torch.full((1, 1, 1, 2), 1 / 3))
    assert torch.equal(softcapped_attention(q, k, v, mask, 1.0, None, torch.full((1,), -float("inf"))), plain)
