"""The probe's arithmetic floor on SmolLM2 in bf16, drawn four ways: on the probe's tokens, how far
HF's own sdpa and eager attention differ, and how far the embeddings' outputs moved by one ulp (odd
or even elements, up or down) move the logits, each the max logit difference from the plain forward.
A compressed-tensors W4A16 model is held compressed first, as `wrap` holds it.

    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-q4-avx512/floor_draws.py ct-w4a16
    PYTHONPATH=. python docs/measurements/cpu-xeon-2026-11-30-q4-avx512/floor_draws.py none
"""

import sys

import torch

from eval.lib.models import load_model
from hf_plookup.attention.probe import PROBE_TOKENS
from hf_plookup.attention.registry import engine_attention
from hf_plookup.invariant import compressed_tensors

torch.set_num_threads(2)
quantization = sys.argv[1] if len(sys.argv) > 1 else "ct-w4a16"
model, _ = load_model("smollm2-135m", torch.bfloat16, "cpu", quantization=None if quantization == "none" else quantization)
compressed_tensors.hold_compressed(model)
ids = ((torch.arange(PROBE_TOKENS) * 7 + 3) % model.get_input_embeddings().weight.shape[0])[None]
pos = {"position_ids": torch.arange(PROBE_TOKENS)[None]}
with torch.no_grad():
    reference = model(input_ids=ids, use_cache=False, **pos).logits.float()
    with engine_attention(model, "eager"):
        eager = model(input_ids=ids, use_cache=False, **pos).logits.float()
    print(f"{quantization}: sdpa against eager {float((reference - eager).abs().max()):.3g}")
    for parity, name in ((1, "odd"), (0, "even")):
        for toward, way in ((float("inf"), "up"), (float("-inf"), "down")):
            def move(module, args, out):
                picked = (torch.arange(out.numel()) % 2 == parity).view(out.shape)
                return torch.where(picked, torch.nextafter(out, torch.full_like(out, toward)), out)
            handle = model.get_input_embeddings().register_forward_hook(move)
            moved = model(input_ids=ids, use_cache=False, **pos).logits.float()
            handle.remove()
            print(f"  {name} elements {way} one ulp: {float((reference - moved).abs().max()):.3g}")
