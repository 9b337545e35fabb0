"""The token checks of the int8 measurement (`../cpu-avx2-2026-11-29-int8/greedy.py`: HF's greedy of a
quantized SmolLM2 against hf_plookup's with drafts, batch 1 and 2; `own_greedy.py`: lossless against
hf_plookup's own greedy, chains and trees, batch 1 and 3) with two more config names, quanto's int4
in fp32 and bf16 (`QuantoConfig(weights="int4")`).

    THREADS=1 python docs/measurements/cpu-avx2-2026-11-29-int4/tokens.py greedy quanto4_fp32 48
    THREADS=1 python docs/measurements/cpu-avx2-2026-11-29-int4/tokens.py own_greedy quanto4_bf16 48
"""
import os
import runpy
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "cpu-avx512-2026-11-28-quantized"))
import quant_configs  # noqa: E402  (the scripts import `cfg` from this module, patched below)

_earlier = quant_configs.cfg


def cfg(which):
    from transformers import QuantoConfig

    if which in ("quanto4_fp32", "quanto4_bf16"):
        return QuantoConfig(weights="int4"), torch.float32 if which.endswith("fp32") else torch.bfloat16
    return _earlier(which)


quant_configs.cfg = cfg
script = sys.argv.pop(1)
runpy.run_path(os.path.join(here, "..", "cpu-avx2-2026-11-29-int8", script + ".py"), run_name="__main__")
