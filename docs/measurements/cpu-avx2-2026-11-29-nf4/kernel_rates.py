"""The C linear's rate in weights per second over bitsandbytes' nf4 weights (the W_Q4 "lut" form),
beside plain weights and optimum-quanto's int4 ones, in bf16 calls (quanto's tinygemm form, nf4
rounded to bf16) and fp32 calls (quanto's plain form, nf4 unrounded), at 1 and 5 rows, in two
regimes: a [128, 2048] weight that stays in L2, on one thread (what the tile computes), and a
[12288, 2048] one streamed from memory on both threads. The best of 7 rounds each, the variants
interleaved.

    PYTHONPATH=. python docs/measurements/cpu-avx2-2026-11-29-nf4/kernel_rates.py
"""
import warnings

import bitsandbytes as bnb
import torch
from optimum.quanto import freeze, qint4, quantize

from eval.lib.timing import interleaved
from hf_plookup.cpu import kernels as ck
from hf_plookup.invariant.linears import linear_weight

warnings.filterwarnings("ignore")
K = 2048


def weight(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    lin = torch.nn.Linear(K, n, bias=False).to(dtype)
    if kind == "int4":
        seq = torch.nn.Sequential(lin)
        quantize(seq, weights=qint4)
        freeze(seq)
        return seq[0].weight
    if kind == "nf4":
        q = bnb.nn.Linear4bit(K, n, bias=False, compute_dtype=dtype, quant_type="nf4")
        q.load_state_dict(lin.state_dict())
        return linear_weight(q.to("cpu"))
    return lin.weight.detach()


for dtype, label in ((torch.bfloat16, "bf16 calls"), (torch.float32, "fp32 calls")):
    for regime, n, threads, reps in (("L2, 1 thread", 128, 1, 2000), ("memory, 2 threads", 12288, 2, 20)):
        calls = {}
        for name in ("plain", "int4", "nf4"):
            w = weight(name, n, dtype)
            packed, kind = ck.packed(w), ck.weight_kind(w)
            for m in (1, 5):
                x, out = torch.randn(m, K, dtype=dtype), torch.empty(m, n, dtype=dtype)
                calls[name, m] = (lambda x=x, out=out, m=m, packed=packed, kind=kind: ck._LIB.linear(
                    x.data_ptr(), m, packed.data_ptr(), kind, K, None, n, out.data_ptr(), dtype == torch.bfloat16,
                    threads))
        for f in calls.values():
            f()  # (packed, warm)
        rounds = interleaved({key: (lambda f=f: [f() for _ in range(reps)]) for key, f in calls.items()}, "cpu", 7)
        best = {key: min(times) / reps for key, times in rounds.items()}
        print(f"{label}, {regime}: " + ", ".join(f"{name} {m} row{'s' * (m > 1)} {K * n / t / 1e9:.1f}"
                                                 for (name, m), t in best.items()))
