"""A/B in one process: the project's linears (kernels at a SIMD level) against the packed prototype,
SmolLM2-135M's 211 linears of one step (30 layers + LM head, random weights on 2 MB pages), 2 threads.
usage: ab2.py LIB REPS DTYPES(1=bf16,0=fp32) LEVELS(current kernels' SIMD levels to run)"""
import ctypes, sys, statistics, time, json
i64 = ctypes.c_int64
lib = ctypes.CDLL(sys.argv[1]); lib.proto_init.argtypes = [i64]; top = lib.proto_init(9)
for f in ("proto_step", "proto_level"): getattr(lib, f).restype = i64
lib.proto_step.argtypes = [i64]*4; lib.proto_setup.argtypes = [i64]; lib.proto_level.argtypes = [i64]
lib.proto_check.restype = ctypes.c_double; lib.proto_check.argtypes = [i64, i64]
reps = int(sys.argv[2]); levels = [int(l) for l in sys.argv[4].split(",") if int(l) <= top]
out = {"top_level": top, "runs": {}}
for bf in [int(d) for d in sys.argv[3].split(",")]:
    lib.proto_setup(bf)
    var = 2 if bf else 0  # packed: bf16 pairs, fp32 panels (one pass)
    lib.proto_level(1)
    errs = [lib.proto_check(M, var) for M in (1, 5, 9)]
    res = {}
    for r in range(reps):
        for M in (1, 5, 9):
            for lv in levels + ["packed"]:
                time.sleep(0.003)
                lib.proto_level(1 if lv == "packed" else lv)
                res.setdefault("%s M=%d %s" % ("bf16" if bf else "fp32", M, "packed" if lv == "packed" else "current level %d" % lv), []).append(
                    lib.proto_step(lv == "packed", M, 2, var) / 1e6)
    for k, v in res.items():
        print(k, "median %.1f min %.1f ms" % (statistics.median(v), min(v)))
    out["runs"]["bf16" if bf else "fp32"] = {"max_rel_err_vs_float64": errs, "ms": res}
print(json.dumps(out))
