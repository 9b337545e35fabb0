"""Greedy decode steps of a Qwen3-1.7B-shape model (random weights) through `wrap`, bf16 against
torchao int8 weight-only (quantized at load by transformers' TorchAoConfig), both in one process,
batch 1, 128-token prompts, against the int8 bandwidth bound. It runs the later
`../cpu-avx2-2026-11-29-int4/quantized_step.py` (the same measurement over a list of quantizations,
which grew out of this script) with `--quantizations torchao-int8`; its lines then say
"torchao-int8" where `int8_step.txt` says "int8".

    python docs/measurements/cpu-avx2-2026-11-29-int8/int8_step.py --new 64 --repeats 3
"""
import os
import runpy
import sys

sys.argv += ["--quantizations", "torchao-int8"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpu-avx2-2026-11-29-int4",
                            "quantized_step.py"), run_name="__main__")
