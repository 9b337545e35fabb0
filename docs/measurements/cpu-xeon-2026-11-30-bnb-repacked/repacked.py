"""A bitsandbytes nf4 SmolLM2 that ran HF's `generate` before `wrap`, as a user who compares first
does: on a CPU with AVX-512 BF16 that first forward has bitsandbytes repack every `Linear4bit` into
its own layout (bf16 absmax, its own bf16 kernel). Then `wrap` on the same object and hf_plookup's
k=4 on the same news articles, one at a time, each call timed, the model's dtype fp32. Reports what
the linears run on, the note, the tokens against HF's and the speed against HF's greedy.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-bnb-repacked/repacked.py --num-docs 8
"""

import argparse
import time

import torch

import hf_plookup
from eval.lib.models import load_model
from eval.lib.prompts import dataset_prompts
from hf_plookup.invariant import bnb4bit

p = argparse.ArgumentParser()
p.add_argument("--num-docs", type=int, default=8)
p.add_argument("--new", type=int, default=64)
args = p.parse_args()
torch.set_num_threads(2)
model, tok = load_model("smollm2-135m", torch.float32, "cpu", quantization="bnb-nf4")
prompts = dataset_prompts(tok, "cnn_dailymail", args.num_docs)
modules = [m for m in model.modules() if bnb4bit.is_linear4bit(m)]


def run(fn):
    outs, seconds = [], 0.0
    for ids in prompts:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        out = fn(x, torch.ones_like(x))
        seconds += time.perf_counter() - t0
        outs.append(out[0, x.shape[1]:].tolist())
    return outs, seconds


with torch.inference_mode():
    hf, hf_s = run(lambda x, mask: model.generate(x, attention_mask=mask, max_new_tokens=args.new, do_sample=False))
repacked = sum(bnb4bit._repacked(m.weight.quant_state) for m in modules)
print(f"HF greedy: {sum(map(len, hf)) / hf_s:.1f} tok/s; {repacked} of {len(modules)} Linear4bit repacked by bitsandbytes")
t0 = time.perf_counter()
wrapped = hf_plookup.wrap(model)
print(f"wrap {time.perf_counter() - t0:.1f} s; repacked after wrap: {sum(bnb4bit._repacked(m.weight.quant_state) for m in modules)}")
ours, ours_s = run(lambda x, mask: wrapped.generate(x, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                                    prompt_lookup_num_tokens=4))
note = wrapped.last_stats.exactness_note
print(f"hf_plookup k=4: {sum(map(len, ours)) / ours_s:.1f} tok/s = {hf_s / ours_s * sum(map(len, ours)) / sum(map(len, hf)):.2f}x "
      f"HF greedy; {sum(a == b for a, b in zip(ours, hf))}/{len(hf)} = HF's tokens; C layers: "
      f"{wrapped._engine.c_layers is not None and wrapped._engine.c_layers.on}; note: {note[:100] or 'none'}")
