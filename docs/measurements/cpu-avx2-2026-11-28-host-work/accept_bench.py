"""Median seconds of Batch.postprocess (accepting a step's tokens) per decode step, fastest of 3
calls, on the static-buffer step path with the test suite's tiny Llama; run once per version
to compare (the label is the first argument):

    python docs/measurements/cpu-avx2-2026-11-28-host-work/accept_bench.py new
"""
import sys, time, functools, statistics
import torch
sys.path.insert(0, ".")
from tests.conftest import tiny_model, wrap_copy, left_padded
from hf_plookup.cuda.graphs import GraphRunner
import hf_plookup.engine.batch as B_
torch.set_num_threads(1)
ts = []
f = B_.Batch.postprocess
def g(*a, **k):
    t = time.perf_counter()
    try:
        return f(*a, **k)
    finally:
        ts.append(time.perf_counter() - t)
B_.Batch.postprocess = g
out = []
for B in (1, 16, 64):
    for K in (0, 4):
        model = tiny_model("llama")
        w = wrap_copy(model, max_cache_tokens=1 << 16, block_size=16, pad_drafts=True)
        eng = w._engine
        eng._graphs = GraphRunner(w, eng.cache(), "sdpa", eng.options.max_num_seqs, capture=False)
        eng.width_policy = True
        ids, mask = left_padded(B, seed=3, repeats=20)
        kw = dict(attention_mask=mask, max_new_tokens=128, prompt_lookup_num_tokens=K or None)
        w.generate(ids, **kw)
        meds = []
        for _ in range(3):
            ts.clear(); w.generate(ids, **kw); meds.append(statistics.median(ts))
        out.append(f"B={B} k={K}: {min(meds)*1e3:.3f}")
print(sys.argv[1], " | ".join(out))
