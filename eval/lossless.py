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
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `eval.lib.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_plookup  # noqa: E402
from eval.lib import common  # noqa: E402
from hf_plookup.embedded import default_example_model  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_example_model(), help="embedded alias or HF id/path")
    p.add_argument("--dtype", default="bf16", choices=sorted(common.DTYPES))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-docs", type=int, default=4, help="builtin documents, as chat summary requests")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, nargs="+", default=[4, 8], help="prompt_lookup_num_tokens of the chain variants")
    p.add_argument("--tree-nodes", type=int, default=16, help="prompt_lookup_tree_nodes of the tree variant (k = max --k)")
    p.add_argument("--modes", nargs="+", default=["on", "off"], choices=["on", "off"], help="invariant mode settings")
    p.add_argument("--attn-backend", default="sdpa", choices=["sdpa", "triton"],
                   help="hf_plookup attn_backend (triton: CUDA graphs and compiled steps on a GPU)")
    common.add_threads_option(p)
    p.add_argument("--json", default=None, help="write the results here")
    return common.show_defaults(p)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    common.set_threads(args.threads)
    model, tok = common.load_model(args.model, common.parse_dtype(args.dtype), args.device)
    docs = common.load_jsonl(common.BUILTIN_PATH)[: args.num_docs]
    chat = common.use_chat(args.model, tok)
    rows = [common.encode_prompt(tok, common.build_prompt(tok, d["document"], chat), chat) for d in docs]
    pad = common.pad_id(model, tok)
    eos = common.eos_ids(model)
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
            hf.append(common.new_tokens(out, len(r), eos)[0])
    results = []
    for mode in args.modes:
        # the same object, rewrapped per mode
        wrapped = hf_plookup.wrap(model, invariant=mode == "on", attn_backend=args.attn_backend)

        def run(ids: torch.Tensor, mask: torch.Tensor, **kw) -> tuple[list[list[int]], float]:
            common.empty_prefix_pool(wrapped)  # each variant prefills its prompts itself
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = wrapped.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device), **gen, **kw)
            return common.new_tokens(out, ids.shape[1], eos), time.perf_counter() - t0

        def each_alone(**kw) -> tuple[list[list[int]], float]:
            """Every prompt on its own (batch 1): outputs and total seconds."""
            outs, secs = [], 0.0
            for r in rows:
                toks, s = run(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), **kw)
                outs.append(toks[0])
                secs += s
            return outs, secs

        plain, plain_s = each_alone()
        diffs = [common.first_divergence(p, h) for p, h in zip(plain, hf)]
        print(f"invariant {mode:3s} | plain greedy = HF greedy (batch 1): {sum(d is None for d in diffs)}/{len(rows)}", flush=True)
        results.append({"invariant": mode, "variant": "plain greedy vs HF greedy", "equal": sum(d is None for d in diffs),
                        "of": len(rows), "first_difference": diffs})
        lines = [("plain greedy", plain, plain_s)] + [(name, *each_alone(**kw)) for name, kw in variants]
        ids, mask = common.left_pad(rows, pad)
        batch, secs = run(ids, mask, prompt_lookup_num_tokens=args.k[0])
        lines.append((f"batch of {len(rows)}, k={args.k[0]}", batch, secs))
        for name, outs, secs in lines:
            diffs = [common.first_divergence(o, p) for o, p in zip(outs, plain)]
            same = sum(d is None for d in diffs)
            n_tok = sum(len(o) for o in outs)
            rec = {"invariant": mode, "variant": name, "equal": same, "of": len(outs),
                   "first_difference": diffs, "tok_s": n_tok / secs if secs else None}
            results.append(rec)
            print(f"invariant {mode:3s} | {name:22s} | equal to plain greedy {same}/{len(outs)} | "
                  f"first difference at {[d for d in diffs if d is not None] or '-'} | {rec['tok_s']:.1f} tok/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
