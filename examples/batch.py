"""Batched prompt lookup: several prompts of different lengths, left padding, one call.

HF's own prompt lookup refuses batches larger than one; hf_plookup runs them and returns
exactly what HF greedy returns (checked here with `--check`).

    python examples/batch.py --model smollm2-135m --max-new-tokens 64 --check
"""

from __future__ import annotations

import argparse

import torch

import hf_plookup
from hf_plookup.embedded import DEFAULT_MODEL, resolve_model

REQUESTS = [
    "Rewrite this sentence in the past tense: The committee meets on Tuesday and approves the budget for the new library.",
    "List the three colours in this sentence: The red kite flew over the green field under a blue sky.",
    "Repeat the following line exactly: def add(a, b): return a + b",
    "Summarize: The town's footbridge closed in 2021 because of corrosion. A new footbridge, costing 4.3 million "
    "pounds, was approved on Tuesday and the footbridge will open in 2026.",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias (gemma3-270m, smollm2-135m) or HF id/path")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens")
    p.add_argument("--check", action="store_true", help="also run HF greedy and compare the outputs")
    args = p.parse_args(argv)

    model, tokenizer = resolve_model(args.model, dtype=torch.float32, device="cpu")
    tokenizer.padding_side = "left"  # generation continues from the right edge of every row
    wrapped = hf_plookup.wrap(model)

    if tokenizer.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True, tokenize=False)
                 for r in REQUESTS]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    else:
        inputs = tokenizer([r + "\n" for r in REQUESTS], return_tensors="pt", padding=True)

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
        reference = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        same = reference.shape == out.shape and bool(torch.equal(reference, out))
        print("identical to HF greedy:", same)
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
