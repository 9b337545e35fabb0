"""Why the 4-bit step is not faster than the int8 one on this machine: the C linear's rate in weights
per second, bf16 weights against quanto's int8 and int4 ones (bf16 calls, the tinygemm form for int4),
at 1 and 5 rows, in two regimes: a [128, 2048] weight that stays in L2, on one thread (what the tile
computes, no memory traffic), and a [12288, 2048] one streamed from memory on both threads. The best
of 7 rounds each, the variants interleaved.

    python docs/measurements/cpu-avx2-2026-11-29-int4/kernel_rates.py
"""
import time
import warnings

import torch
from optimum.quanto import freeze, qint4, qint8, quantize

from hf_plookup.cpu import kernels as ck

warnings.filterwarnings("ignore")
K = 2048
for regime, n, threads, reps in (("L2, 1 thread", 128, 1, 2000), ("memory, 2 threads", 12288, 2, 20)):
    calls = {}
    for name, q in (("bf16", None), ("int8", qint8), ("int4", qint4)):
        lin = torch.nn.Sequential(torch.nn.Linear(K, n, bias=False)).to(torch.bfloat16)
        if q is not None:
            quantize(lin, weights=q)
            freeze(lin)
        w = lin[0].weight
        packed, kind = ck.packed(w), ck.weight_kind(w)
        for m in (1, 5):
            x, out = torch.randn(m, K, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
            calls[name, m] = (lambda x=x, out=out, m=m, packed=packed, kind=kind: ck._LIB.linear(
                x.data_ptr(), m, packed.data_ptr(), kind, K, None, n, out.data_ptr(), 1, threads))
    best = {key: float("inf") for key in calls}
    for _ in range(7):
        for key, f in calls.items():
            f()
            t = time.perf_counter()
            for _ in range(reps):
                f()
            best[key] = min(best[key], (time.perf_counter() - t) / reps)
    print(regime + ": " + ", ".join(f"{name} {m} row{'s' * (m > 1)} {K * n / t / 1e9:.1f}" for (name, m), t in best.items())
          + " G weights/s")
