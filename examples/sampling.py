"""Sampling with prompt lookup: do_sample with temperature / top-p, reproducible by seed.

Calls with sampling are currently handed to HF's own `generate` (hf_plookup logs that it
delegates); they give what HF gives for the same seed.

    python examples/sampling.py --model smollm2-135m --max-new-tokens 64 --samples 3
"""

from __future__ import annotations

import argparse

import torch

import hf_plookup
from hf_plookup.embedded import DEFAULT_MODEL, resolve_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias (gemma3-270m, smollm2-135m) or HF id/path")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens")
    p.add_argument("--samples", type=int, default=2, help="how many samples to draw (one seed each)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="Give three names for a bakery that sells bread, and say why each name suits a bakery.")
    args = p.parse_args(argv)

    model, tokenizer = resolve_model(args.model, dtype=torch.float32, device="cpu")
    model = hf_plookup.wrap(model)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        inputs = tokenizer(args.prompt + "\n", return_tensors="pt")

    width = inputs["input_ids"].shape[1]
    for i in range(args.samples):
        torch.manual_seed(args.seed + i)
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=True,
                             temperature=args.temperature, top_p=args.top_p, prompt_lookup_num_tokens=args.k)
        print(f"--- sample {i} (seed {args.seed + i})")
        print(tokenizer.decode(out[0, width:], skip_special_tokens=True).strip())
    s = model.last_stats
    print(f"\n[{'delegated to HF generate: ' + s.delegated_reason if s.delegated else 'hf_plookup engine'}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
