"""The C linears' rate on W_Q8G weights (8-bit codes, dequantized first: compressed-tensors' W8A16)
at SIMD level 1 (AVX2 tiles) and level 2 (AVX-512 tiles, two panels a vector), against W_Q8 (int8
values, one scale a column applied to the sum: torchao's and quanto's int8) and plain weights, in
weights a second read from memory: 24 weights of Qwen3-1.7B's `up_proj` shape ([6144, 2048]) of
each kind (W_Q8G in groups of 64, "sub_mul", offset 128, packed from random codes by `pack_q4`),
each set larger than the last-level cache, calls in fp32 and bf16 of 1 and 5 rows, all taking turns
in this process. The C entry point itself on the packed bytes; each figure the fastest of 15 passes
over the set, 2 threads.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-ct-w8a16/kernel_rates.py
"""

import torch

from eval.lib.timing import interleaved
from hf_plookup.cpu import kernels

torch.set_num_threads(2)
N, K, G, LAYERS = 6144, 2048, 64, 24
g = torch.Generator().manual_seed(0)
codes = [torch.randint(0, 256, (N, K), generator=g).to(torch.uint8) for _ in range(LAYERS)]
scales = torch.rand(N, K // G, generator=g) * 0.02 + 0.001
zeros = torch.zeros(N, K // G)
top = kernels.simd_level()
print(f"SIMD level {top}")

for dtype in (torch.float32, torch.bfloat16):
    dt, threads = kernels.dtype_code(dtype), kernels.threads()
    plain = [kernels.packed(torch.randn(N, K).to(dtype)) for _ in range(LAYERS)]
    q8g = [kernels.pack_q4(c, scales, zeros, G, "sub_mul", 128.0, dtype, bits=8) for c in codes]
    int8 = [kernels.pack_q8((c.to(torch.int16) - 128).to(torch.int8), scales[:, 0], dtype) for c in codes]
    for rows in (1, 5):
        x, out = torch.randn(rows, K).to(dtype), torch.empty(rows, N, dtype=dtype)

        def run(weights, kind, level):
            def f():
                kernels.set_simd_level(level)
                for w in weights:
                    kernels._LIB.linear(x.data_ptr(), rows, w.data_ptr(), kind, K, 0, N, out.data_ptr(), dt, threads)
            return f

        fns = {"plain": run(plain, kernels.W_FLOAT, top)}
        for level in (1, 2):
            if level <= top:
                fns[f"W_Q8G L{level}"] = run(q8g, kernels.W_Q8G, level)
                fns[f"W_Q8 L{level}"] = run(int8, kernels.W_Q8, level)
        interleaved(fns, "cpu", 1)
        times = interleaved(fns, "cpu", 15)
        kernels.set_simd_level(top)
        rate = {name: LAYERS * N * K / min(t) / 1e9 for name, t in times.items()}
        print(f"{str(dtype)[6:]}, {rows} row(s), G weights/s: " + ", ".join(f"{n} {r:.1f}" for n, r in rate.items()))
