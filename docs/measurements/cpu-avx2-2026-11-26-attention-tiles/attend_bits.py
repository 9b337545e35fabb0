"""attend of this build (the installed hf_plookup) against another build of cpu_kernels.c (argv[1], a .so),
bitwise, on random chains and trees: fp32 and bf16, D 2-128, values narrower than keys, windows,
soft-capping, 1-5 sequences, 1-3 threads. argv[2]: seed, argv[3]: cases; LEVEL in the environment
sets both builds' SIMD level. run_attend_ab.sh runs it against the run's start."""
import ctypes, os, sys, numpy as np, torch
from hf_plookup.engine import cpu_kernels as ck
old = ctypes.PyDLL(sys.argv[1])
old.PyInit__cpu_kernels.restype = ctypes.py_object
old.PyInit__cpu_kernels()
old.attend.restype = ctypes.c_int64
old.attend.argtypes = ck._LIB.attend.argtypes
old.set_simd_level.argtypes = [ctypes.c_int64]
def run(lib, q, kc, vc, slots, arrs, scale, softcap, threads):
    out = q.new_empty(q.shape[0], q.shape[1], vc.shape[-1])
    a = [np.ascontiguousarray(x, dtype=np.int64) for x in arrs]
    r = lib.attend(q.data_ptr(), q.shape[0], q.shape[1], q.shape[2], vc.shape[-1], kc.data_ptr(), vc.data_ptr(), kc.shape[-2],
                   slots.ctypes.data, slots.shape[-1], *(x.ctypes.data for x in a), scale, softcap, out.data_ptr(),
                   int(q.dtype == torch.bfloat16), threads)
    assert r == 0
    return out
if os.environ.get("LEVEL"):
    ck.set_simd_level(int(os.environ["LEVEL"])); old.set_simd_level(int(os.environ["LEVEL"]))
rng = np.random.default_rng(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
n_cases, bad = 0, 0
for case in range(int(sys.argv[3]) if len(sys.argv) > 3 else 300):
    dt = [torch.float32, torch.bfloat16][case % 2]
    D = int(rng.choice([64, 40, 13, 2, 128, 24]))
    Dv = D if rng.random() < 0.7 else int(rng.choice([24, 40, 7]))
    hkv = int(rng.choice([1, 2, 3, 4])); G = int(rng.choice([1, 2, 3, 4, 6]))
    H = hkv * G; B = int(rng.integers(1, 6)); block = int(rng.choice([4, 16]))
    ctx = int(rng.integers(1, 300)); window = None if rng.random() < 0.6 else int(rng.integers(3, 60))
    tree = rng.random() < 0.3; softcap = 0.0 if rng.random() < 0.7 else 5.0
    pages = B * (-(-(ctx + 20) // block)) + 1
    kc = torch.randn(pages, block, hkv, D, dtype=torch.float64).to(dt)
    vc = torch.randn(pages, block, hkv, Dv, dtype=torch.float64).to(dt)
    perm = 1 + rng.permutation(pages - 1)[: B * (-(-(ctx + 20) // block))].reshape(B, -1)
    pos = np.arange(perm.shape[1] * block)
    slots = np.ascontiguousarray(perm[:, pos // block] * block + pos % block)
    seq, lo, hi, xoff, extra = [], [], [], [0], []
    for b in range(B):
        start = int(rng.integers(0, ctx + 1)); n = int(rng.integers(1, 20))
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, n)] if tree else list(range(-1, n - 1))
        for j in range(n):
            anc, a = [], j
            while a >= 0:
                anc.append(a); a = parents[a]
            anc = sorted(anc); p_ = start + len(anc) - 1
            if tree:
                rlo, rhi, ext = 0, start, [start + x for x in anc]
            else:
                rlo, rhi, ext = 0, start + j + 1, []
            if window:
                rlo = max(rlo, p_ - window + 1); rhi = max(rhi, rlo)
                ext = [c for c, x in zip(ext, anc) if start + sum(1 for y in anc if y <= x) - 1 > p_ - window]
            if rhi - rlo + len(ext) == 0:
                ext = [start]
            seq.append(b); lo.append(rlo); hi.append(rhi); extra.extend(ext); xoff.append(xoff[-1] + len(ext))
    arrs = [seq, lo, hi, xoff, extra]
    q = torch.randn(len(seq), H, D, dtype=torch.float64).to(dt)
    threads = int(rng.integers(1, 4))
    a = run(ck._LIB, q, kc, vc, slots, arrs, 0.17, softcap, threads)
    b_ = run(old, q, kc, vc, slots, arrs, 0.17, softcap, threads)
    n_cases += 1
    if not torch.equal(a, b_):
        bad += 1
        print("DIFF", dict(dt=dt, D=D, Dv=Dv, hkv=hkv, G=G, B=B, ctx=ctx, window=window, tree=tree, softcap=softcap, threads=threads),
              float((a.double() - b_.double()).abs().max()))
print(f"{n_cases} cases, {bad} differ; simd level {ck.simd_level()}")
