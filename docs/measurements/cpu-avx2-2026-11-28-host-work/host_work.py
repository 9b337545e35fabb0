# The code of 2026-11-28, kept as it ran; module paths have since moved. The tool now: eval/host_work.py
"""Host work per decode step on the static-buffer step path (what CUDA graphs replay), on CPU
with a tiny Llama of the test suite: a call's time outside its forwards, and its parts (per
step: the mean, and the median of accepting and drafting), the fastest of 3 calls.

    python docs/measurements/cpu-avx2-2026-11-28-host-work/host_work.py 1,16,64 0,4   # batch sizes, k
"""
import functools
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import hf_plookup.cuda.graphs as G_  # noqa: E402
import hf_plookup.engine.batch as B_  # noqa: E402
import hf_plookup.engine.runner as R_  # noqa: E402
import hf_plookup.engine.scheduler as S_  # noqa: E402
from hf_plookup.cuda.graphs import GraphRunner  # noqa: E402
from tests.conftest import left_padded, tiny_model, wrap_copy  # noqa: E402

torch.set_num_threads(1)
times = {}  # label -> seconds of each call of it in the timed call


def timed(owner, name, label):
    """Wrap owner.name so that each call's seconds go to times[label]."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - t)
    setattr(owner, name, g)


timed(GraphRunner, "_forward", "forward")
timed(B_.Batch, "postprocess", "postprocess")
timed(B_.Batch, "propose", "propose")
timed(S_.Scheduler, "schedule", "schedule(+propose)")
timed(R_.ModelRunner, "layout", "layout")
timed(G_, "pad_layout", "pad_layout")
timed(R_.ModelRunner, "run", "runner.run")

for B in [int(x) for x in sys.argv[1].split(",")]:
    for K in [int(x) for x in sys.argv[2].split(",")]:
        model = tiny_model("llama")
        w = wrap_copy(model, max_cache_tokens=1 << 16, block_size=16, pad_drafts=True)
        eng = w._engine
        eng._graphs = GraphRunner(w, eng.cache(), "sdpa", eng.options.max_num_seqs, capture=False)
        eng.width_policy = True
        ids, mask = left_padded(B, seed=3, repeats=20)
        kw = dict(attention_mask=mask, max_new_tokens=128, prompt_lookup_num_tokens=K or None)
        w.generate(ids, **kw)
        best = None
        for _ in range(3):
            times.clear()
            t = time.perf_counter()
            w.generate(ids, **kw)
            dt = time.perf_counter() - t
            if best is None or dt < best[0]:
                best = (dt, {k: list(v) for k, v in times.items()})
        dt, a = best
        n = w.last_stats.decode_steps
        forward = sum(a["forward"])
        means = ", ".join(f"{k} {sum(v) / n * 1e3:.2f}" for k, v in a.items() if k != "forward")
        medians = ", ".join(f"{k} {statistics.median(a[k]) * 1e3:.3f}" for k in ("postprocess", "propose") if k in a)
        print(f"B={B:2d} k={K}: {n} steps, per step: total {dt / n * 1e3:.2f} ms, forward {forward / n * 1e3:.2f}, "
              f"outside forward {(dt - forward) / n * 1e3:.2f} | {means} | medians: {medians}")
