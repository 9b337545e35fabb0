"""What a greedy decode step of SmolLM2 costs wrapped, plain against held from compressed-tensors
(W4A16, groups of 64), in fp32 and bf16: one builtin document's first 3,000 characters as the
prompt, (a call of 65 new tokens - a call of 1) / 64, each the fastest of 3 rounds of the two
calls after an untimed one, the prefix pool off (each call prefills), 2 threads, all four models in
this process.

    PYTHONPATH=. python docs/measurements/cpu-avx2-2026-11-30-compressed-tensors/decode_step.py
"""

import torch

import hf_plookup
from eval.lib.documents import BUILTIN_PATH, load_jsonl
from eval.lib.models import load_model
from eval.lib.timing import interleaved

torch.set_num_threads(2)
doc = load_jsonl(BUILTIN_PATH)[0]["document"][:3000]

for dtype in (torch.float32, torch.bfloat16):
    for quantization in (None, "ct-w4a16"):
        model, tok = load_model("smollm2-135m", dtype, "cpu", quantization=quantization)
        ids = tok(doc, return_tensors="pt").input_ids
        wrapped = hf_plookup.wrap(model, prefix_cache=False)
        calls = {n: (lambda n=n: wrapped.generate(ids, max_new_tokens=n, do_sample=False)) for n in (1, 65)}
        interleaved(calls, "cpu", 1)
        times = interleaved(calls, "cpu", 3)
        step = (min(times[65]) - min(times[1])) / 64
        print(f"{str(dtype)[6:]} {quantization or 'plain'}: {ids.shape[1]} prompt tokens, {step * 1e3:.1f} ms a decode step "
              f"(C layers {'on' if wrapped._engine.c_layers and wrapped._engine.c_layers.on else 'off'})")
        del wrapped, model
