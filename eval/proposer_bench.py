"""Proposer time per engine step at large batch and long histories (no model involved).

    python eval/proposer_bench.py --batch 256 --history 8192

Builds `--batch` histories of `--history` tokens of text-like ids (a Zipf draw over a
49,152-token vocabulary with repeated spans, so common tokens have thousands of earlier
occurrences and n-grams recur as in documents), indexes them once (the prefill), then runs
`--steps` decode steps: each row appends 1..k+1 tokens, the index takes them (`update`), and the
drafter proposes for every row. Reports milliseconds per step for the chain drafter (today's
n-gram matcher, HF's rescanning meaning) and for candidate trees (own row, and with the other
rows as sources), with numba's thread count as run.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from eval.lib.cli import add_threads_option, show_defaults
from eval.lib.report import report, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--history", type=int, default=8192, help="tokens per row before the timed steps")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps")
    p.add_argument("--k", type=int, default=8, help="prompt_lookup_num_tokens")
    p.add_argument("--tree-nodes", type=int, default=16, help="prompt_lookup_tree_nodes")
    p.add_argument("--max-candidates", type=int, default=None, help="TreeProposer max_candidates (default: its own)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    add_threads_option(p, "numba threads (the drafters run on numba)", "numba's default", numba.config.NUMBA_NUM_THREADS)
    return show_defaults(p)


def text_like(rng: np.random.Generator, rows: int, length: int, vocab: int) -> np.ndarray:
    """[rows, length] ids: Zipf-distributed tokens where a third of the spans repeat an earlier span
    of the row (documents quote themselves, which is what prompt lookup feeds on)."""
    out = np.empty((rows, length), dtype=np.int64)
    for r in range(rows):
        toks = (rng.zipf(1.2, size=length) - 1) % vocab
        p = 64
        while p < length:
            span = int(rng.integers(4, 32))
            if rng.random() < 1 / 3:
                src = int(rng.integers(0, p - span)) if p > span else 0
                n = min(span, length - p)
                toks[p : p + n] = toks[src : src + n]
            p += span
        out[r] = toks
    return out


def run(args) -> list[dict]:
    from hf_plookup.drafting.ngram import NgramProposer
    from hf_plookup.drafting.suffix import SuffixIndex
    from hf_plookup.drafting.tree import TreeProposer

    rng = np.random.default_rng(args.seed)
    width = args.history + args.steps * (args.k + 1) + 1
    base = text_like(rng, args.batch, width, args.vocab)
    grow = rng.integers(1, args.k + 2, size=(args.steps, args.batch))  # tokens each row emits per step
    rows_all = np.arange(args.batch, dtype=np.int64)
    results = []
    variants = [("chain (n-gram rescan)", None, False), (f"tree {args.tree_nodes} (own row)", "tree", False),
                (f"tree {args.tree_nodes} (+ other rows)", "tree", True)]
    for name, kind, cross in variants:
        history = base.copy()
        lengths = np.full(args.batch, args.history, dtype=np.int64)
        if kind is None:
            proposer = NgramProposer(args.k, 2)
        else:
            extra = {} if args.max_candidates is None else {"max_candidates": args.max_candidates}
            proposer = TreeProposer(args.k, args.tree_nodes, 2, **extra)
            t0 = time.perf_counter()
            index = SuffixIndex(args.batch, width, cross_rows=cross)
            index.update(history, rows_all, lengths)
            prefill_ms = 1000 * (time.perf_counter() - t0)
        spent = []
        nodes = 0
        for s in range(args.steps):
            lengths = lengths + grow[s]
            t0 = time.perf_counter()
            if kind is None:
                _, num = proposer.propose(history, lengths)
            else:  # the engine's order: index the committed tokens, then propose
                index.update(history, rows_all, lengths)
                _, _, num = proposer.propose(history, lengths, index=index)
            spent.append(time.perf_counter() - t0)
            nodes += int(num.sum())
        ms = 1000 * np.array(spent[5:] if args.steps > 10 else spent)
        row = {"drafter": name, "ms_per_step_median": float(np.median(ms)), "ms_per_step_p90": float(np.percentile(ms, 90)),
               "drafts_per_row": nodes / (args.steps * args.batch)}
        if kind is not None:
            row["index_build_ms"] = prefill_ms
        results.append(row)
    return results


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.threads is not None:
        if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
            p.error(f"--threads must be between 1 and {numba.config.NUMBA_NUM_THREADS} (NUMBA_NUM_THREADS), got {args.threads}")
        numba.set_num_threads(args.threads)
    rows = run(args)
    print(f"batch {args.batch}, {args.history}-token histories, k {args.k}, {args.steps} steps, "
          f"numba threads {numba.get_num_threads()}")
    print("| drafter | ms/step (median) | p90 | drafts/row | index build ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        build = f"{r['index_build_ms']:.0f}" if "index_build_ms" in r else "-"
        print(f"| {r['drafter']} | {r['ms_per_step_median']:.3f} | {r['ms_per_step_p90']:.3f} | "
              f"{r['drafts_per_row']:.1f} | {build} |")
    if args.json:
        write_json(args.json, report("proposer_bench", argv, args, "cpu", rows, numba_threads=numba.get_num_threads()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
