"""Streaming: print tokens as they are generated, with transformers' TextStreamer.

A `streamer` argument is currently handled by handing the call to HF's own `generate`
(hf_plookup logs that it delegates); the output is the same as without streaming.

    python examples/streaming.py --model smollm2-135m --max-new-tokens 64
"""

from __future__ import annotations

import argparse

import torch
from transformers import TextStreamer

import hf_plookup
from hf_plookup.embedded import DEFAULT_MODEL, resolve_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias (gemma3-270m, smollm2-135m) or HF id/path")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens")
    p.add_argument("--prompt", default="Write a short note to a neighbour about a parcel that was delivered to the wrong house.")
    args = p.parse_args(argv)

    model, tokenizer = resolve_model(args.model, dtype=torch.float32, device="cpu")
    model = hf_plookup.wrap(model)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=False)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        inputs = tokenizer(args.prompt + "\n", return_tensors="pt")

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    model.generate(**inputs, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.k, streamer=streamer)
    s = model.last_stats
    print(f"\n[{'delegated to HF generate: ' + s.delegated_reason if s.delegated else 'hf_plookup engine'}; {s.wall_time:.2f}s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
