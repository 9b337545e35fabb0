"""SmolLM2 in fp16 on the README's first 2,000 characters: HF's greedy, then the wrapped model's
greedy and k=4 (32 new tokens each; the wrapped calls share the prompt's pages, 512 tokens cached),
and whether each equals HF's tokens. With --profile: torch's profiler over one wrapped greedy call
(the C kernels' time is not in its table). Run from the repository root: `python first_call.py [--profile]`."""
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_plookup
from hf_plookup import embedded

path = embedded.embedded_checkpoint("smollm2-135m")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
ids = tok(open("README.md").read()[:2000], return_tensors="pt")
t = time.time()
ref = model.generate(**ids, max_new_tokens=32, do_sample=False)
print(f"HF greedy {time.time() - t:.1f} s")
w = hf_plookup.wrap(model)
if "--profile" in sys.argv:
    from torch.profiler import ProfilerActivity, profile

    w.generate(**ids, max_new_tokens=4, do_sample=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        w.generate(**ids, max_new_tokens=32, do_sample=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
else:
    for k in (None, 4):
        t = time.time()
        out = w.generate(**ids, max_new_tokens=32, do_sample=False, prompt_lookup_num_tokens=k)
        print(f"k={k}: {time.time() - t:.1f} s, equal to HF: {torch.equal(out, ref)}")
