"""Greedy decode steps of a Qwen3-1.7B-shape model (random weights) through `wrap`: bf16 against each
--quantizations name (quantized at load by transformers' own quantizers, eval/lib/quantization.py),
the quantized ones with the C kernels at SIMD level 1 (AVX2 tiles) and at level 2 (AVX-512 tiles for
W_Q4 and W_Q8), all in one process, batch 1, 128-token prompts, each against its bandwidth bound:
every byte the model stores (`eval/lib/quantization.weight_bytes`) over the read bandwidth
`eval/lib/timing.read_bandwidth` measures.

A decode step's time is the median of the decode steps (`eval/lib/timing.StepTimer`) of --repeats
calls over distinct prompts, the variants taking turns; the first call of each model (packing, the
C layers' check) is reported apart.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-q4-avx512/step_levels.py --new 32 --repeats 3 \\
        --quantizations torchao-int8 bnb-nf4 ct-w4a16
"""

import argparse
import statistics
import time

import torch

import hf_plookup
from eval.lib.models import load_model
from eval.lib.quantization import weight_bytes
from eval.lib.timing import StepTimer, read_bandwidth
from hf_plookup.cpu import kernels

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3-1.7b")
p.add_argument("--new", type=int, default=32)
p.add_argument("--prompt-len", type=int, default=128)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--quantizations", nargs="+", default=["torchao-int8", "bnb-nf4", "ct-w4a16"])
args = p.parse_args()
torch.set_num_threads(2)
top = kernels.simd_level()

models, variants = {}, {}
for name, q in [("bf16", None)] + [(q, q) for q in args.quantizations]:
    model, _ = load_model(f"random:{args.shape}", torch.bfloat16, "cpu", quantization=q)
    models[name] = (hf_plookup.wrap(model), weight_bytes(model))
    for level in ([top] if q is None else sorted({1, top})):
        variants[name if q is None else f"{name} L{level}"] = (name, level)
bw = read_bandwidth("cpu")
gen = torch.Generator().manual_seed(0)
vocab = next(iter(models.values()))[0].config.vocab_size


def call(variant, ids, steps):
    model = models[variants[variant][0]][0]
    kernels.set_simd_level(variants[variant][1])
    t = time.perf_counter()
    with torch.no_grad(), StepTimer("cpu") as timer:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                       do_sample=False)
    steps.extend(t for _, t in timer.decode_steps(1))
    return time.perf_counter() - t


first = {}
for variant in variants:
    ids = torch.randint(3, vocab, (1, args.prompt_len), generator=gen)
    first[variant] = call(variant, ids, [])
steps = {v: [] for v in variants}
for r in range(args.repeats):
    ids = torch.randint(3, vocab, (1, args.prompt_len + r), generator=gen)
    for variant in variants:
        call(variant, ids, steps[variant])
kernels.set_simd_level(top)
print(f"read bandwidth {bw / 1e9:.1f} GB/s; first calls: " + ", ".join(f"{n} {t:.2f} s" for n, t in first.items()))
step = {}
for variant, (name, level) in variants.items():
    nbytes = models[name][1]
    step[variant] = statistics.median(steps[variant])
    print(f"{variant}: {nbytes / 1e9:.2f} GB read a step, bound {1e3 * nbytes / bw:.1f} ms; decode step "
          f"{1e3 * step[variant]:.1f} ms = {step[variant] / (nbytes / bw):.2f}x the bound ({len(steps[variant])} steps), "
          f"{step['bf16'] / step[variant]:.2f}x as fast as bf16's")
