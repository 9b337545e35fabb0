"""Compiled steps across context buckets: one greedy call of a tiny Llama (compile=True, 20-token
prompt, 60 new tokens, so its steps meet the context buckets of 32, 64 and 128 keys), the buckets
it built, the graphs dynamo compiled (torch's own counter) and the call's compile seconds; then
whether its tokens are HF's. Pass `regional` to compile one decoder layer for all layers (what
CUDA-graph steps compile) instead of the whole forward.

    PYTHONPATH=. python docs/measurements/cpu-avx2-2026-11-29-compile-once/context_buckets.py [regional]
"""
import sys

import torch
from torch._dynamo.utils import counters

from tests.conftest import tiny_model, wrap_copy
from tests.test_compile import _regional

model = tiny_model("llama")
w = wrap_copy(model, max_cache_tokens=2048, compile=True)
if len(sys.argv) > 1:
    _regional(w)
ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(1))
counters.clear()
out = w.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None, pad_token_id=0)
gr = w._engine._graphs
print("buckets (q, B, Lk, tree):", sorted(gr.graphs), "graphs compiled:", counters["stats"]["unique_graphs"],
      f"compile seconds: {w.last_stats.compile_time:.1f}")
print("= HF greedy:", torch.equal(out, model.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None,
                                                      pad_token_id=0)))
