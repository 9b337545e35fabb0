"""On a CUDA device: captured graphs against eager steps, the paged backends against dense
attention, and greedy outputs against HF greedy in fp32. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import hf_plookup
from hf_plookup.attention.flash import flash4_paged_attention, flash_paged_attention
from hf_plookup.attention.sdpa import sdpa_paged_attention
from hf_plookup.engine.plan import MAX_BATCH_TOKENS
from hf_plookup.engine.widths import StepCosts
from tests.conftest import OneLayer, dense_causal, left_padded, paged_step, tiny_model, wrap_copy

from .conftest import HAS_CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

ARCHS = ["llama", "mistral", "qwen3", "gemma3_text"]


def _generate(wrapped, batch, k, seed, max_new_tokens=40):
    ids, mask = left_padded(batch, seed=seed)
    return wrapped.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max_new_tokens,
                            prompt_lookup_num_tokens=k)


def _hf(model, batch, seed, max_new_tokens=40):
    ids, mask = left_padded(batch, seed=seed)
    return model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=False, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("arch", ARCHS)
def test_graphs_fp32_identical_to_hf_greedy(arch):
    """sdpa backend, CUDA graphs of the eager forward (padded verify steps), fp32: token-identical
    to HF greedy."""
    model = tiny_model(arch).cuda()
    w = wrap_copy(model, max_cache_tokens=8192, attn_backend="sdpa", compile=False)
    assert w._engine.use_graphs
    for batch, k in ((1, 4), (5, 4), (3, 10), (4, None)):
        assert torch.equal(_hf(model, batch, batch + 7), _generate(w, batch, k, batch + 7)), (arch, batch, k)
    gr = w._engine._graphs
    assert gr is not None and gr.graphs and gr.num_replays > 0
    assert all(g.graph is not None for g in gr.graphs.values())


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_compiled_graphs_fp32_identical_to_hf_greedy(arch, backend):
    """compile=True: inductor-compiled steps with the attention as custom ops, captured in CUDA
    graphs; fp32 greedy token-identical to HF and to the uncompiled graphs."""
    model = tiny_model(arch).cuda()
    w = wrap_copy(model, max_cache_tokens=8192, attn_backend=backend, compile=True)
    # widths by costs given (engine.widths), not measured: which buckets a call needs then follows
    # from its tokens alone, so a call made again compiles nothing, whatever the machine's speed
    w._engine.step_costs = StepCosts.given({(q, b): 1e-3 for q in (1, 3, 5) for b in (1, 2, 4, 8)})
    plain = wrap_copy(model, max_cache_tokens=8192, attn_backend=backend, compile=False)
    for batch, k in ((1, 4), (3, 4), (2, None)):
        out = _generate(w, batch, k, batch + 7)
        assert torch.equal(_hf(model, batch, batch + 7), out), (arch, backend, batch, k)
        assert torch.equal(_generate(plain, batch, k, batch + 7), out), (arch, backend, batch, k)
    gr = w._engine._graphs
    assert gr.compiled and gr.compile_seconds > 0 and all(g.graph is not None for g in gr.graphs.values())
    before = gr.compile_seconds
    _generate(w, 1, 4, 8)  # the first call again: the same buckets, nothing compiles again
    assert gr.compile_seconds == before and w.last_stats.compile_time == 0.0


def test_warmup_compiles_and_captures_before_the_first_call():
    """compile=True with wrap(..., warmup=...): every width that calls of k=4 choose among, in
    every batch bucket up to 4 and every context bucket up to max_length, compiled and captured
    when wrapped; calls of 1 to 4 rows then neither compile nor capture (whichever widths their
    steps pick by measured cost), and give HF's fp32 greedy tokens."""
    model = tiny_model("llama").cuda()
    w = wrap_copy(model, max_cache_tokens=8192, attn_backend="sdpa", compile=True,
                  warmup={"max_batch_size": 4, "prompt_lookup_num_tokens": [0, 4], "max_length": 256})
    gr = w._engine._graphs
    built = len(gr.graphs)
    assert w._engine.warmed["buckets"] == built > 0 and w._engine.warmed["compile_seconds"] > 0
    assert {q for q, *_ in gr.graphs} == {1, 3, 5} and all(g.graph is not None for g in gr.graphs.values())
    for batch, k in ((1, 4), (4, 4), (3, None), (2, 4)):
        out = _generate(w, batch, k, batch + 7)
        s = w.last_stats
        assert torch.equal(_hf(model, batch, batch + 7), out), (batch, k)
        assert s.compile_time == 0.0 and s.capture_time == 0.0 and len(gr.graphs) == built, (batch, k)
        assert s.decode_steps_by_path.get("graph", 0) > 0, (batch, k)


def test_compiled_step_writes_pages_in_place():
    """A compiled, captured step writes its keys and values into the pages themselves: compiling,
    capturing and replaying its buckets allocates far less than one layer's pages. (Traced as an
    `index_copy_` into a view of the pages, torch 2.11's inductor made a new copy of every layer's
    pages per step and copied it back: a step's cost then grew with the cache.)"""
    model = tiny_model("llama").cuda()
    w = wrap_copy(model, max_cache_tokens=1 << 22, attn_backend="sdpa", compile=True)
    cache = w._engine.cache()
    layer_bytes = cache.keys[0].numel() * cache.keys[0].element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = _generate(w, 1, 4, 3, max_new_tokens=12)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < layer_bytes // 4
    assert torch.equal(out, _hf(model, 1, 3, max_new_tokens=12))
    assert w.last_stats.decode_steps_by_path == {"graph": w.last_stats.decode_steps}


def test_step_widths_from_measured_costs_fp32():
    """CUDA graphs pick each verify step's width from what steps measured to cost (engine.widths):
    several widths are captured and tried, and the tokens stay HF greedy's."""
    model = tiny_model("llama").cuda()
    w = wrap_copy(model, max_cache_tokens=8192, attn_backend="sdpa", compile=False)
    assert w._engine.width_policy
    for batch in (1, 4):
        assert torch.equal(_hf(model, batch, 5), _generate(w, batch, 8, 5)), batch
    widths = {q for q, _ in w._engine.step_costs.seconds}
    assert len(widths) >= 2 and widths <= {1, 5, 9}
    graphs = w._engine._graphs.graphs  # each bucket met has every width captured, whichever ran there
    buckets = {key[1:] for key in graphs}
    assert set(graphs) == {(q, *b) for q in (1, 5, 9) for b in buckets}
    assert all(g.graph is not None for g in graphs.values())


def test_graph_replay_identical_to_eager_fp32():
    """sdpa in fp32: captured and eager padded steps give the same tokens."""
    model = tiny_model("mistral").cuda()
    graphs = wrap_copy(model, max_cache_tokens=8192, attn_backend="sdpa", cuda_graphs=True, compile=False)
    eager = wrap_copy(model, max_cache_tokens=8192, attn_backend="sdpa", cuda_graphs=False, pad_drafts=True,
                            compile=False)
    for batch, k in ((1, 4), (6, 4), (2, None)):
        assert torch.equal(_generate(graphs, batch, k, 11), _generate(eager, batch, k, 11)), (batch, k)
    assert graphs._engine._graphs.num_replays > 0 and eager._engine._graphs is None


def test_graph_replay_close_to_eager_flash_bf16(needs_flash):
    """flash_attn in bf16: a graph's block table is a bucket wide, which can change flash-attn's
    split-KV choice and so the rounding; the first tokens must agree on most rows."""
    model = tiny_model("mistral").to(device="cuda", dtype=torch.bfloat16)
    graphs = wrap_copy(model, max_cache_tokens=8192, attn_backend="flash_attn", cuda_graphs=True)
    eager = wrap_copy(model, max_cache_tokens=8192, attn_backend="flash_attn", cuda_graphs=False)
    a, b = _generate(graphs, 8, 4, 11, 16), _generate(eager, 8, 4, 11, 16)
    width = a.shape[1] - 16
    assert (a[:, width : width + 4] == b[:, width : width + 4]).all(dim=1).float().mean() >= 0.75
    assert graphs._engine._graphs.num_replays > 0


def test_flash_fp32_refused_and_auto_falls_back():
    model = tiny_model("llama").cuda()
    with pytest.raises(ValueError, match="attn_backend='flash_attn' cannot run"):
        wrap_copy(model, attn_backend="flash_attn")
    assert wrap_copy(model)._engine.options.attn_backend == "sdpa"  # fp32: auto -> sdpa


@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn4"])
def test_flash_bf16_close_to_sdpa(backend, request):
    """bf16 greedy on flash_attn (FA2) or flash_attn4 vs sdpa, with CUDA graphs: the same model,
    two kernels; outputs may part after a near-tie, so only the first tokens are required to
    agree on most rows."""
    request.getfixturevalue("needs_flash" if backend == "flash_attn" else "needs_flash4")
    model = tiny_model("qwen3").to(device="cuda", dtype=torch.bfloat16)
    flash = wrap_copy(model, max_cache_tokens=8192, attn_backend=backend)
    sdpa = wrap_copy(model, max_cache_tokens=8192, attn_backend="sdpa")
    a, b = _generate(flash, 8, 4, 5, 16), _generate(sdpa, 8, 4, 5, 16)
    assert flash.last_stats.attn_backend == backend
    width = a.shape[1] - 16
    assert (a[:, width : width + 4] == b[:, width : width + 4]).all(dim=1).float().mean() >= 0.75


PAGED = {"sdpa": (sdpa_paged_attention, torch.float32, 16, 2e-5, None),
         "flash_attn": (flash_paged_attention, torch.bfloat16, 256, 2e-2, "needs_flash"),
         "flash_attn4": (flash4_paged_attention, torch.bfloat16, 128, 2e-2, "needs_flash4")}


@pytest.mark.parametrize("backend", sorted(PAGED))
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_paged_backends_match_dense_on_gpu(backend, uniform, window, softcap, request):
    fn, dtype, bs, tol, fixture = PAGED[backend]
    if fixture:
        request.getfixturevalue(fixture)
    meta, query, key, value, qs, full_k, full_v, new = paged_step(dtype, bs, uniform)
    meta.backend = backend
    out = fn(OneLayer(), query, key, value, meta, scaling=0.125, sliding_window=window, softcap=softcap)
    off = 0
    for i, n in enumerate(new):
        ref = dense_causal(qs[i].float(), full_k[i].float(), full_v[i].float(), 0.125, window, softcap)
        torch.testing.assert_close(out[0, off : off + n].transpose(0, 1).float().cpu(), ref, atol=tol, rtol=tol)
        off += n


def test_cache_sized_from_free_memory_after_warmup():
    model = tiny_model("llama").cuda()
    w = wrap_copy(model, cache_memory_fraction=0.05)
    free, _ = torch.cuda.mem_get_info()
    cap_tokens = w._engine.capacity_blocks * w._engine.options.block_size
    per_token = sum(s.bytes_per_token() for s in w._engine.specs)
    assert 0 < cap_tokens * per_token <= 0.05 * free * 1.05 + per_token * w._engine.options.block_size
    assert w._engine.options.max_batch_tokens == MAX_BATCH_TOKENS["cuda"]  # the warm-up forward's tokens
    _generate(w, 2, 4, 1, 8)
