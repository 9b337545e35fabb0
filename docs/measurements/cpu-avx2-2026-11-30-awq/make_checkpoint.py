"""An AWQ 4-bit SmolLM2-135M-Instruct made on this machine, as a user makes one: gptqmodel's AWQ
quantizer, calibrated on builtin documents, saved with its tokenizer (what `--quantization
awq-4bit` makes on every load: eval/lib/quantization.py), in fp16 as published AWQ checkpoints are.

    python docs/measurements/cpu-avx2-2026-11-30-awq/make_checkpoint.py OUT_DIR
"""
import sys
import time

import torch

from eval.lib.quantization import _awq_checkpoint
from hf_plookup import embedded

t = time.time()
_awq_checkpoint(str(embedded.embedded_checkpoint("smollm2-135m")), sys.argv[1], torch.float16)
print("quantized in", round(time.time() - t, 1), "s", flush=True)
