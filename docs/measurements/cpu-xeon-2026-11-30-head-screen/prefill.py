"""One 944-token news prompt's prefill: HF's forward and HF's generate of one token against hf_plookup's
generate of one token (the prefix pool off, so every call computes the prompt), best of 3 calls after
one, SmolLM2, fp32 or bf16 (the first argument). Not a change's measurement: where a call's time goes.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-head-screen/prefill.py bfloat16
"""

import copy
import sys
import time

import torch

import hf_plookup
from eval.lib.models import load_model
from eval.lib.prompts import dataset_prompts

torch.set_num_threads(2)
model, tok = load_model("smollm2-135m", getattr(torch, sys.argv[1]), "cpu")
ids = torch.tensor([dataset_prompts(tok, "cnn_dailymail", 3)[1]])


def best(f, n=3):
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


with torch.inference_mode():
    hf = best(lambda: model(ids, logits_to_keep=1))
    hf_gen = best(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False))
wrapped = hf_plookup.wrap(copy.copy(model), prefix_cache=False)
ours = best(lambda: wrapped.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False))
print(f"{sys.argv[1]}, {ids.shape[1]} tokens: HF forward {hf:.3f} s, HF generate(1) {hf_gen:.3f} s, "
      f"hf_plookup generate(1) {ours:.3f} s ({ours / hf_gen:.2f}x HF's)")
