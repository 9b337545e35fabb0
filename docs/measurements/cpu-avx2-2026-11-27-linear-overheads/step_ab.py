# The code of 2026-11-27: module paths since moved (hf_plookup.engine.invariant and the others it imports), kept as it ran, not updated.
"""The engine's eager invariant CPU step (SmolLM2's shape, random weights, 700 cached tokens, batch 1
or BATCH sequences) on two builds of cpu_kernels.c in one process: the installed one (A) and another (B, a .so built as
setup.py builds it). Each round runs every q on A, then on B, in turn; the report gives medians per
build and q, each build's q/1 ratio, and A/B per q (medians of the rounds' ratios).
Run from the repository root, 2 threads:
    python docs/measurements/cpu-avx2-2026-11-27-linear-overheads/step_ab.py OTHER.so bf16 [ROUNDS [BATCH]]
(run_step_ab.sh builds the run's start as B and runs it for fp32 and bf16)."""
import importlib.util
import statistics
import sys
import time

import torch

from eval.lib.cli import DTYPES
from eval.lib.models import random_model
from eval.step_bench import step_plan
from hf_plookup.attention.registry import register
from hf_plookup.engine import cpu_kernels, cpu_layers
from hf_plookup.engine.huge_pages import to_huge_pages
from hf_plookup.engine.invariant import InvariantLinears
from hf_plookup.engine.kv_cache import PagedKVCache, layer_specs
from hf_plookup.engine.runner import ModelRunner


def load_build(path):
    """The ctypes library of another build, with the signatures the engine gives the installed one."""
    spec = importlib.util.spec_from_file_location("_cpu_kernels", path)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)  # its module init sets its SIMD level
    saved, cpu_kernels._ext = cpu_kernels._ext, ext
    try:
        lib = cpu_kernels._load()
    finally:
        cpu_kernels._ext = saved
    for name in ("layer_attention", "layer_mlp", "layer_phases"):
        mine = getattr(cpu_layers._LIB, name)
        getattr(lib, name).restype, getattr(lib, name).argtypes = mine.restype, mine.argtypes
    return lib


def use(lib):
    cpu_kernels._LIB = cpu_layers._LIB = lib


def main():
    other, dtype = sys.argv[1], DTYPES[sys.argv[2]]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(2)
    register()
    libs = {"A": cpu_kernels._LIB, "B": load_build(other)}
    model = random_model("smollm2-135m", dtype, torch.device("cpu"), 0)
    if to_huge_pages(model):
        cpu_kernels.pack_linears(model)
    qs, context, block = (1, 5, 9), 700, 16
    cache = PagedKVCache(layer_specs(model), batch * ((context + 9) // block + 1) + 2, block, scratch=True)
    for k, v in zip(cache.keys, cache.values):
        k.normal_()
        v.normal_()
    run = ModelRunner(model, cache, None, "sdpa", invariant=InvariantLinears(model)).run
    plans = {q: step_plan(batch, q, context, block, model.config.vocab_size) for q in qs}
    times = {(b, q): [] for b in libs for q in qs}
    outs = {}
    for r in range(rounds + 2):  # two rounds to warm up
        for q in qs:
            for b, lib in libs.items():
                use(lib)
                t0 = time.perf_counter()
                out = run(plans[q])
                if r >= 2:
                    times[b, q].append(time.perf_counter() - t0)
                outs[b, q] = out
    use(libs["A"])
    same = all(torch.equal(outs["A", q], outs["B", q]) for q in qs)
    med = lambda xs: statistics.median(xs)
    print(f"{sys.argv[2]}, batch {batch}, {rounds} rounds; the two builds' logits {'bitwise equal' if same else 'DIFFER'}")
    for q in qs:
        line = "  ".join(f"{b} {1e3 * med(times[b, q]):6.2f} ms ({med(t / t1 for t, t1 in zip(times[b, q], times[b, 1])):.2f}x q1)"
                         for b in libs)
        ab = med(a / b for a, b in zip(times["A", q], times["B", q]))
        print(f"  q {q}: {line}  A/B {ab:.3f}")


if __name__ == "__main__":
    main()
