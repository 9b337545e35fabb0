"""A turned GPTQ linear through hf_plookup: its view, the C linear against float64 and row by row,
the C layers, and greedy / k=4 against HF greedy (bf16, one prompt, 24 new tokens).

    python docs/measurements/cpu-avx2-2026-11-29-gptq/gptq_path.py CHECKPOINT_DIR
"""
import sys, time, torch, copy
from transformers import AutoTokenizer, AutoModelForCausalLM
import hf_plookup
from hf_plookup.invariant import linears, gptq
from hf_plookup.cpu import kernels
P = sys.argv[1]
tok = AutoTokenizer.from_pretrained(P)
m = AutoModelForCausalLM.from_pretrained(P, dtype=torch.bfloat16, device_map="cpu")
enc = tok(["The quick brown fox jumps over the lazy dog. The quick brown fox jumps again."], return_tensors="pt")
ref = m.generate(**enc, max_new_tokens=24, do_sample=False)  # turns the GPTQ linears (first bf16 forward)
lin = m.model.layers[0].self_attn.q_proj
print("gptq linear:", gptq.is_gptq_linear(lin), "linear_module:", linears.linear_module(lin))
v = linears.linear_weight(lin)
p = kernels.q4_parts(v)
print("view", type(v).__name__, tuple(v.shape), v.dtype, "q4_parts", None if p is None else (p.form, p.offset, p.group), "supported", kernels.supported(v))
x = torch.randn(5, v.shape[1], dtype=torch.bfloat16)
with torch.no_grad():
    a = lin(x); b = torch.nn.functional.linear(x, v)
print("F.linear(view) == module:", torch.equal(a, b))
if p is not None:
    codes = p.codes().float(); s = p.scales.float().repeat_interleave(p.group, 1); z = p.shifts.float().repeat_interleave(p.group, 1)
    W = (codes - 8) * s + z
    ref64 = x.double() @ W.double().t()
    with torch.no_grad():
        c = kernels.linear(x, v, None) if hasattr(kernels, "linear") else None
    print("C linear vs float64 max err:", (c.double() - ref64).abs().max().item(), " module vs float64:", (a.double() - ref64).abs().max().item())
    rows = torch.stack([kernels.linear(x[i:i+1], v, None)[0] for i in range(5)])
    print("C rows alone == rows together:", torch.equal(rows, c))
w = hf_plookup.wrap(copy.copy(m))
cl = w._engine.c_layers; print("c_layers:", cl is not None)
for k in (None, 4):
    t = time.perf_counter()
    out = w.generate(**enc, max_new_tokens=24, prompt_lookup_num_tokens=k)
    print("k", k, "equal HF:", torch.equal(out, ref), round(time.perf_counter() - t, 2), "s")
g = w.generate(**enc, max_new_tokens=24)
o4 = w.generate(**enc, max_new_tokens=24, prompt_lookup_num_tokens=4)
print("k=4 == own greedy:", torch.equal(g, o4))
print("last paths:", w.last_stats.decode_steps_by_path, "C layers on:", None if cl is None else cl.on)
