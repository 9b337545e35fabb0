"""The tokens with and without the LM head's screen: SmolLM2 on 8 CNN/DailyMail articles, 64 new tokens,
k=4 and greedy, batch 1, fp32 and bf16 (and fp32 with torchao's int8 linears), two wrapped copies of one
model (head_screen True and False). Prints, per setting, how many articles gave the same tokens, and
the steps the screen decided or passed on.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-head-screen/same_tokens.py
"""

import copy

import torch

import hf_plookup
from eval.lib.models import load_model
from eval.lib.prompts import dataset_prompts
from hf_plookup.api import _state

torch.set_num_threads(2)
for dtype, quant in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, "torchao-int8")):
    model, tok = load_model("smollm2-135m", dtype, "cpu", quantization=quant)
    prompts = dataset_prompts(tok, "cnn_dailymail", 8)
    screened = hf_plookup.wrap(copy.copy(model))
    full = hf_plookup.wrap(copy.copy(model), head_screen=False)
    for k in (None, 4):
        same = 0
        for p in prompts:
            ids = torch.tensor([p])
            kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
            if k:
                kw["prompt_lookup_num_tokens"] = k
            same += torch.equal(screened.generate(ids, **kw), full.generate(ids, **kw))
        print(f"{str(dtype)[6:]} {quant or 'plain'} k={k or 'greedy'}: {same}/{len(prompts)} the same tokens")
    screen = _state(screened).engine.c_layers.screen
    print(f"  the screen decided {screen.steps} steps, passed {screen.fallbacks} to the full head")
