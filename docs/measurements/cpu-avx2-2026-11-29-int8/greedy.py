"""The 2026-11-28 script, `../cpu-avx512-2026-11-28-quantized/greedy.py` (HF's greedy of a quantized
SmolLM2 against hf_plookup's with drafts), run with torch's thread count from THREADS (default 2).

    THREADS=1 python docs/measurements/cpu-avx2-2026-11-29-int8/greedy.py tao_int8wo_fp32 48
"""
import os
import runpy

import torch

_set_threads = torch.set_num_threads
torch.set_num_threads = lambda n: _set_threads(int(os.environ.get("THREADS", n)))
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpu-avx512-2026-11-28-quantized",
                            "greedy.py"), run_name="__main__")
