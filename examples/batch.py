"""Batched prompt lookup: several prompts of different lengths, left padding, one call.

HF's own prompt lookup refuses batches larger than one; hf_plookup runs them and returns
exactly what HF greedy returns (checked here with `--check`).

    python examples/batch.py --max-new-tokens 64 --check    # SmolLM2-135M-Instruct if installed
    python examples/batch.py --model gemma3-270m --check    # the base model, with plain-text prompts
"""

from __future__ import annotations

import argparse

import torch

import hf_plookup
from hf_plookup.embedded import encode_prompts, example_model, example_parser, is_instruct

REQUESTS = [
    "Rewrite this sentence in the past tense: The committee meets on Tuesday and approves the budget for the new library.",
    "List the three colours in this sentence: The red kite flew over the green field under a blue sky.",
    "Repeat the following line exactly: def add(a, b): return a + b",
    "Summarize: The town's footbridge closed in 2021 because of corrosion. A new footbridge, costing 4.3 million "
    "pounds, was approved on Tuesday and the footbridge will open in 2026.",
]
# the same four tasks for a base model: text whose natural continuation is the answer
BASE_PROMPTS = [
    "Present: The dog runs to the gate.\nPast: The dog ran to the gate.\n\n"
    "Present: The committee meets on Tuesday and approves the budget for the new library.\nPast:",
    "Sentence: A yellow bus passed a white house.\nColours: yellow, white\n\n"
    "Sentence: The red kite flew over the green field under a blue sky.\nColours:",
    "# a Python function, written twice\ndef add(a, b): return a + b\ndef add(a, b):",
    "Article: The town's footbridge closed in 2021 because of corrosion. A new footbridge, costing 4.3 million "
    "pounds, was approved on Tuesday and the footbridge will open in 2026.\n\nSummary:",
]


def build_parser() -> argparse.ArgumentParser:
    p = example_parser(__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="also run HF greedy and compare the outputs")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    model, tokenizer = example_model(p, args)
    wrapped = hf_plookup.wrap(model)  # the same object, its generate now on hf_plookup's engine

    inputs = encode_prompts(tokenizer, REQUESTS, BASE_PROMPTS, is_instruct(args.model, tokenizer))

    out = wrapped.generate(**inputs, max_new_tokens=args.max_new_tokens,
                           prompt_lookup_num_tokens=args.k, max_matching_ngram_size=2)
    width = inputs["input_ids"].shape[1]
    for i, row in enumerate(out):
        print(f"[{i}] {tokenizer.decode(row[width:], skip_special_tokens=True).strip()}")

    s = wrapped.last_stats
    print(f"\nbatch of {s.num_sequences}: {s.new_tokens} tokens, {s.forwards} forwards, "
          f"{s.tokens_per_forward:.2f} tokens per sequence per forward, acceptance {s.acceptance_rate:.2f}")
    print("acceptance per draft position:", " ".join(f"{a:.2f}" for a in s.acceptance_per_position))

    if args.check:
        plain = hf_plookup.unwrap(wrapped)  # the plain HF model again (same object)
        reference = plain.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        same = reference.shape == out.shape and bool(torch.equal(reference, out))
        print("identical to HF greedy:", same)
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
