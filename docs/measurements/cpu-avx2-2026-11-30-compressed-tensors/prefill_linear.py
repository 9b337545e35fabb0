"""One long prompt chunk's linear on a held compressed-tensors weight (W4A16, groups of 64, fp32), at
SmolLM2's two MLP shapes: its `F.linear` (the whole weight dequantized in torch, then torch's GEMM),
the dequantization alone, torch's GEMM of the dequantized weight alone, and the C kernel (which
dequantizes a block at a time). Each the fastest of 5 rounds in which all four run in turn, after
one untimed round; 2 threads.

    PYTHONPATH=. python docs/measurements/cpu-avx2-2026-11-30-compressed-tensors/prefill_linear.py
"""

import torch
import torch.nn.functional as F

from eval.lib.quantization import compress
from eval.lib.timing import interleaved
from hf_plookup.cpu import kernels
from hf_plookup.invariant import compressed_tensors as ct

torch.set_num_threads(2)
ROWS = 512

for n, k in [(1536, 576), (576, 1536)]:
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    compress(model, "W4A16", group=64)
    ct.hold_compressed(model)
    w = model[0].weight
    x = torch.randn(ROWS, k, generator=torch.Generator().manual_seed(0))
    dense = w.dequantized()
    fns = {"F.linear of the view": lambda: F.linear(x, w), "its dequantization": w.dequantized,
           "the GEMM alone": lambda: F.linear(x, dense), "the C kernel": lambda: kernels.linear(x, w, None)}
    interleaved(fns, "cpu", 1)
    times = interleaved(fns, "cpu", 5)
    print(f"[{n}, {k}] x {ROWS} rows: " + ", ".join(f"{name} {min(t) * 1e3:.1f} ms" for name, t in times.items()))
