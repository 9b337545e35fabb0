"""Sampling with prompt lookup: do_sample with temperature / top-p, reproducible by seed.

Sampling runs on hf_plookup's engine: every output position draws from the model's
distribution with a uniform keyed by the row's seed and the position, so every token is
distributed exactly as HF's own sampling would draw it and drafts never change it (the random
draws differ from HF's, so the same seed gives other text than HF's `generate`).

    python examples/sampling.py --max-new-tokens 64 --samples 3   # SmolLM2-135M-Instruct if installed
    python examples/sampling.py --model gemma3-270m               # the base model, plain-text prompt
"""

from __future__ import annotations

import argparse

import torch

import hf_plookup
from hf_plookup.embedded import encode_prompts, example_model, example_parser, is_instruct


def build_parser() -> argparse.ArgumentParser:
    p = example_parser(__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2, help="how many samples to draw (one seed each) (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.9, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--prompt", default="Give three names for a bakery that sells bread, and say why each name suits a bakery.",
                   help="request for an instruct model (default: %(default)s)")
    p.add_argument("--base-prompt", default="Three good names for a small bakery that sells bread, and why each suits it:\n1.",
                   help="plain-text prompt for a base model (default: %(default)s)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    model, tokenizer = example_model(p, args)
    model = hf_plookup.wrap(model)
    inputs = encode_prompts(tokenizer, [args.prompt], [args.base_prompt], is_instruct(args.model, tokenizer))

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
