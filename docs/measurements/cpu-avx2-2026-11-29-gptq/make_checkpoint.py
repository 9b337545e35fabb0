"""A GPTQ 4-bit SmolLM2-135M-Instruct made on this machine, as a user makes one: transformers'
GPTQConfig at load (gptqmodel and optimum calibrate on 24 short sentences), saved with its tokenizer.

    python docs/measurements/cpu-avx2-2026-11-29-gptq/make_checkpoint.py OUT_DIR [GROUP_SIZE=64]
"""
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig

from hf_plookup import embedded

out = sys.argv[1]
group = int(sys.argv[2]) if len(sys.argv) > 2 else 64  # SmolLM2's 576 columns hold no group of 128
src = str(embedded.embedded_checkpoint("smollm2-135m"))
tok = AutoTokenizer.from_pretrained(src)
texts = ["The quick brown fox jumps over the lazy dog near the river bank.",
         "Prompt lookup decoding copies spans of the prompt as draft tokens for speculative decoding.",
         "In the morning the market opened with modest gains, led by technology shares.",
         "She walked to the library, borrowed three novels, and read until the evening light faded.",
         "Water boils at one hundred degrees Celsius at sea level under standard atmospheric pressure.",
         "The committee will meet again next Tuesday to review the budget proposal in detail."] * 4
t = time.time()
config = GPTQConfig(bits=4, group_size=group, dataset=texts, tokenizer=tok, desc_act=False)
model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.float32)
print("quantized in", round(time.time() - t, 1), "s", flush=True)
model.save_pretrained(out)
tok.save_pretrained(out)
