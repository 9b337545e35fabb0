"""The C linears' rate at one row, in weights a second read from memory: 40 held compressed-tensors
weights of SmolLM2's `up_proj` shape (W4A16, groups of 64, the "sub_mul" form) against 40 plain
weights of the same shape (packed), each set larger than the last-level cache, in fp32 and bf16:
the C entry point itself on the packed bytes (no Python per call but the ctypes call). Each figure
the fastest of 30 passes over the set, 2 threads.

    PYTHONPATH=. python docs/measurements/cpu-avx2-2026-11-30-compressed-tensors/kernel_rates.py
"""

import torch

from eval.lib.quantization import compress
from eval.lib.timing import interleaved
from hf_plookup.cpu import kernels
from hf_plookup.invariant import compressed_tensors as ct

torch.set_num_threads(2)
N, K, LAYERS = 1536, 576, 40

for dtype in (torch.float32, torch.bfloat16):
    held = []
    for i in range(LAYERS):
        model = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).to(dtype)
        compress(model, "W4A16", group=64)
        ct.hold_compressed(model)
        held.append(model[0].weight)
    plain = [torch.randn(N, K).to(dtype) for _ in range(LAYERS)]
    x, out = torch.randn(1, K).to(dtype), torch.empty(1, N, dtype=dtype)

    def run(weights):
        args = [(kernels.packed(w).data_ptr(), kernels.weight_kind(w)) for w in weights]
        dt, threads = kernels.dtype_code(dtype), kernels.threads()
        return lambda: [kernels._LIB.linear(x.data_ptr(), 1, p, kind, K, 0, N, out.data_ptr(), dt, threads)
                        for p, kind in args]

    fns = {"W4A16": run(held), "plain": run(plain)}
    interleaved(fns, "cpu", 1)
    times = interleaved(fns, "cpu", 30)
    print(f"{str(dtype)[6:]}: " + ", ".join(f"{name} {LAYERS * N * K / min(t) / 1e9:.1f} G weights/s"
                                            for name, t in times.items()))
