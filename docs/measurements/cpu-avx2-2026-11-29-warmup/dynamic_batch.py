"""Compiled steps (inductor, CPU, whole forward) with the batch dimension static, as the engine
compiles them, or marked dynamic too (`--dynamic-batch`): graphs compiled by a warm-up over batch
buckets 1, 2 and 4, its seconds, and the seconds of calls of 1 and 4 rows (SmolLM2-135M fp32,
k=4, 48 new tokens, 3 calls each). One JSON line.

    PYTHONPATH=. python docs/measurements/cpu-avx2-2026-11-29-warmup/dynamic_batch.py [--dynamic-batch]
"""
import json
import sys
import time

import torch
from torch._dynamo.utils import counters

import hf_plookup
from eval.lib.models import load_model
from hf_plookup.steps import graphs

dynamic = "--dynamic-batch" in sys.argv
if dynamic:  # every step input with a batch dimension: dimension 0 dynamic as well
    static = graphs.GraphRunner._static

    def _static(self, padded):
        g = static(self, padded)
        m = g.meta
        for t in (g.inputs["input_ids"], g.inputs["positions"], m.slot_mapping, m.query_pos, m.kv_slots,
                  m.context_lens, m.cu_seqlens_q, m.cu_seqlens_k, m.cache_seqlens, m.block_tables, m.tree_mask):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return g

    graphs.GraphRunner._static = _static
torch.set_num_threads(2)
model, tok = load_model("smollm2-135m", torch.float32, "cpu")
texts = ["The quick brown fox jumps over the lazy dog. " * (3 + i) + f"Story number {i} continues here." for i in range(4)]
enc = tok(texts, return_tensors="pt", padding=True)
t = time.perf_counter()
w = hf_plookup.wrap(model, compile=True, max_cache_tokens=4096,
                    warmup={"max_batch_size": 4, "prompt_lookup_num_tokens": [4], "max_length": 512})
res = {"dynamic_batch": dynamic, "wrap_s": time.perf_counter() - t, "graphs": counters["stats"]["unique_graphs"]}
for b in (1, 4):
    times = []
    for _ in range(3):
        out = w.generate(enc.input_ids[:b], attention_mask=enc.attention_mask[:b], max_new_tokens=48,
                         prompt_lookup_num_tokens=4)
        s = w.last_stats
        times.append((s.wall_time, s.forwards - s.prefill_forwards, s.compile_time))
    res[f"b{b}"] = times
    res[f"b{b}_tokens"] = out[:, enc.input_ids.shape[1]:].tolist()
res["graphs_after"] = counters["stats"]["unique_graphs"]
print(json.dumps(res))
