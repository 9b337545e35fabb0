"""Greedy decode steps of a Qwen3-1.7B-shape model (random weights) through `wrap`, with the LM head's
int8 screen (steps.head_screen, the default) and without it (the whole head every step), for bf16 and
each --quantizations name (quantized at load by transformers' own quantizers, eval/lib/quantization.py),
all in one process, batch 1, 128-token prompts, each against its bandwidth bound: every byte the model
stores (`eval/lib/quantization.weight_bytes`; the screen's own bytes not counted) over the read
bandwidth `eval/lib/timing.read_bandwidth` measures.

A decode step's time is the median of the decode steps (`eval/lib/timing.StepTimer`) of --repeats
calls over distinct prompts, the variants taking turns; the first call of each model is reported
apart. The models' end-of-text token is unset, so that every call makes --new tokens without a logits
processor (`min_new_tokens` adds one, and a step with a processor computes the full logits). "without"
runs the same wrapped model with its engine's screen set aside for the call.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-head-screen/step_screen.py --new 32 --repeats 3 \\
        --quantizations torchao-int8 ct-w4a16
"""

import argparse
import statistics
import time

import torch

import hf_plookup
from eval.lib.models import load_model
from eval.lib.quantization import weight_bytes
from eval.lib.timing import StepTimer, read_bandwidth
from hf_plookup.api import _state

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3-1.7b")
p.add_argument("--new", type=int, default=32)
p.add_argument("--prompt-len", type=int, default=128)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--quantizations", nargs="*", default=["torchao-int8", "ct-w4a16"])
args = p.parse_args()
torch.set_num_threads(2)

models, variants = {}, {}
for name, q in [("bf16", None)] + [(q, q) for q in args.quantizations]:
    model, _ = load_model(f"random:{args.shape}", torch.bfloat16, "cpu", quantization=q)
    model.generation_config.eos_token_id = None
    t = time.perf_counter()
    wrapped = hf_plookup.wrap(model)
    models[name] = (wrapped, weight_bytes(model), time.perf_counter() - t)
    for screen in ("with", "without"):
        variants[f"{name} {screen}"] = (name, screen == "with")
bw = read_bandwidth("cpu")
gen = torch.Generator().manual_seed(0)
vocab = next(iter(models.values()))[0].config.vocab_size


def call(variant, ids, steps):
    name, on = variants[variant]
    model = models[name][0]
    layers = _state(model).engine.c_layers
    screen, layers.screen = layers.screen, layers.screen if on else None
    t = time.perf_counter()
    try:
        with torch.no_grad(), StepTimer("cpu") as timer:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
                           pad_token_id=0)
    finally:
        layers.screen = screen
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
print(f"read bandwidth {bw / 1e9:.1f} GB/s; wrap: " + ", ".join(f"{n} {m[2]:.2f} s" for n, m in models.items())
      + "; first calls: " + ", ".join(f"{n} {t:.2f} s" for n, t in first.items()))
for name, (model, _, _) in models.items():
    screen = _state(model).engine.c_layers.screen
    print(f"{name}: the screen decided {screen.steps} steps, passed {screen.fallbacks} to the full head")
step = {v: statistics.median(s) for v, s in steps.items()}
for variant, (name, on) in variants.items():
    nbytes = models[name][1]
    print(f"{variant}: {nbytes / 1e9:.2f} GB stored, bound {1e3 * nbytes / bw:.1f} ms; decode step "
          f"{1e3 * step[variant]:.1f} ms = {step[variant] / (nbytes / bw):.2f}x the bound ({len(steps[variant])} steps), "
          f"{step['bf16 without'] / step[variant]:.2f}x as fast as bf16's without the screen, "
          f"{step['bf16 with'] / step[variant]:.2f}x bf16's with it")
