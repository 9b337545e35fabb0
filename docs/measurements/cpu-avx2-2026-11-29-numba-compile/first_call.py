"""How long a process's first calls spend compiling numba's kernels, on an empty cache: a tiny
random Llama wrapped, then its first call with chain drafts and its first with candidate trees
(numba compiles each kernel at its first use and caches it on disk; NUMBA_CACHE_DIR points the
cache at an empty folder here). Prints the two calls' seconds and every kernel compiled for more
than one type of arguments.

    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python docs/measurements/cpu-avx2-2026-11-29-numba-compile/first_call.py
"""
import sys
import time

import numba
import torch

from tests.conftest import left_padded, tiny_model, wrap_copy

torch.set_num_threads(2)
model = tiny_model("llama")
t0 = time.perf_counter()
wrapped = wrap_copy(model, max_cache_tokens=1024)
ids, mask = left_padded(2)
t1 = time.perf_counter()
wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=4)
t2 = time.perf_counter()
wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=4, prompt_lookup_tree_nodes=8)
t3 = time.perf_counter()
print(f"wrap {t1 - t0:.1f} s, first chain call {t2 - t1:.1f} s, first tree call {t3 - t2:.1f} s")
for name, mod in sorted(sys.modules.items()):
    if not name.startswith("hf_plookup"):
        continue
    for attr, f in sorted(vars(mod).items()):
        if isinstance(f, numba.core.registry.CPUDispatcher) and f.__module__ == name and len(f.signatures) > 1:
            print(f"  {name}.{attr}: {len(f.signatures)} signatures")
