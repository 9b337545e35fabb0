"""Seconds of one forward of the GPTQ SmolLM2 checkpoint loaded in fp16, as HF runs it (gptqmodel's
modules, turned at their first fp16 call into torch's CPU int4 form): a 300-token prompt, then three
1-token steps. Run with gptqmodel's venv: `python hf_gptq_fp16_forward.py CKPT_DIR`."""
import sys
import time

import torch
from transformers import AutoModelForCausalLM

m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16)
ids = torch.randint(3, 1000, (1, 300), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    for n in (300, 1, 1, 1):
        t = time.time()
        m(input_ids=ids[:, :n])
        print(f"{n} tokens: {time.time() - t:.2f} s", flush=True)
