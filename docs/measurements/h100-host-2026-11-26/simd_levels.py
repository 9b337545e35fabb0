"""SmolLM2-135M's decoder linears (random weights of its shapes, 30 layers, so they stream from memory)
# (A record of the `h100-host-2026-11-26` device run: it calls the C `linear` on the weights as they are, the
# layout the kernels read before the `cpu-avx2-2026-11-26-packed-linears` run; the kernels now read `cpu_kernels.packed(w)`.)
through the C `linear` kernel at each SIMD level the CPU runs (engine.cpu_kernels.set_simd_level),
1, 5 and 9 rows, 2 threads; every (level, rows) timed once per round, medians over the rounds.
Ran as `PYTHONPATH=$PWD taskset -c 0,1 python docs/measurements/h100-host-2026-11-26/simd_levels.py 20`
from the repository root, the C extension built as device_run.sh builds it, on the
H100 host (output: simd_levels.txt)."""
import statistics, sys, time
import torch
from hf_plookup.engine import cpu_kernels as ck
torch.set_num_threads(2)
L, H, I = 30, 576, 1536
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
top = ck.simd_level()
levels = [l for l in (1, 2, 3) if l <= top]
for dt in (torch.float32, torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g).to(dt) for _ in range(L) for n, k in shapes]
    fns = {}
    for q in (1, 5, 9):
        xs = {k: torch.randn(q, k, generator=g).to(dt) for _, k in shapes}
        outs = {n: torch.empty(q, n, dtype=dt) for n, _ in shapes}
        calls = [(xs[w.shape[1]].data_ptr(), q, w.data_ptr(), w.shape[1], None, w.shape[0],
                  outs[w.shape[0]].data_ptr(), dt == torch.bfloat16, 2) for w in ws]
        for lv in levels:
            fns[lv, q] = (lv, lambda c=calls, h=(xs, outs): [ck._LIB.linear(*a) for a in c])
    times = {key: [] for key in fns}
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 15):
        for key, (lv, fn) in fns.items():
            ck.set_simd_level(lv)
            t0 = time.perf_counter(); fn(); times[key].append(time.perf_counter() - t0)
    ck.set_simd_level(top)
    for lv in levels:
        base = times[lv, 1]
        print(dt, "level", lv, "  ".join(f"q{q} {1e3*statistics.median(times[lv,q]):.2f} ms ({statistics.median(a/b for a,b in zip(times[lv,q],base)):.2f}x)" for q in (1, 5, 9)), flush=True)
