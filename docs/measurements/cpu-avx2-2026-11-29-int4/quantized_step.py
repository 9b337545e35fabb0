"""Greedy decode steps of a Qwen3-1.7B-shape model (random weights) through `wrap`, bf16 against
each --quantizations name (quantized at load by transformers' own quantizers, eval/lib/quantization.py),
all in one process, batch 1, 128-token prompts, each against its bandwidth bound: every byte the
model stores (quantized values, scales and shifts, the bf16 LM head and norms,
`eval/lib/quantization.weight_bytes`) over the read bandwidth `eval/lib/timing.read_bandwidth`
measures. (The 2026-11-29 int8 script, with a list of quantizations.)

A decode step's time is the median of the decode steps (`eval/lib/timing.StepTimer`, around the
engine's forwards) of --repeats calls over distinct prompts, the two models taking turns; the first
call of each model (packing, the C layers' check) is reported apart. A call's time per new token,
prompt included, is printed beside it.

    python docs/measurements/cpu-avx2-2026-11-29-int4/quantized_step.py --new 32 --repeats 3 \
        --quantizations torchao-int8 quanto-int4
    python docs/measurements/cpu-avx2-2026-11-29-int4/quantized_step.py --shape qwen3-8b --new 16 --repeats 2 \
        --quantizations quanto-int4 --without-bf16
"""

import argparse
import statistics
import time

import torch

import hf_plookup
from eval.lib.models import load_model
from eval.lib.quantization import weight_bytes
from eval.lib.timing import StepTimer, read_bandwidth

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3-1.7b")
p.add_argument("--new", type=int, default=64)
p.add_argument("--prompt-len", type=int, default=128)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--k", type=int, default=0, help="prompt_lookup_num_tokens (0: greedy)")
p.add_argument("--quantizations", nargs="+", default=["torchao-int8", "quanto-int4"])
p.add_argument("--without-bf16", action="store_true", help="no bf16 model (a shape whose bf16 and quantized forms do not fit in memory together)")
args = p.parse_args()
torch.set_num_threads(2)

models = {}
for name, q in [("bf16", None)] * (not args.without_bf16) + [(q, q) for q in args.quantizations]:
    model, _ = load_model(f"random:{args.shape}", torch.bfloat16, "cpu", quantization=q)
    models[name] = (hf_plookup.wrap(model), weight_bytes(model))
bw = read_bandwidth("cpu")
gen = torch.Generator().manual_seed(0)
vocab = next(iter(models.values()))[0].config.vocab_size


def call(model, ids, steps):
    kw = {"prompt_lookup_num_tokens": args.k} if args.k else {}
    t = time.perf_counter()
    with torch.no_grad(), StepTimer("cpu") as timer:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                       do_sample=False, **kw)
    steps.extend(t for _, t in timer.decode_steps(1))
    return time.perf_counter() - t


first = {}
for name, (model, _) in models.items():
    ids = torch.randint(3, vocab, (1, args.prompt_len), generator=gen)
    first[name] = call(model, ids, [])
steps = {name: [] for name in models}
calls = {name: [] for name in models}
for r in range(args.repeats):
    ids = torch.randint(3, vocab, (1, args.prompt_len + r), generator=gen)
    for name, (model, _) in models.items():
        calls[name].append(call(model, ids, steps[name]))
print(f"read bandwidth {bw / 1e9:.1f} GB/s; first calls: " + ", ".join(f"{n} {t:.2f} s" for n, t in first.items()))
step = {}
for name, (model, nbytes) in models.items():
    step[name] = statistics.median(steps[name])
    print(f"{name}: {nbytes / 1e9:.2f} GB read a step, bound {1e3 * nbytes / bw:.1f} ms; decode step {1e3 * step[name]:.1f} ms "
          f"= {step[name] / (nbytes / bw):.2f}x the bound ({len(steps[name])} steps); a call "
          f"{statistics.median(calls[name]):.2f} s")
for name in args.quantizations * (not args.without_bf16):
    print(f"{name} decode step: {step['bf16'] / step[name]:.2f}x as fast as bf16's")
