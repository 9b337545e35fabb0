"""The C linears over 4-bit weights in both layouts, W_Q4 (codes by output column) and W_Q4K (codes
along k, a table lookup per 16 codes), at SIMD level 1 (AVX2) and level 2 (AVX-512), in millions of
weights a second times rows (multiply-adds): Qwen3-1.7B's `up_proj` shape ([6144, 2048]), groups of
128, each of four W_Q4 forms (`cpu.kernels.Q4_FORMS`), random codes packed by `pack_q4` with the kind
given, calls in fp32 and bf16 of 1, 5, 64 and 512 rows. At 1 row, 100 weights (630 MB, past the
last-level cache) read from memory; at more rows, 4 (arithmetic bounds them). The C entry point on
the packed bytes, every variant taking turns in this process (eval/lib/timing.interleaved); each
figure the fastest of the passes, 2 threads.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-q4-along-k/kernel_rates.py > kernel_rates.txt
"""

import torch

from eval.lib.timing import interleaved
from hf_plookup.cpu import kernels

torch.set_num_threads(2)
N, K, G = 6144, 2048, 128
FORMS = ("lut", "fma", "mul_sub", "sub_mul")
top = kernels.simd_level()
print(f"SIMD level {top}")
g = torch.Generator().manual_seed(0)
scales = torch.rand(N, K // G, generator=g) * 0.02 + 0.001
shifts = torch.randn(N, K // G, generator=g).round()
lut = torch.randn(16, generator=g)
for rows in (1, 5, 64, 512):
    codes = [torch.randint(0, 16, (N, K), generator=g).to(torch.uint8) for _ in range(100 if rows == 1 else 4)]
    for dtype in (torch.float32, torch.bfloat16):
        dt, threads = kernels.dtype_code(dtype), kernels.threads()
        x, out = torch.randn(rows, K).to(dtype), torch.empty(rows, N, dtype=dtype)

        def run(weights, kind, level):
            def f():
                kernels.set_simd_level(level)
                for w in weights:
                    kernels._LIB.linear(x.data_ptr(), rows, w.data_ptr(), kind, K, 0, N, out.data_ptr(), dt, threads)
            return f

        fns = {}
        for form in FORMS:
            offset = 8.0 if form in ("fma", "sub_mul") else 0.0
            for kind, name in ((kernels.W_Q4, "W_Q4"), (kernels.W_Q4K, "W_Q4K")):
                packed = [kernels.pack_q4(c, scales, shifts, G, form, offset, dtype, lut if form == "lut" else None,
                                          kind=kind) for c in codes]
                for level in (1, 2):
                    if level <= top:
                        fns[f"{form} {name} L{level}"] = run(packed, kind, level)
        interleaved(fns, "cpu", 1)
        times = interleaved(fns, "cpu", 3)
        kernels.set_simd_level(top)
        rate = {name: len(codes) * N * K * rows / min(t) / 1e9 for name, t in times.items()}
        print(f"{str(dtype)[6:]}, {rows} row(s), G multiply-adds/s: " + ", ".join(f"{n} {r:.1f}" for n, r in rate.items()),
              flush=True)
        del fns
