"""Multiply-add rates on this machine's 2 cores, beside the FMA peak (fma_peak.c): torch's fp32 GEMM
from cache (eval/lib/timing.py's gemm_rate, square sizes 256-1024) and torch's own F.linear over
SmolLM2-135M's 210 layer linears (random weights streamed from memory, fp32 and bf16, 1 and 9 rows;
the median of 5 sweeps), against which the C kernels' rates in `step_bench.py --kernels` read.
    python docs/measurements/cpu-avx2-2026-11-27-compute-bound/rates.py"""

import torch
import torch.nn.functional as F

from eval.lib.timing import gemm_rate, timed

torch.set_num_threads(2)
for n in (256, 512, 1024):
    print(f"fp32 GEMM {n} x {n} x {n}: {gemm_rate('cpu', n) / 1e9:.1f} GMAC/s")
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (N, K)
g = torch.Generator().manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    ws = [[torch.randn(n, k, generator=g).to(dt) for n, k in shapes] for _ in range(30)]
    per_row = 30 * sum(n * k for n, k in shapes)
    for m in (1, 9):
        xs = {k: torch.randn(m, k, generator=g).to(dt) for _, k in shapes}

        def sweep():
            for layer in ws:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)

        sweep()
        t = timed(sweep, "cpu", 5)
        print(f"torch F.linear {str(dt)[6:]}, {m} row(s), 210 linears: {1e3 * t:.2f} ms, {m * per_row / t / 1e9:.1f} GMAC/s")
