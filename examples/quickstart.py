"""Quickstart: wrap an HF causal LM with hf_plookup and generate with prompt lookup.

    python examples/quickstart.py                          # SmolLM2-135M-Instruct if installed, else Gemma 3 270M
    python examples/quickstart.py --model gemma3-270m --max-new-tokens 64

An instruct model gets the request through its chat template; a base model (Gemma 3 270M)
gets a plain "Article: ... Summary:" prompt, whose natural continuation is the summary.
"""

from __future__ import annotations

import argparse


import hf_plookup
from hf_plookup.embedded import encode_prompts, example_model, example_parser, is_instruct

TEXT = (
    "The Harwick Vale council approved a new footbridge over the Orrin River on Tuesday. "
    "The footbridge will replace the Mill Lane crossing, which closed in 2021 after engineers "
    "found corrosion in its steel supports. Construction of the footbridge starts in spring."
)


def build_parser() -> argparse.ArgumentParser:
    return example_parser(__doc__.splitlines()[0], "prompt_lookup_num_tokens: draft tokens per step")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    model, tokenizer = example_model(p, args)
    model = hf_plookup.wrap(model)  # same model; generate() now runs on hf_plookup's engine

    inputs = encode_prompts(tokenizer, [f"Summarize in one sentence:\n\n{TEXT}"],
                            [f"Article: {TEXT}\n\nOne-sentence summary:"], is_instruct(args.model, tokenizer))

    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.k)
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())

    s = model.last_stats
    print(f"\n{s.new_tokens} tokens in {s.forwards} forwards ({s.tokens_per_forward:.2f} tokens per forward), "
          f"{s.accepted}/{s.drafted} drafts accepted, {s.wall_time:.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
