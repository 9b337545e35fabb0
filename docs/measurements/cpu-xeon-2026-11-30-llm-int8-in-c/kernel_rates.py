"""One bitsandbytes LLM.int8 linear of a Qwen3-1.7B MLP's shape ([6144, 2048], fp32 and bf16 calls):
the C linear (weight kind W_Q8B) at SIMD levels 1 (AVX2) and 2 (AVX-512 VNNI) against bitsandbytes'
own call of the same rows, G multiply-adds per second, the median of --repeats calls each. The 1-row
call reads 100 weights in turn, so that they come from memory, not the cache.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-llm-int8-in-c/kernel_rates.py
"""

import argparse
import logging
import statistics
import time

import bitsandbytes as bnb
import torch

from hf_plookup.cpu import kernels
from hf_plookup.invariant import bnb8bit
from hf_plookup.invariant.linears import linear_weight

p = argparse.ArgumentParser()
p.add_argument("--n", type=int, default=6144)
p.add_argument("--k", type=int, default=2048)
p.add_argument("--repeats", type=int, default=7)
p.add_argument("--weights", type=int, default=100)
args = p.parse_args()
torch.set_num_threads(2)
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # (its cast warning, every call)


def held(dtype, seed):
    m = bnb.nn.Linear8bitLt(args.k, args.n, bias=False, has_fp16_weights=False, threshold=6.0)
    g = torch.Generator().manual_seed(seed)
    m.weight = bnb.nn.Int8Params(torch.randn(args.n, args.k, generator=g) * 0.02, requires_grad=False,
                                 has_fp16_weights=False)
    m = m.to("cpu").eval()
    holder = torch.nn.Sequential(m)
    holder.dtype_of = torch.nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)
    bnb8bit.hold(holder)
    return m, linear_weight(m)


def rate(fn, rows, count):
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for i in range(count):
            fn(i)
        times.append((time.perf_counter() - t0) / count)
    return rows * args.n * args.k / statistics.median(times) / 1e9


top = kernels.simd_level()
for dtype in (torch.float32, torch.bfloat16):
    count = args.weights
    layers = [held(dtype, s) for s in range(count)]
    for rows in (1, 5, 512):
        x = torch.randn(rows, args.k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        n_calls = count if rows < 512 else 4
        line = [f"{str(dtype):15s} rows {rows:3d}"]
        for level in range(1, top + 1):
            kernels.set_simd_level(level)
            line.append(f"C level {level} {rate(lambda i: kernels.linear(x, layers[i][1], None), rows, n_calls):6.1f}")
        kernels.set_simd_level(top)
        with torch.no_grad():
            line.append(f"bitsandbytes {rate(lambda i: layers[i][0](x), rows, min(n_calls, 8)):6.1f}")
        print(", ".join(line), flush=True)
    del layers
