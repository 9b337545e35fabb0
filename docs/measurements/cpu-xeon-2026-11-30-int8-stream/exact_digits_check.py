"""The check `exact_digits.patch` was measured with (apply it and rebuild the kernels first): W_Q8E's
bf16 outputs against the float64 dot product rounded as W_Q8 rounds (fp32, bf16, times the scale,
bf16), every SIMD level against the portable C, each row as alone, and rows holding an infinity or
a NaN as W_Q8's chain gives them.

    git apply docs/measurements/cpu-xeon-2026-11-30-int8-stream/exact_digits.patch && pip install -e .
    PYTHONPATH=.:tests python docs/measurements/cpu-xeon-2026-11-30-int8-stream/exact_digits_check.py
"""

import torch

from conftest import at_every_simd_level
from hf_plookup.cpu import kernels as ck

g = torch.Generator().manual_seed(0)
n, k = 45, 203
vals = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
scales = torch.rand(n, generator=g) * 0.01
w = ck.pack_q8e(vals, scales, torch.bfloat16)
x = (torch.randn(9, k, generator=g) * torch.logspace(-3, 2, k)).to(torch.bfloat16)  # (a spread past 2^14)
got = ck._linear_call(x, w, ck.W_Q8E, None, n)
want = ((x.double() @ vals.double().T).float().to(torch.bfloat16) * scales.to(torch.bfloat16)).to(torch.bfloat16)
print("the exact dot product, rounded:", torch.equal(got, want))
outs = at_every_simd_level(lambda: [ck._linear_call(x[:m], w, ck.W_Q8E, None, n) for m in (1, 5, 9)])
print("levels as the portable C:", all(all(torch.equal(a, b) for a, b in zip(o, outs[0])) for o in outs.values()))
rows = torch.cat([ck._linear_call(x[i : i + 1], w, ck.W_Q8E, None, n) for i in range(9)])
print("rows as alone:", torch.equal(rows, got))
bad = x.clone()
bad[3, 5], bad[4, 7] = float("inf"), float("nan")
a = ck._linear_call(bad, w, ck.W_Q8E, None, n)[3:5].float().nan_to_num(1e9, 2e9, -2e9)
b = ck._linear_call(bad, ck.pack_q8(vals, scales, torch.bfloat16), ck.W_Q8, None, n)[3:5].float().nan_to_num(1e9, 2e9, -2e9)
print("non-finite rows as W_Q8's chain:", torch.equal(a, b))
