"""Lossless against hf_plookup's own greedy: SmolLM2-135M-Instruct quantized at load (quant_configs.py),
wrapped, 3 builtin prompts cut to 300 tokens, 48 new tokens; greedy with prompt_lookup_num_tokens=4
(chains) and with prompt_lookup_tree_nodes=8 (trees), at batch 1 and as one batch of 3, against the
same model's plain greedy (no drafts) at batch 1. One JSON line: whether each equals it.

    python docs/measurements/cpu-avx2-2026-11-29-int8/own_greedy.py tao_int8wo_bf16 48
"""
import json, logging, os, sys

import torch

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
import transformers

transformers.utils.logging.disable_progress_bar(); transformers.utils.logging.set_verbosity_error()
from transformers import AutoModelForCausalLM, AutoTokenizer

# the quantizers' configs by name: the 2026-11-28 measurement's
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cpu-avx512-2026-11-28-quantized"))
from quant_configs import cfg

import hf_plookup
from eval.lib.prompts import builtin_prompts
from hf_plookup.embedded import embedded_checkpoint

path = embedded_checkpoint("smollm2-135m")
which, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 48
q, dt = cfg(which)
model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, device_map="cpu",
                                             **({"quantization_config": q} if q is not None else {})).eval()
tok = AutoTokenizer.from_pretrained(path)
prompts = [p[:300] for p in builtin_prompts(tok, 3)]
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
w = hf_plookup.wrap(model)


def run(rows, **kw):
    L = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    out = w.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad, **kw)
    return [r[L:] for r in out.tolist()]


plain = [run([p])[0] for p in prompts]
res = {"which": which, "note": bool(w.last_stats.exactness_note)}
for name, kw in (("chain", {"prompt_lookup_num_tokens": 4}),
                 ("tree", {"prompt_lookup_num_tokens": 4, "prompt_lookup_tree_nodes": 8})):
    res[f"{name}_b1_equal"] = [run([p], **kw)[0] == ref for p, ref in zip(prompts, plain)]
    res[f"{name}_b3_equal"] = [got == ref for got, ref in zip(run(prompts, **kw), plain)]
print(json.dumps(res))
