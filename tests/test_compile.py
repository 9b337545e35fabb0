"""Compiled steps on CPU: the custom ops against the eager backends, torch.library's own checks
of the ops, fullgraph tracing of every tiny architecture, and compiled engines token-identical to
HF greedy and to uncompiled ones. (On CUDA the compiled forward is also captured in graphs:
tests/gpu.)"""

from __future__ import annotations

import pytest
import torch

import hf_plookup
from hf_plookup.attention.ops import compiled_paged_attention, paged_attention
from hf_plookup.attention.sdpa import sdpa_paged_attention
from hf_plookup.steps import graphs
from hf_plookup.engine.plan import resolve_compile
from tests.conftest import ARCHS, EAGER_ONLY, left_padded, paged_step, tiny_model, wrap_copy


class _Layer(torch.nn.Module):
    layer_idx = 0


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()  # drop compiled graphs (they hold the test's model)


def _op_args(meta, query, key, value, backend, window, softcap):
    k_cache, v_cache = meta.kv_cache.layer(0)
    return (query, key, value, k_cache, v_cache, meta.slot_mapping, meta.kv_slots, meta.query_pos, meta.context_lens,
            meta.block_tables, meta.cache_seqlens, meta.cu_seqlens_q, meta.q_gather, meta.q_scatter, None, backend, 0.3,
            window or 0, softcap or 0.0, False)


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_ops_match_eager_backend(uniform, window, softcap):
    """The paged_attention op (its KV write, then sdpa inside) writes the pages and gives what the
    eager sdpa backend gives."""
    meta, query, key, value, *_ = paged_step(torch.float32, 16, uniform, device="cpu")
    meta.static_shapes = True  # what compiled steps run on (explicit masks, as the ops use)
    k_cache, v_cache = meta.kv_cache.layer(0)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = sdpa_paged_attention(_Layer(), query, key, value, meta, scaling=0.3, sliding_window=window, softcap=softcap)
    written_k, written_v = k_cache.clone(), v_cache.clone()
    assert not torch.equal(written_k, ref_k)  # the step wrote keys
    k_cache.copy_(ref_k)
    v_cache.copy_(ref_v)
    out = paged_attention(*_op_args(meta, query, key, value, "sdpa", window, softcap))
    assert torch.equal(out, ref)
    assert torch.equal(k_cache, written_k) and torch.equal(v_cache, written_v)  # written in place
    k_cache.copy_(ref_k)
    v_cache.copy_(ref_v)
    meta.backend = "sdpa"
    both = compiled_paged_attention(_Layer(), query, key, value, meta, scaling=0.3, sliding_window=window, softcap=softcap)
    assert torch.equal(both, ref) and torch.equal(k_cache, written_k) and torch.equal(v_cache, written_v)


def test_triton_op_matches_sdpa_op():
    """The op's Triton branch (interpreter on CPU) against its sdpa branch."""
    pytest.importorskip("triton")
    meta, query, key, value, *_ = paged_step(torch.float32, 16, False, device="cuda" if torch.cuda.is_available() else "cpu")
    a = paged_attention(*_op_args(meta, query, key, value, "sdpa", 5, None))
    b = paged_attention(*_op_args(meta, query, key, value, "triton", 5, None))
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_opcheck():
    """torch.library's checks: schema, fake (meta) implementation, AOT dispatch."""
    meta, query, key, value, *_ = paged_step(torch.float32, 16, True, device="cpu")
    torch.library.opcheck(paged_attention, _op_args(meta, query, key, value, "sdpa", None, None),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def _equal_to_hf(model, wrapped, batch, k, seed, max_new_tokens=12):
    ids, mask = left_padded(batch, seed=seed)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=k)
    return torch.equal(ref, out)


def _regional(wrapped):
    """The engine's compiled steps with one compiled decoder layer for all layers (steps.regional),
    uncaptured: what a CUDA-graph step compiles, on CPU."""
    eng = wrapped._engine
    eng._graphs = graphs.GraphRunner(wrapped, eng.cache(), eng.options.attn_backend, eng.options.max_num_seqs,
                                     capture=False, compiled=True, regional=True)
    return eng._graphs


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_arch_traces_fullgraph(arch, monkeypatch):
    """Every architecture's decoder layer with our attention traces with fullgraph=True (no graph
    break) and runs the traced graph through AOT autograd (backend aot_eager: the op's fake
    implementation and functionalisation of the KV write, without inductor's code generation,
    which the next test pays for); one compiled layer serves every layer; fp32 greedy identical
    to HF."""
    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")
    model = tiny_model(arch)
    if arch in EAGER_ONLY:
        with pytest.raises(ValueError, match="compile=True cannot run: its (position embedding|attention has sinks)"):
            wrap_copy(model, max_cache_tokens=2048, compile=True)
        return
    w = wrap_copy(model, max_cache_tokens=2048, compile=True)
    gr = _regional(w)
    assert [i for _, i in gr._regional.layers] == list(range(model.config.num_hidden_layers)), arch
    assert _equal_to_hf(model, w, 2, 4, seed=3), arch
    assert gr.graphs and gr.num_replays > 0


@pytest.mark.parametrize("arch, regional", [("llama", False), ("gemma2", True)])
def test_inductor_compiled_identical_to_hf_and_eager(arch, regional):
    """Inductor-compiled steps (gemma2: attention and final-logit softcap, sliding windows):
    identical to HF greedy and to the uncompiled engine; compile time reported once per bucket.
    llama: the whole forward per bucket (the engine's choice for uncaptured steps, as here on CPU);
    gemma2: one compiled decoder layer per bucket and kind of layer (sliding and global) serves
    every layer (the choice for captured steps). A bucket is a step width and batch bucket: the
    context buckets the call crosses (the key dimension is dynamic) compile nothing again."""
    from torch._dynamo.utils import counters

    model = tiny_model(arch)
    w = wrap_copy(model, max_cache_tokens=2048, compile=True)
    if regional:
        _regional(w)
    plain = wrap_copy(model, max_cache_tokens=2048, compile=False, pad_drafts=True)
    ids, mask = left_padded(2, seed=5, repeats=4.5)  # 54 tokens: the call crosses 64 keys
    kw = dict(attention_mask=mask, max_new_tokens=16, prompt_lookup_num_tokens=4)
    counters.clear()
    out = w.generate(ids, **kw)
    s = w.last_stats
    assert s.compile_time > 0 and s.capture_time == 0.0  # compiled, not captured (CPU)
    # every decode step ran its bucket's compiled forward (prompt chunks run eagerly)
    assert s.decode_steps_by_path == {"compiled": s.forwards - s.prefill_forwards}
    gr = w._engine._graphs
    assert (gr._regional is not None) == regional
    kinds = len(set(getattr(model.config, "layer_types", None) or ["full"])) if regional else 1
    widths = {(q, b, tree) for q, b, _, tree in gr.graphs}
    assert len({lk for _, _, lk, _ in gr.graphs}) >= 2  # (the call crossed context buckets)
    assert counters["stats"]["unique_graphs"] == kinds * len(widths)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16))
    assert torch.equal(out, plain.generate(ids, **kw))
    again = w.generate(ids, **kw)
    assert torch.equal(again, out) and w.last_stats.compile_time == 0.0  # buckets compiled once


def test_compile_option_checks(llama):
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        wrap_copy(llama, compile="yes")
    assert wrap_copy(llama)._engine.use_compile is False  # auto: off on CPU (measured slower)
    # and on CUDA: CUDA graphs of the eager step, without compiling a bucket on first use
    cuda = [torch.device("cuda")]
    assert resolve_compile("auto", cuda, "sdpa") is False and resolve_compile(True, cuda, "sdpa") is True
    assert wrap_copy(llama, compile=True)._engine.use_compile is True


_COMPILED_CALL = """
import json, sys, torch
from torch._dynamo.utils import counters
from tests.conftest import tiny_model, wrap_copy
torch.manual_seed(0)
w = wrap_copy(tiny_model("llama"), compile=True, max_cache_tokens=512)
ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(1))
out = w.generate(ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2, eos_token_id=None, pad_token_id=0)
print(json.dumps({"inductor": dict(counters["inductor"]), "tokens": out[0].tolist(),
                  "steps": w.last_stats.decode_steps_by_path}))
"""


def test_second_process_loads_the_first_ones_compiled_steps(tmp_path):
    """compile=True: a second process's first call reuses the compiled step that an earlier
    process wrote to torch's on-disk cache (inductor's FX graph cache: the generated kernels, not
    compiled again), and generates the same tokens. Counted with torch's own counters."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(Path(__file__).parents[1]))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _COMPILED_CALL], env=env, capture_output=True, text=True,
                              timeout=900, cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["steps"].get("compiled", 0) > 0 and first["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0 and second["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert second["tokens"] == first["tokens"] and second["steps"] == first["steps"]


def test_warmup_builds_the_buckets_before_the_first_call(monkeypatch):
    """wrap(..., warmup=...) compiles at wrap time the steps that calls of up to max_batch_size
    rows and the given k meet, in every batch bucket up to it and every context bucket up to
    max_length: a later call of those compiles nothing (torch's own graph count unchanged,
    `compile_time` 0) though its batch shrinks as rows finish, a call of another k still does, and
    so does a step whose compiled code torch dropped; the tokens are HF's."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")
    model = tiny_model("llama")
    counters.clear()
    w = wrap_copy(model, max_cache_tokens=1024, compile=True,
                  warmup={"max_batch_size": 2, "prompt_lookup_num_tokens": [4], "max_length": 200})
    gr = w._engine._graphs
    # width 5 at batch buckets 1 and 2, context buckets 32..256 (16-token pages): a compile per
    # batch bucket serves its context buckets
    assert sorted(gr.graphs) == [(5, b, lk, False) for b in (1, 2) for lk in (32, 64, 128, 256)]
    assert w._engine.warmed["buckets"] == 8 and w._engine.warmed["compile_seconds"] > 0
    assert counters["stats"]["unique_graphs"] == 2
    ids, mask = left_padded(2, seed=5, repeats=4.5)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    out = w.generate(ids, attention_mask=mask, max_new_tokens=16, prompt_lookup_num_tokens=4)
    s = w.last_stats
    assert torch.equal(out, ref)
    assert s.compile_time == 0.0 and s.decode_steps_by_path == {"compiled": s.forwards - s.prefill_forwards}
    assert counters["stats"]["unique_graphs"] == 2 and len(gr.graphs) == 8
    assert s.decode_steps_by_path["compiled"] > 1 and s.num_sequences == 2
    two = w.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, prompt_lookup_num_tokens=2)
    assert w.last_stats.compile_time > 0 and counters["stats"]["unique_graphs"] == 3  # width 3: not warmed
    assert torch.equal(two, model.generate(ids[:1], attention_mask=mask[:1], do_sample=False, max_new_tokens=4))
    # a bucket built earlier whose compiled code is gone compiles again in its next step, which
    # counts as compiling though no new bucket is built
    torch._dynamo.reset()
    again = w.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, prompt_lookup_num_tokens=2)
    assert w.last_stats.compile_time > 0 and torch.equal(again, two) and len(gr.graphs) == 9


def test_warmup_option_checks(llama):
    """The warmup spec normalized, and every bad one refused before any work, the model left plain."""
    from hf_plookup.engine.warmup import warmup_spec

    assert warmup_spec(None) is None
    assert warmup_spec({}) == {"max_batch_size": 1, "prompt_lookup_num_tokens": (0,), "max_length": None}
    assert warmup_spec({"max_batch_size": 16, "prompt_lookup_num_tokens": [8, 0, 8], "max_length": 512}) == {
        "max_batch_size": 16, "prompt_lookup_num_tokens": (0, 8), "max_length": 512}
    bad = [(True, "warmup must be a dict"), ({"batch": 1}, r"unknown key\(s\) \['batch'\]"),
           ({"prompt_lookup_num_tokens": []}, r"warmup\['prompt_lookup_num_tokens'\] must not be empty"),
           ({"max_batch_size": 0}, r"warmup\['max_batch_size'\] must be greater than 0"),
           ({"max_batch_size": [2]}, r"warmup\['max_batch_size'\] must be an int"),
           ({"prompt_lookup_num_tokens": -1}, r"warmup\['prompt_lookup_num_tokens'\] must be >= 0"),
           ({"max_length": 2.5}, r"warmup\['max_length'\] must be an int"),
           ({"max_batch_size": 300}, "more than max_num_seqs=256"),
           ({"max_length": 4096}, r"warmup\['max_length'\] is 4096 but the KV cache holds 512 tokens")]
    for spec, message in bad:
        plain = type(llama)
        with pytest.raises(ValueError, match=message):
            hf_plookup.wrap(llama, max_cache_tokens=512, warmup=spec)
        assert type(llama) is plain and not isinstance(llama, hf_plookup.PlookupModel)
    # steps that run eagerly have nothing to build
    w = wrap_copy(llama, max_cache_tokens=512, warmup={"prompt_lookup_num_tokens": 4})
    assert w._engine.warmed["buckets"] == 0 and w._engine._graphs is None
