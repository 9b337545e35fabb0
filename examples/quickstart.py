"""Quickstart: wrap an HF causal LM with hf_plookup and generate with prompt lookup.

    python examples/quickstart.py                          # embedded Gemma 3 270M, offline
    python examples/quickstart.py --model smollm2-135m --max-new-tokens 64
"""

from __future__ import annotations

import argparse

import torch

import hf_plookup
from hf_plookup.embedded import DEFAULT_MODEL, resolve_model

TEXT = (
    "The Harwick Vale council approved a new footbridge over the Orrin River on Tuesday. "
    "The footbridge will replace the Mill Lane crossing, which closed in 2021 after engineers "
    "found corrosion in its steel supports. Construction of the footbridge starts in spring."
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias (gemma3-270m, smollm2-135m) or HF id/path")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens: draft tokens per step")
    args = p.parse_args(argv)

    model, tokenizer = resolve_model(args.model, dtype=torch.float32, device="cpu")
    model = hf_plookup.wrap(model)  # same model; generate() now runs on hf_plookup's engine

    request = f"Summarize in one sentence:\n\n{TEXT}"
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True, tokenize=False)
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    else:
        inputs = tokenizer(request + "\n\nSummary:", return_tensors="pt")

    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.k)
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())

    s = model.last_stats
    print(f"\n{s.new_tokens} tokens in {s.forwards} forwards ({s.tokens_per_forward:.2f} tokens per forward), "
          f"{s.accepted}/{s.drafted} drafts accepted, {s.wall_time:.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
