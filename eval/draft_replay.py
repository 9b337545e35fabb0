"""Tokens per forward of each drafter, replayed on greedy outputs (no verify forwards needed).

Greedy decoding is deterministic, so how many drafts a verify step accepts depends only on the
drafts and on the greedy continuation: this script generates each prompt's greedy continuation
once (hf_plookup with prompt lookup, whose greedy output is HF's), then replays it step by step
through the drafters (the chain of `--k` tokens and candidate trees of `--tree-nodes` nodes),
exactly as the engine would accept them, and reports tokens per forward and the proposer's time
per step. A live run of `eval/bench.py` gives the same tokens per forward for the engine's own
steps.

The within-document oracle beside them bounds what any drafter of the row's own text can reach:
at each step it knows the true continuation and feeds the longest run of it (up to k tokens) that
follows some earlier position of the row's prompt and output, so it accepts all of it.

With `--step-costs` (a CPU step bench's JSON at batch 1: what a step feeding q tokens costs) the
drafters also run under the engine's draft budget (engine.budget: drafts fed by those costs and by
their scores' acceptance, learned over the prompts as an engine learns over its calls), and every
row gets the modeled decode speed over plain greedy: tokens times a 1-token step's cost over the
costs of the steps it took. That is the trade between tokens per forward and speed on that machine.

With `--recycled W` every tree also runs with the model's own predictions as a source
(drafting.recycle): the W best-ranked next tokens at each position of the prompt's last token and
the greedy output are recorded once per prompt (`recorded_successors`: one forward over the prompt
and its output, the logits a verify step computes at the positions it accepts), and the replay
writes them into the table as the engine would, after each step, for the positions that step
verified; "kept" keeps the table across prompts, as an engine keeps it across calls.

    python eval/draft_replay.py --model smollm2-135m --k 4 8 --tree-nodes 8 16 32
    python eval/draft_replay.py --model smollm2-135m --dataset cnn_dailymail --num-prompts 24 --max-new-tokens 64
    python eval/draft_replay.py --model gemma3-270m --k 4 8 --tree-nodes 8 16 32
    python eval/draft_replay.py --model smollm2-135m --dataset cnn_dailymail --num-prompts 24 --recycled 4
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import numpy as np

from eval.lib.batching import eos_ids, pad_id
from eval.lib.calls import run_plookup
from eval.lib.cli import DTYPES, add_threads_option, parse_dtype, set_threads, show_defaults
from eval.lib.models import load_model
from eval.lib.prompts import SUMMARY_REQUEST, builtin_prompts, dataset_prompts
from eval.lib.report import report, write_json
from hf_plookup.engine.budget import DraftBudget
from hf_plookup.engine.engine import TREE_NODES_PER_DRAFT


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="embedded alias (gemma3-270m, smollm2-135m) or HF id/path")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--device", default=None)
    add_threads_option(p)
    p.add_argument("--dataset", default="builtin", choices=["builtin", "cnn_dailymail", "billsum"],
                   help="builtin: the benchmarks' requests for the builtin documents; cnn_dailymail, billsum: the "
                        "main job's requests for the samples shipped in eval/data/ (default: %(default)s)")
    p.add_argument("--max-doc-tokens", type=int, default=None,
                   help="cnn_dailymail, billsum: each document cut to its first this many tokens (default: whole)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, nargs="+", default=[4, 8], help="prompt_lookup_num_tokens values")
    p.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size")
    p.add_argument("--tree-nodes", type=int, nargs="*", default=[8, 16, 32], help="prompt_lookup_tree_nodes values")
    p.add_argument("--min-score", type=float, nargs="+", default=[0.0],
                   help="tree nodes and chain drafts scoring below this are left out (the engine's per-device budget at "
                        "batch 1; 0: every draft)")
    p.add_argument("--max-candidates", type=int, nargs="+", default=[None],
                   help="TreeProposer max_candidates values (default: its own)")
    p.add_argument("--step-costs", default=None, metavar="JSON",
                   help="eval/step_bench.py's JSON (CPU, batch 1, several --q): also replay each drafter under the draft "
                        "budget by these costs, and model every drafter's decode speed over greedy")
    p.add_argument("--recycled", type=int, default=0, metavar="W",
                   help="also replay every tree with W recycled successors per token (drafting.recycle), per "
                        "prompt and kept across prompts (default: %(default)s, none)")
    p.add_argument("--json", default=None)
    return show_defaults(p)


def recorded_successors(model, prompt: list[int], out: list[int], width: int) -> np.ndarray:
    """[len(out), width] int64: the model's `width` best-ranked next tokens at the prompt's last
    position and at every output position but the last (row j: after the token at position
    len(prompt) - 1 + j), from one forward over the prompt and its output."""
    import torch

    ids = torch.tensor([prompt + out], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=ids, logits_to_keep=len(out) + 1).logits[0, :-1]  # [len(out), V]
        return torch.topk(logits.float(), width, dim=-1).indices.cpu().numpy().astype(np.int64)


def step_costs(path: str):
    """The budget's FedCosts from a step bench's JSON: its eager invariant rows (else eager) at batch 1,
    seconds by q (the tokens a step feeds), fixed: replayed steps record nothing."""
    import json

    from hf_plookup.engine.budget import FedCosts

    rows = [r for r in json.load(open(path))["results"] if r.get("batch") == 1 and r.get("step_s")]
    mode = "eager+invariant" if any(r["mode"] == "eager+invariant" for r in rows) else "eager"
    seconds = {r["q"]: r["step_s"] for r in rows if r["mode"] == mode}
    if not seconds:
        raise SystemExit(f"--step-costs {path}: no batch-1 eager rows")
    return FedCosts.given(seconds)


def replay(prompt: list[int], out: list[int], proposer, min_score: float = 0.0,
           max_new_tokens: int | None = None, budget=None, fed_steps: list | None = None,
           successors=None, table=None) -> tuple[int, int, float, int]:
    """(new tokens, forwards, proposer seconds, draft tokens fed) of decoding `out` after `prompt`
    with `proposer`'s drafts, accepted as greedy verification accepts them (trees scored with the
    row's running acceptance rate, nodes below `min_score` left out, and chains cut before their
    first draft below it: drafting.tree.chain_budget, as in the engine at batch 1; or, with
    `budget` (an engine.budget.DraftBudget), the drafts the budget feeds, its acceptance counts
    updated as the engine updates them). The first token comes from the prefill. `max_new_tokens`:
    the row's length limit, which caps its drafts as the engine caps them (a row may emit at most
    that many tokens); None: len(out), the limit of a row that ran to it. A row that ended at EOS
    before its limit had drafts capped by the limit, not by where it ended: give the limit to count
    its steps as the engine ran them. `fed_steps`, where given, gets each verify step's drafts fed.
    `successors` ([len(out), W]: recorded_successors) and `table` (a drafting.recycle.SuccessorTable
    of width W): the trees read recycled successors from `table`, which gets each verified
    position's row of `successors` after its step (the prompt's last position after the prefill)."""
    from hf_plookup.drafting.suffix import SuffixIndex
    from hf_plookup.drafting.tree import TreeProposer, accept_tree, acceptance_estimate, chain_budget, walks_rejected
    from hf_plookup.engine.budget import choose_drafts

    full = np.array(prompt + out, dtype=np.int64)[None]
    n0, total = len(prompt), len(out)
    limit = total if max_new_tokens is None else max_new_tokens
    if limit < total:
        raise ValueError(f"max_new_tokens={max_new_tokens} is below the {total} tokens of `out`")
    t, forwards, spent = 1, 1, 0.0  # the prefill forward emits out[0]
    n_acc = n_rej = 0  # the row's acceptance record, which sets its trees' decay as in the engine
    fed = 0
    index = SuffixIndex(1, full.shape[1])
    if table is not None:
        index.successors = table.succ
        table.update(full[0, n0 - 1 : n0], successors[:1])  # the prefill's logits
    while t < total:
        length = np.array([n0 + t], dtype=np.int64)
        cap = np.array([limit - t - 1], dtype=np.int64)  # the tokens the row may still emit, less the verified one
        t0 = time.perf_counter()
        rate = acceptance_estimate(np.array([n_acc]), np.array([n_rej]))
        tree = isinstance(proposer, TreeProposer)
        if tree:
            scores = np.empty((1, proposer.budget))
            tokens, parents, num = proposer.propose(full, length, cap, index=index, decay=rate, scores=scores,
                                                    min_score=0.0 if budget is not None else min_score)
        else:
            drafts, num = proposer.propose(full, length, cap)
            scores = rate[:, None] ** np.arange(1, drafts.shape[1] + 1)  # as engine.batch scores a chain
            if budget is None:
                num = np.minimum(num, chain_budget(rate, min_score))
        if budget is not None:
            num = choose_drafts(budget.acceptance["tree" if tree else "chain"].chances(scores), num, budget.costs)
        spent += time.perf_counter() - t0
        m = int(num[0])
        fed += m
        if fed_steps is not None:
            fed_steps.append(m)
        if tree:
            # the target at each node: the true token after the node's path, if the path is a prefix of it
            truth = out[t:]
            picks = np.full(m + 1, -1, dtype=np.int64)
            depth_ok = {0: 0}
            picks[0] = truth[0]
            for i in range(m):
                p = int(parents[0, i])
                if p in depth_ok and depth_ok[p] < len(truth) and tokens[0, i] == truth[depth_ok[p]]:
                    d = depth_ok[p] + 1
                    depth_ok[i + 1] = d
                    picks[i + 1] = truth[d] if d < len(truth) else -1
            path, _ = accept_tree(picks, tokens[0, :m], parents[0, :m])
            accepted = len(path)
            # the path as the walks leave it, -1 after its nodes (so an empty one still has a slot)
            n_rej += bool(walks_rejected(np.array([path + [-1]]), [accepted], parents[:1], [m])[0])
            hit = np.isin(np.arange(1, m + 1), path)
        else:
            accepted = 0
            while accepted < m and t + accepted < total and drafts[0, accepted] == out[t + accepted]:
                accepted += 1
            n_rej += accepted < m  # the walk stopped at a draft that has a successor
            hit = np.arange(m) < accepted
        if budget is not None:
            budget.acceptance["tree" if tree else "chain"].record(scores[0, :m], hit)
        n_acc += accepted
        if table is not None:  # the positions this step verified: the row's last token and its accepted drafts
            table.update(full[0, n0 + t - 1 : n0 + t + accepted], successors[t : t + accepted + 1])
        t += accepted + 1
        forwards += 1
    return total, forwards, spent, fed


def oracle(prompt: list[int], out: list[int], k: int, max_new_tokens: int | None = None) -> tuple[int, int]:
    """(new tokens, forwards) of decoding `out` after `prompt` with the within-document oracle's
    drafts: at each step the longest run of the true continuation, at most k tokens (and no more
    than the row may still emit, as the engine caps drafts), that follows an earlier position of
    the text so far; verification accepts all of it. The first token comes from the prefill.

    Example: prompt [5, 6, 7, 5], out [6, 7, 9], k 4: after the prefill (6) the text is
    5 6 7 5 6, whose position 2 holds 7 and is followed by 5, not 9: one draft (7) is fed and
    accepted, then 9 comes from the same forward; 2 forwards for 3 tokens."""
    full = np.asarray(prompt + out, dtype=np.int64)
    n0, total = len(prompt), len(out)
    limit = total if max_new_tokens is None else max_new_tokens
    t, forwards = 1, 1
    while t < total:
        length = n0 + t
        want = full[length : length + min(k, limit - t - 1, total - t)]  # the drafts that would pay
        best = 0
        if len(want):
            text = full[:length]
            # match[p, j]: the text's token at p + j equals the j-th wanted token (inside the text)
            idx = np.arange(length)[:, None] + np.arange(len(want))[None, :]
            match = (idx < length) & (text[np.minimum(idx, length - 1)] == want[None, :])
            best = int(np.cumprod(match, axis=1).sum(axis=1).max())
        t += best + 1
        forwards += 1
    return total, forwards


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    import hf_plookup
    from hf_plookup.drafting.ngram import NgramProposer
    from hf_plookup.drafting.recycle import SuccessorTable
    from hf_plookup.drafting.tree import TreeProposer

    set_threads(args.threads)
    model, tokenizer = load_model(args.model, parse_dtype(args.dtype), args.device)
    wrapped = hf_plookup.wrap(copy.copy(model))
    pad = pad_id(model, tokenizer)
    if args.dataset == "builtin":
        prompts = builtin_prompts(tokenizer, args.num_prompts)
    else:  # the main job's requests (eval/summarize.py)
        prompts = dataset_prompts(tokenizer, args.dataset, args.num_prompts, args.max_doc_tokens, SUMMARY_REQUEST)
    eos = eos_ids(model)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        # prompt lookup for speed: its greedy output is HF's greedy output (tests/engine)
        res = run_plookup(wrapped, ids, torch.ones_like(ids), args.max_new_tokens, max(args.k), args.ngram, pad)
        outs.append([int(x) for x in res.tokens[0]])
    costs = step_costs(args.step_costs) if args.step_costs else None
    recorded = [recorded_successors(model, p, o, args.recycled) for p, o in zip(prompts, outs)] if args.recycled else None
    rows = []
    for k in args.k:
        drafters = [(f"chain (min score {ms:g})", NgramProposer(k, args.ngram), ms) for ms in args.min_score]
        drafters += [(f"tree {n} (min score {ms:g}{'' if mc is None else f', {mc} candidates'})",
                      TreeProposer(k, n, args.ngram, **({} if mc is None else {"max_candidates": mc})), ms)
                     for n in args.tree_nodes for ms in args.min_score for mc in args.max_candidates]
        if costs is not None:  # the budget's drafters: the chain, the default tree (2k nodes), the trees asked
            drafters += [("chain (budget)", NgramProposer(k, args.ngram), "budget")]
            drafters += [(f"tree {n} (budget)", TreeProposer(k, n, args.ngram), "budget")
                         for n in dict.fromkeys([TREE_NODES_PER_DRAFT * k, *args.tree_nodes])]
        drafters = [(name, proposer, ms, None) for name, proposer, ms in drafters]
        if args.recycled:  # every tree again, with recycled successors per prompt and kept across prompts
            drafters += [(f"{name} + recycled {args.recycled}" + (" kept" if kept else ""),
                          TreeProposer(k, proposer.budget, args.ngram, max_candidates=proposer.max_candidates,
                                       recycled=args.recycled), ms, kept)
                         for name, proposer, ms, _ in list(drafters) if isinstance(proposer, TreeProposer)
                         for kept in (False, True)]
        for name, proposer, ms, kept in drafters:
            tok = fw = fed = 0
            spent = 0.0
            budget = None
            if ms == "budget":
                budget = DraftBudget()
                budget.costs = costs
            widths: list[int] = []
            table = SuccessorTable(model.config.get_text_config().vocab_size, args.recycled) if kept is not None else None
            for j, (p, o) in enumerate(zip(prompts, outs)):
                if table is not None and not kept:
                    table.clear()
                a, b, s, f = replay(p, o, proposer, 0.0 if budget else ms, args.max_new_tokens, budget, widths,
                                    recorded[j] if table is not None else None, table)
                tok, fw, spent, fed = tok + a, fw + b, spent + s, fed + f
            steps = max(fw - len(prompts), 1)
            row = {"k": k, "drafter": name, "tokens": tok, "forwards": fw, "tokens_per_forward": tok / fw,
                   "drafts_per_step": fed / steps, "propose_ms_per_step": 1000 * spent / steps}
            if costs is not None:  # decode steps only: each prompt's first token comes from its prefill
                one = float(costs.seconds(np.array([1]))[0])
                took = float(costs.seconds(1 + np.array(widths)).sum())
                row["modeled_speed_vs_greedy"] = (tok - len(prompts)) * one / took
            rows.append(row)
        results = [oracle(p, o, k, args.max_new_tokens) for p, o in zip(prompts, outs)]
        tok, fw = sum(r[0] for r in results), sum(r[1] for r in results)
        rows.append({"k": k, "drafter": "within-document oracle", "tokens": tok, "forwards": fw,
                     "tokens_per_forward": tok / fw, "drafts_per_step": None, "propose_ms_per_step": None})
    chain = {}  # each k's first chain row: the reference of the "x chain" column
    for r in rows:
        if r["drafter"].startswith("chain"):
            chain.setdefault(r["k"], r["tokens_per_forward"])
    lens = [len(p) for p in prompts]
    print(f"model {args.model} ({args.dtype}), {len(prompts)} {args.dataset} prompts ({min(lens)}-{max(lens)} tokens), "
          f"{sum(len(o) for o in outs)} greedy tokens (eos {sorted(eos)} ends a row), ngram {args.ngram}, "
          f"max_new_tokens {args.max_new_tokens}")
    modeled = args.step_costs is not None
    print("| k | drafter | tokens/forward | x chain | drafts fed/step | proposer ms/step |" +
          (" modeled decode speed x greedy |" if modeled else ""))
    print("|---|---|---|---|---|---|" + ("---|" if modeled else ""))
    for r in rows:
        fed = "–" if r["drafts_per_step"] is None else f"{r['drafts_per_step']:.1f}"
        ms = "–" if r["propose_ms_per_step"] is None else f"{r['propose_ms_per_step']:.3f}"
        speed = f" {r['modeled_speed_vs_greedy']:.3f} |" if "modeled_speed_vs_greedy" in r else (" – |" if modeled else "")
        print(f"| {r['k']} | {r['drafter']} | {r['tokens_per_forward']:.3f} | {r['tokens_per_forward'] / chain[r['k']]:.3f} "
              f"| {fed} | {ms} |" + speed)
    if args.json:
        write_json(args.json, report("draft_replay", argv, args, args.device or "cpu", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
