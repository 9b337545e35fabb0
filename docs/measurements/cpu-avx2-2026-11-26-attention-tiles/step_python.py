# The code of 2026-11-26: module paths since moved (hf_plookup.engine.invariant and the others it imports), kept as it ran, not updated.
"""Where the Python of a 1-token step through the C layers goes (SmolLM2's shape, random bf16 weights,
700 cached tokens, 2 threads): wrappers time CpuLayers' checks (`_plan`, `takes`), its module calls
and the LM head over 200 steps. Run from the repository root: python docs/measurements/cpu-avx2-2026-11-26-attention-tiles/step_python.py [fp32]"""
import sys, time, torch
from eval.step_bench import step_plan, batch_bucket, context_bucket, register
from eval.lib.models import random_model
from hf_plookup.engine.huge_pages import to_huge_pages
from hf_plookup.engine import cpu_kernels, cpu_layers
from hf_plookup.engine.invariant import InvariantLinears
from hf_plookup.engine.runner import ModelRunner
from hf_plookup.engine.kv_cache import PagedKVCache, layer_specs
torch.set_num_threads(2)
register()
dt = torch.float32 if "fp32" in sys.argv else torch.bfloat16
model = random_model("smollm2-135m", dt, torch.device("cpu"), 0)
to_huge_pages(model); cpu_kernels.pack_linears(model)
pages = batch_bucket(1) * context_bucket(701, 16) // 16 + 2
cache = PagedKVCache(layer_specs(model), pages, 16, scratch=True)
for k, v in zip(cache.keys, cache.values): k.normal_(); v.normal_()
inv = InvariantLinears(model)
runner = ModelRunner(model, cache, None, "sdpa", invariant=inv)
plan = step_plan(1, 1, 700, 16, model.config.vocab_size)
L = inv.layers
class T:
    def __init__(s, f): s.f, s.t = f, 0.0
    def __call__(s, *a, **k):
        t0 = time.perf_counter()
        try: return s.f(*a, **k)
        finally: s.t += time.perf_counter() - t0
runner.run(plan); runner.run(plan)
assert L.on
timers = {}
for name in ("_plan", "takes", "_forward"):
    timers[name] = T(getattr(L, name)); setattr(L, name, timers[name])
for name, mod in (("embed", L.embed), ("rotary", L.rotary)):
    timers[name] = T(mod.forward); mod.forward = timers[name]
timers["build_layout"] = T(cpu_layers.build_layout); cpu_layers.build_layout = timers["build_layout"]
timers["rms_norm"] = T(cpu_kernels.rms_norm); cpu_kernels.rms_norm = timers["rms_norm"]
timers["head linear"] = T(cpu_kernels.linear); cpu_kernels.linear = timers["head linear"]
acts = T(L.acts[0].forward)
for a in set(L.acts): a.forward = acts
timers["act"] = acts
n = 200
t0 = time.perf_counter()
for _ in range(n): runner.run(plan)
step = (time.perf_counter() - t0) / n
print(f"{dt}: step {1e3 * step:.2f} ms")
for k, t in timers.items(): print(f"  {k:14s} {1e3 * t.t / n:7.3f} ms")
