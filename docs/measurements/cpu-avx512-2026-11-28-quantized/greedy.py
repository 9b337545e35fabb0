import sys, copy, logging, time, json
import torch
torch.set_num_threads(2)
import transformers
transformers.utils.logging.disable_progress_bar(); transformers.utils.logging.set_verbosity_error()
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
for n in list(logging.root.manager.loggerDict):
    if "bitsandbytes" in n or "torchao" in n: logging.getLogger(n).setLevel(logging.ERROR)
from transformers import AutoModelForCausalLM, AutoTokenizer
import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); sys.path.insert(0, ".")
from quant_configs import cfg
import hf_plookup
from hf_plookup.embedded import embedded_checkpoint
from eval.lib.prompts import builtin_prompts
path = embedded_checkpoint("smollm2-135m")
which = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 48
q, dt = cfg(which)
kw = dict(quantization_config=q) if q is not None else {}
model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, device_map="cpu", **kw).eval()
tok = AutoTokenizer.from_pretrained(path)
prompts = [p[:300] for p in builtin_prompts(tok, 3)]
w = copy.copy(model)
try:
    hf_plookup.wrap(w)
except ValueError as e:
    print(json.dumps({"which": which, "refused": str(e)})); sys.exit()
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
def batch(rows):
    L = max(len(r) for r in rows)
    ids = torch.tensor([[pad]*(L-len(r)) + r for r in rows]); mask = torch.tensor([[0]*(L-len(r)) + [1]*len(r) for r in rows])
    return ids, mask, L
res = {"which": which, "note": bool(w._engine.plan.exactness_note)}
t = time.time()
def first_div(a, b):
    for i,(x,y) in enumerate(zip(a,b)):
        if x != y: return i
    return None if len(a)==len(b) else min(len(a),len(b))
hf1 = {}
b1 = []
for i, p in enumerate(prompts):
    ids, mask, L = batch([p])
    h = model.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False, pad_token_id=pad)[0, L:].tolist()
    e = w.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False, prompt_lookup_num_tokens=4, pad_token_id=pad)[0, L:].tolist()
    hf1[i] = h
    b1.append(first_div(h, e))
res["b1_first_divergence"] = b1
b2, b2v1 = [], []
for pair in ((0, 1), (1, 2)):
    ids, mask, L = batch([prompts[j] for j in pair])
    h = model.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False, pad_token_id=pad)[:, L:].tolist()
    e = w.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False, prompt_lookup_num_tokens=4, pad_token_id=pad)[:, L:].tolist()
    strip = lambda r: r[:r.index(pad)] if pad in r and pad != tok.eos_token_id else r
    b2.append([first_div(strip(h[r]), strip(e[r])) for r in range(2)])
    b2v1.append([first_div(hf1[j], strip(e[r])) for r, j in enumerate(pair)])
res["b2_vs_hf_b2"] = b2; res["b2_vs_hf_b1"] = b2v1
res["tokens"] = N; res["secs"] = round(time.time()-t, 1)
print(json.dumps(res))
