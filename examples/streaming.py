"""Streaming: print tokens as they are generated, with transformers' TextStreamer.

Streaming runs on hf_plookup's engine: the tokens of each accepted run of drafts reach the
streamer one by one, in order, and the output is the same as without streaming.

    python examples/streaming.py --max-new-tokens 64            # SmolLM2-135M-Instruct if installed
    python examples/streaming.py --model gemma3-270m            # the base model, plain-text prompt
"""

from __future__ import annotations

import argparse

from transformers import TextStreamer

import hf_plookup
from hf_plookup.embedded import encode_prompts, example_model, example_parser, is_instruct


def build_parser() -> argparse.ArgumentParser:
    p = example_parser(__doc__.splitlines()[0])
    p.add_argument("--prompt", default="Write a short note to a neighbour about a parcel that was delivered to the wrong house.",
                   help="request for an instruct model (default: %(default)s)")
    p.add_argument("--base-prompt", default="Article: A parcel for number 12 was delivered to number 21 by mistake on Monday. The neighbour at number 21 carried it over in the evening and left a note.\n\nSummary:",
                   help="plain-text prompt for a base model (default: %(default)s)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    model, tokenizer = example_model(p, args)
    model = hf_plookup.wrap(model)
    inputs = encode_prompts(tokenizer, [args.prompt], [args.base_prompt], is_instruct(args.model, tokenizer))

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    model.generate(**inputs, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.k, streamer=streamer)
    s = model.last_stats
    print(f"\n[{'delegated to HF generate: ' + s.delegated_reason if s.delegated else 'hf_plookup engine'}; {s.wall_time:.2f}s]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
