"""One-row linears of Qwen3-1.7B's MLP shape (6144 x 2048) on the C kernels, bf16 calls, 2 threads (--threads):
how fast each weight kind computes with its weight in the core's cache, and how fast it streams the
weight from memory, to tell what bounds the int8 step.

Kinds: bf16 weights (W_FLOAT, the packed panels), int8 weight-only (W_Q8: each code widened to a
float for one FMA), and LLM.int8's integer path with no outliers (W_Q8B, threshold 0: the row
quantized to int8 codes, then AVX-512 VNNI's byte products, 64 an instruction; its arithmetic is
not W_Q8's, it stands in for any integer kernel over the same bytes). Random weights and inputs.

- "cache": one weight of 512 x 2048 (1 MB in int8), called over and over: the kernels' compute rate.
- "memory": 48 distinct 6144 x 2048 weights (604 MB in int8, 1.2 GB in bf16, past the last-level
  cache), called in turn: the stream rate.

Each figure is the best of --repeats passes, the kinds taking turns, in G weights a second (and GB/s
of weight bytes).

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-int8-stream/stream_rates.py
"""

import argparse
import time

import torch

from hf_plookup.cpu import kernels as ck

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=48)
p.add_argument("--repeats", type=int, default=15)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
K, dt = 2048, torch.bfloat16
gen = torch.Generator().manual_seed(0)


def weights(n: int, count: int) -> dict:
    codes = [torch.randint(-127, 128, (n, K), generator=gen, dtype=torch.int8) for _ in range(count)]
    scales = torch.rand(n, generator=gen) * 0.01
    return {
        "bf16 (W_FLOAT)": (ck.W_FLOAT, 2, [ck.pack(torch.randn(n, K, generator=gen).to(dt)) for _ in range(count)]),
        "int8 (W_Q8)": (ck.W_Q8, 1, [ck.pack_q8(c, scales, dt) for c in codes]),
        "int8 by VNNI (W_Q8B)": (ck.W_Q8B, 1, [ck.pack_q8b(c, scales, 0.0) for c in codes]),
    }


def one_pass(kind: int, packed: list, n: int, calls: int, x: torch.Tensor) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        for w in packed:
            ck._linear_call(x, w, kind, None, n)
    return time.perf_counter() - t


print(f"simd level {ck.simd_level()}, threads {ck.threads()}")
x = torch.randn(1, K, generator=gen).to(dt)
for where, n, count, calls in [("cache", 512, 1, 50), ("memory", 6144, args.layers, 1)]:
    kinds = weights(n, count)
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(args.repeats):  # (the kinds take turns, so that a slow spell of this shared VM hits each)
        for name, (kind, size, packed) in kinds.items():
            best[name] = min(best[name], one_pass(kind, packed, n, calls, x))
    for name, (kind, size, packed) in kinds.items():
        g = n * K * calls * len(packed) / best[name] / 1e9
        print(f"{where:6s} {name:22s} {g:5.1f} G weights/s  {g * size:5.1f} GB/s")
