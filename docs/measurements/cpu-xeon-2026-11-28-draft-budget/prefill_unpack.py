"""Prefill cost of the packed weights: a 1,000-token prompt, max_new_tokens=1, current code against
dense() served from a resident unpacked copy (what two copies cost nothing to read)."""
import sys, time, torch, statistics
from eval.lib.models import random_model
import hf_plookup
from hf_plookup.cpu import packed_weight, invariant_linears
shape, dtype = sys.argv[1], {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[2]]
from hf_plookup.embedded import load_embedded
model = random_model(shape, dtype, "cpu") if shape != "smollm2" else load_embedded("smollm2-135m")[0].to(dtype)
w = hf_plookup.wrap(model, max_cache_tokens=4096)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 30000, (1, 1000), generator=g) for _ in range(3)]
def run():
    ts = []
    for p in prompts:
        t0 = time.perf_counter(); w.generate(p, max_new_tokens=1, do_sample=False); ts.append(time.perf_counter() - t0)
    return ts
orig = packed_weight.dense
copies = {}
def resident(weight):
    if not isinstance(weight, packed_weight.PackedWeight):
        return weight
    c = copies.get(id(weight))
    if c is None:
        c = copies[id(weight)] = weight.unpacked()
    return c
run()  # warm
res = {"unpack": [], "resident": []}
for r in range(3):
    for name in ("unpack", "resident"):
        invariant_linears.dense = orig if name == "unpack" else resident
        res[name] += run()
for k, v in res.items():
    print(k, "median %.3f s" % statistics.median(v), "min %.3f" % min(v))
