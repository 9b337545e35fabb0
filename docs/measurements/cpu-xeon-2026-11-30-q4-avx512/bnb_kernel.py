"""A Qwen3-1.7B-shape model (random weights, bf16) in bitsandbytes nf4 on a CPU with AVX-512 BF16:
the greedy decode step of `wrap` (the flat layout held, the C layers) against `wrap(model,
invariant=False)`, where bitsandbytes repacks its modules at the first forward and its own bf16
kernel runs under the engine; batch 1, 128-token prompts, 32 new
tokens, the median decode step (`eval/lib/timing.StepTimer`) of --repeats calls over distinct
prompts, the two taking turns in this process.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-q4-avx512/bnb_kernel.py --repeats 3
"""

import argparse
import statistics

import torch

import hf_plookup
from eval.lib.models import load_model
from eval.lib.timing import StepTimer

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3-1.7b")
p.add_argument("--new", type=int, default=32)
p.add_argument("--repeats", type=int, default=3)
args = p.parse_args()
torch.set_num_threads(2)

held, _ = load_model(f"random:{args.shape}", torch.bfloat16, "cpu", quantization="bnb-nf4")
held = hf_plookup.wrap(held)
theirs, _ = load_model(f"random:{args.shape}", torch.bfloat16, "cpu", quantization="bnb-nf4")
theirs = hf_plookup.wrap(theirs, invariant=False)
repacked = all(getattr(m.weight.quant_state, "packing_format_for_cpu", False)
               for m in theirs.modules() if type(m).__name__ == "Linear4bit")
variants = {"wrap (flat layout, C layers)": held.generate, "wrap(invariant=False) (bitsandbytes' kernel)": theirs.generate}
gen = torch.Generator().manual_seed(0)
vocab = held.config.vocab_size


def call(fn, ids, steps):
    with torch.no_grad(), StepTimer("cpu") as timer:
        fn(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    steps.extend(t for _, t in timer.decode_steps(1))


for fn in variants.values():  # first calls apart
    call(fn, torch.randint(3, vocab, (1, 128), generator=gen), [])
steps = {name: [] for name in variants}
for r in range(args.repeats):
    ids = torch.randint(3, vocab, (1, 128 + r), generator=gen)
    for name, fn in variants.items():
        call(fn, ids, steps[name])
print(f"bitsandbytes repacked its modules under wrap(invariant=False): {repacked}")
for name, s in steps.items():
    print(f"{name}: decode step {1e3 * statistics.median(s):.1f} ms ({len(s)} steps)")
