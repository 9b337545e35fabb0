"""wrap on a GPTQ checkpoint (make_checkpoint.py): bf16 and fp32, greedy and k=4 against HF greedy
of the same model, 2 prompts at batch 1 and as a batch of 2, 24 new tokens.

    python docs/measurements/cpu-avx2-2026-11-29-gptq/wrap_gptq.py CHECKPOINT_DIR
"""
import time, sys, torch, logging
logging.basicConfig(level=logging.WARNING)
from transformers import AutoTokenizer, AutoModelForCausalLM
import hf_plookup
P = sys.argv[1]
tok = AutoTokenizer.from_pretrained(P)
tok.padding_side = "left"
texts = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps again over the dog.",
         "Once upon a time there was a small village. In the village lived a baker who baked bread every day."]
for dt in (torch.bfloat16, torch.float32):
    m = AutoModelForCausalLM.from_pretrained(P, dtype=dt, device_map="cpu")
    enc = tok(texts, return_tensors="pt", padding=True)
    ref1 = [m.generate(**tok([t], return_tensors="pt"), max_new_tokens=24, do_sample=False) for t in texts]
    import copy
    try:
        t0 = time.time()
        w = hf_plookup.wrap(copy.copy(m))
        print(dt, "wrap", round(time.time() - t0, 1), "invariant", w._engine.invariant is not None,
              "note", w._engine.plan.exactness_note[:200])
    except Exception as e:
        print(dt, "REFUSED", type(e).__name__, str(e)[:600]); continue
    for k in (None, 4):
        outs = [w.generate(**tok([t], return_tensors="pt"), max_new_tokens=24, prompt_lookup_num_tokens=k) for t in texts]
        print(dt, "k", k, "b1 equal HF", [torch.equal(a, b) for a, b in zip(outs, ref1)], w.last_stats.decode_steps_by_path)
    refb = m.generate(**enc, max_new_tokens=24, do_sample=False)
    outb = w.generate(**enc, max_new_tokens=24, prompt_lookup_num_tokens=4)
    print(dt, "b2 equal HF batch", torch.equal(outb, refb))
