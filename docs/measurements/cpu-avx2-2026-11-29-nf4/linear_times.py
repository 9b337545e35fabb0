"""One [6144, 2048] C linear at 1 row: bitsandbytes nf4 (blocks of 64 and 128), quanto int4 and a plain
weight, bf16 and fp32 calls, best and median of 7 rounds of 20 calls, interleaved. Run once with the
nf4 tiles of 4 panels and once with tiles of 2 panels (the tile tables in csrc/arch/x86/linear_avx2.c).

    python docs/measurements/cpu-avx2-2026-11-29-nf4/linear_times.py [threads]
"""
import torch, time, bitsandbytes as bnb
from hf_plookup.cpu import kernels as ck
from hf_plookup.invariant.linears import linear_weight
import optimum.quanto as quanto
import sys
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
k, n = 2048, 6144
ws = {}
for dtype in (torch.bfloat16, torch.float32):
    src = torch.nn.Linear(k, n, bias=False).to(dtype)
    for bs in (64, 128):
        lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, quant_type="nf4")
        lin.load_state_dict(src.state_dict()); lin.weight.blocksize = bs; lin = lin.to("cpu")
        ws[(dtype, f"bnb{bs}")] = (lin, linear_weight(lin))
    seq = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False).to(dtype)); quanto.quantize(seq, weights=quanto.qint4); quanto.freeze(seq)
    ws[(dtype, "quanto")] = (seq, seq[0].weight)
    ws[(dtype, "plain")] = (src, src.weight.detach())
res = {key: [] for key in ws}
for rep in range(7):
    for key, (_, w) in ws.items():
        x = torch.randn(1, k).to(key[0])
        ck.linear(x, w, None)
        t = time.perf_counter()
        for _ in range(20): ck.linear(x, w, None)
        res[key].append((time.perf_counter() - t) / 20 * 1e3)
for key, v in res.items(): print(key, "min %.3f ms  median %.3f" % (min(v), sorted(v)[3]))
