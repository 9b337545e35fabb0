"""Does prompt lookup change the text? Greedy with drafts (chains of k, candidate trees) against
hf_plookup's plain greedy on the same documents, and every row of a left-padded batch against
the same prompt alone; with the invariant mode on and off, side by side (and plain greedy
against HF greedy at batch 1).

    python eval/lossless.py                                   # SmolLM2-135M-Instruct, bf16, 4 documents
    python eval/lossless.py --dtype fp32 --num-docs 8 --max-new-tokens 96
    python eval/lossless.py --device cuda --attn-backend triton --num-docs 16   # a GPU: graphs + compile

Prints one line per (mode, variant): how many outputs equal the reference, where the first one
parts, and tok/s (batch 1; prefill included).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import hf_plookup
from eval.lib.batching import eos_ids, first_divergence, left_pad, new_tokens, pad_id
from eval.lib.calls import empty_prefix_pool
from eval.lib.cli import DTYPES, add_threads_option, parse_dtype, set_threads, show_defaults
from eval.lib.documents import BUILTIN_PATH, load_jsonl
from eval.lib.models import load_model
from eval.lib.prompts import build_prompt, encode_prompt, use_chat
from eval.lib.report import report, write_json
from hf_plookup.embedded import default_example_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_example_model(), help="embedded alias or HF id/path")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-docs", type=int, default=4, help="builtin documents, as chat summary requests")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, nargs="+", default=[4, 8], help="prompt_lookup_num_tokens of the chain variants")
    p.add_argument("--tree-nodes", type=int, default=16, help="prompt_lookup_tree_nodes of the tree variant (k = max --k)")
    p.add_argument("--modes", nargs="+", default=["on", "off"], choices=["on", "off"], help="invariant mode settings")
    p.add_argument("--attn-backend", default="sdpa", choices=["sdpa", "triton"],
                   help="hf_plookup attn_backend (triton: CUDA graphs and compiled steps on a GPU)")
    add_threads_option(p)
    p.add_argument("--json", default=None, help="write the results here")
    return show_defaults(p)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    model, tok = load_model(args.model, parse_dtype(args.dtype), args.device)
    docs = load_jsonl(BUILTIN_PATH)[: args.num_docs]
    chat = use_chat(args.model, tok)
    rows = [encode_prompt(tok, build_prompt(tok, d["document"], chat), chat) for d in docs]
    pad = pad_id(model, tok)
    eos = eos_ids(model)
    kmax = max(args.k)
    variants = [(f"k={k}", dict(prompt_lookup_num_tokens=k)) for k in args.k]
    variants.append((f"tree {args.tree_nodes}, k={kmax}", dict(prompt_lookup_num_tokens=kmax,
                                                                prompt_lookup_tree_nodes=args.tree_nodes)))
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    hf = []  # HF greedy at batch 1, before the model is wrapped (wrap swaps its class)
    with torch.inference_mode():
        for r in rows:
            ids = torch.tensor([r], device=args.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen)
            hf.append(new_tokens(out, len(r), eos)[0])
    results = []
    for mode in args.modes:
        # the same object, rewrapped per mode
        wrapped = hf_plookup.wrap(model, invariant=mode == "on", attn_backend=args.attn_backend)

        def run(ids: torch.Tensor, mask: torch.Tensor, **kw) -> tuple[list[list[int]], float]:
            empty_prefix_pool(wrapped)  # each variant prefills its prompts itself
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = wrapped.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device), **gen, **kw)
            return new_tokens(out, ids.shape[1], eos), time.perf_counter() - t0

        def each_alone(**kw) -> tuple[list[list[int]], float]:
            """Every prompt on its own (batch 1): outputs and total seconds."""
            outs, secs = [], 0.0
            for r in rows:
                toks, s = run(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), **kw)
                outs.append(toks[0])
                secs += s
            return outs, secs

        plain, plain_s = each_alone()
        diffs = [first_divergence(p, h) for p, h in zip(plain, hf)]
        print(f"invariant {mode:3s} | plain greedy = HF greedy (batch 1): {sum(d is None for d in diffs)}/{len(rows)}", flush=True)
        results.append({"invariant": mode, "variant": "plain greedy vs HF greedy", "equal": sum(d is None for d in diffs),
                        "of": len(rows), "first_difference": diffs})
        lines = [("plain greedy", plain, plain_s)] + [(name, *each_alone(**kw)) for name, kw in variants]
        ids, mask = left_pad(rows, pad)
        batch, secs = run(ids, mask, prompt_lookup_num_tokens=args.k[0])
        lines.append((f"batch of {len(rows)}, k={args.k[0]}", batch, secs))
        for name, outs, secs in lines:
            diffs = [first_divergence(o, p) for o, p in zip(outs, plain)]
            same = sum(d is None for d in diffs)
            n_tok = sum(len(o) for o in outs)
            rec = {"invariant": mode, "variant": name, "equal": same, "of": len(outs),
                   "first_difference": diffs, "tok_s": n_tok / secs if secs else None}
            results.append(rec)
            print(f"invariant {mode:3s} | {name:22s} | equal to plain greedy {same}/{len(outs)} | "
                  f"first difference at {[d for d in diffs if d is not None] or '-'} | {rec['tok_s']:.1f} tok/s", flush=True)
    if args.json:
        write_json(args.json, report("lossless", argv, args, args.device, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
