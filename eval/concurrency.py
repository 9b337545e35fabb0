"""Concurrent callers: N client threads, each making M one-prompt `generate` calls on one
wrapped model, against the same calls made one after another.

With `join_calls=True` (the default of `hf_plookup.wrap`) a call that arrives while another
runs joins its engine loop, so concurrent callers share forwards; with `--no-join` they take
turns. Every output is compared with the sequential run's (same tokens expected).

    python eval/concurrency.py                      # SmolLM2-135M-Instruct if installed, 8 x 8 calls
    python eval/concurrency.py --clients 4 --calls-per-client 4 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import hf_plookup
from eval.lib.cli import add_threads_option, set_threads, show_defaults
from eval.lib.documents import BUILTIN_PATH, load_jsonl
from eval.lib.models import load_model
from eval.lib.prompts import build_prompt, encode_prompt, use_chat
from eval.lib.report import report, write_json
from hf_plookup.embedded import default_example_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_example_model(), help="embedded alias or HF id/path")
    p.add_argument("--clients", type=int, default=8, help="client threads")
    p.add_argument("--calls-per-client", type=int, default=8, help="one-prompt generate calls per client")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens")
    add_threads_option(p)
    p.add_argument("--no-join", action="store_true", help="wrap with join_calls=False (callers take turns)")
    p.add_argument("--json", default=None, help="write the results here")
    return show_defaults(p)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("clients", "calls_per_client", "max_new_tokens", "k"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    set_threads(args.threads)
    model, tokenizer = load_model(args.model, torch.float32, "cpu")
    # no prefix pool: both phases run the same prompts, and the first would prefill for the second
    wrapped = hf_plookup.wrap(model, join_calls=not args.no_join, prefix_cache=False)
    docs = load_jsonl(BUILTIN_PATH)
    chat = use_chat(args.model, tokenizer)  # a base model gets the few-shot prompt
    n = args.clients * args.calls_per_client
    prompts = [encode_prompt(tokenizer, build_prompt(tokenizer, docs[i % len(docs)]["document"], chat), chat)
               for i in range(n)]
    kw = dict(max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.k)

    def call(i):
        ids = torch.tensor([prompts[i]])
        return wrapped.generate(ids, attention_mask=torch.ones_like(ids), **kw)

    call(0)  # warm-up (cache allocation, first-call costs)
    t0 = time.perf_counter()
    sequential = [call(i) for i in range(n)]
    t_seq = time.perf_counter() - t0

    concurrent: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def client(c):
        try:
            for j in range(args.calls_per_client):
                i = c * args.calls_per_client + j
                concurrent[i] = call(i)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_conc = time.perf_counter() - t0
    if errors:
        raise errors[0]
    tokens = sum(int(s.shape[1]) - len(p) for s, p in zip(sequential, prompts))
    same = sum(torch.equal(sequential[i], concurrent[i]) for i in range(n))
    result = {
        "model": args.model, "clients": args.clients, "calls_per_client": args.calls_per_client,
        "max_new_tokens": args.max_new_tokens, "k": args.k, "join_calls": not args.no_join,
        "sequential_s": t_seq, "concurrent_s": t_conc, "new_tokens": tokens,
        "sequential_tok_s": tokens / t_seq, "concurrent_tok_s": tokens / t_conc,
        "speedup": t_seq / t_conc, "identical": f"{same}/{n}",
    }
    print(f"{args.clients} clients x {args.calls_per_client} calls, {args.model}, {tokens} new tokens: "
          f"sequential {tokens / t_seq:.1f} tok/s, concurrent ({'joining' if not args.no_join else 'taking turns'}) "
          f"{tokens / t_conc:.1f} tok/s = {t_seq / t_conc:.2f}x; identical outputs {same}/{n}")
    if args.json:
        write_json(args.json, report("concurrency", argv, args, "cpu", [result]))
    return 0 if same == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
