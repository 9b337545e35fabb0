"""A 1,000-token prompt's prefill and 64 greedy tokens after a 128-token prompt, through `wrap` of
the hf_plookup tree at ROOT (this tree, or a worktree of an older commit): one JSON line.

    python prompt_costs.py ROOT MODEL DTYPE PROMPT_TOKENS ROUNDS
"""
import json
import statistics
import sys
import time

import torch

root = sys.argv[1]
sys.path.insert(0, root)
import hf_plookup  # noqa: E402
from eval.lib.models import load_model  # noqa: E402

name, dtype, n, rounds = sys.argv[2], {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[3]], int(sys.argv[4]), int(sys.argv[5])
model, _ = load_model(name, dtype, "cpu")
t0 = time.perf_counter()
hf_plookup.wrap(model, max_cache_tokens=4096)
wrap_s = time.perf_counter() - t0
g = torch.Generator().manual_seed(0)
vocab = model.config.vocab_size


def call(ids, new):
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return time.perf_counter() - t0


call(torch.randint(3, vocab, (1, 64), generator=g), 4)  # the first call (checks, probes)
prefill, decode = [], []
for _ in range(rounds):
    prefill.append(call(torch.randint(3, vocab, (1, n), generator=g), 1))
    ids = torch.randint(3, vocab, (1, 128), generator=g)
    decode.append(call(ids, 65) - call(ids, 1))
print(json.dumps({"root": root, "model": name, "dtype": sys.argv[3], "threads": torch.get_num_threads(), "wrap_s": wrap_s,
                  "prefill_s": statistics.median(prefill), "decode_64_s": statistics.median(decode)}), flush=True)
