"""Throughput and latency of hf_plookup against HF `generate`, measured in one run.

Variants, each at every `--batch-sizes` value (same prompts, same max_new_tokens):
  hf-greedy        HF generate, greedy, left-padded batch (the reference of every ratio)
  hf-pl-k{k}       HF's own prompt lookup (HF allows it at batch size 1 only)
  hf-batch         HF continuous batching, model.generate_batch (paged attention, greedy, no
                   speculative decoding; --variants hf-batch, off by default)
  plk-greedy       hf_plookup, plain batched greedy on the paged engine
  plk-k{k}         hf_plookup with prompt lookup, prompt_lookup_num_tokens=k
  plk-k{k}-t{n}    the same with candidate trees of n nodes (prompt_lookup_tree_nodes=n, --tree-nodes)
Variants run interleaved (batch by batch, in rotating order) so drift in machine speed hits
all of them alike. A variant that runs out of memory at a batch size is reported as skipped.

    python eval/bench.py --model smollm2-135m --batch-sizes 1 8 --k 4 10 --max-new-tokens 128
    python eval/bench.py --device cuda --dtype bf16 --batch-sizes 1 4 16 64 --json results/bench.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `eval.lib.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.lib import common  # noqa: E402

HF_GREEDY = "hf-greedy"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="embedded alias (gemma3-270m, smollm2-135m) or HF id/path (default: the embedded default)")
    p.add_argument("--dtype", default="fp32", choices=sorted(common.DTYPES))
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: 1 4 16 64 on GPU, 1 4 on CPU")
    p.add_argument("--k", type=int, nargs="+", default=[4, 10], help="prompt_lookup_num_tokens values")
    p.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size (HF's default: 2)")
    p.add_argument("--tree-nodes", type=int, nargs="*", default=[],
                   help="also run hf_plookup with candidate trees of these many nodes (prompt_lookup_tree_nodes) at every k")
    p.add_argument("--prompt-source", default="builtin", choices=["builtin", "synthetic"],
                   help="builtin: summarization prompts of the builtin documents; synthetic: random token prompts with repeats")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per synthetic prompt")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per batch size (cycled up to the batch size when fewer)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts; tok/s takes the fastest pass of each batch")
    p.add_argument("--variants", nargs="+", default=["hf-greedy", "hf-pl", "plk-greedy", "plk"],
                   choices=["hf-greedy", "hf-pl", "hf-batch", "plk-greedy", "plk"], help="which variant families to run (hf-greedy always runs)")
    p.add_argument("--invariant", default="auto", choices=list(common.INVARIANT),
                   help="hf_plookup's invariant mode (wrap(invariant=...)): drafts change no token's arithmetic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return common.show_defaults(p)


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "num_prompts", "prompt_len", "repeats", "ngram"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_sizes is not None and any(b < 1 for b in args.batch_sizes):
        p.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if any(k < 1 for k in args.k):
        p.error(f"--k values must be >= 1, got {args.k}")
    if args.model is None:
        args.model = common.default_model()
    if args.device is None:
        args.device = common.default_device()
    if args.batch_sizes is None:
        args.batch_sizes = [1, 4, 16, 64] if args.device.startswith("cuda") else [1, 4]
    args.k = list(dict.fromkeys(args.k))
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    if "hf-greedy" not in args.variants:
        args.variants = ["hf-greedy"] + args.variants
    return args


# -- prompts --------------------------------------------------------------------------------
def builtin_prompts(tokenizer, n: int) -> list[list[int]]:
    docs = common.load_jsonl(common.BUILTIN_PATH)
    chat = common.has_chat_template(tokenizer)
    return [common.encode_prompt(tokenizer, common.build_prompt(tokenizer, d["document"], chat), chat) for d in docs[:n]]


def synthetic_prompts(vocab_ids: list[int], n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens: random phrases (4-16 tokens) of which about half
    repeat an earlier phrase of the same prompt, so n-gram lookup has something to find."""
    if not vocab_ids:
        raise ValueError("synthetic_prompts: empty vocabulary")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks: list[int] = []
        phrases: list[list[int]] = []
        while len(toks) < length:
            if phrases and rng.random() < 0.5:
                phrase = rng.choice(phrases)
            else:
                phrase = [rng.choice(vocab_ids) for _ in range(rng.randint(4, 16))]
                phrases.append(phrase)
            toks.extend(phrase)
        out.append(toks[:length])
    return out


def plain_vocab(tokenizer, limit: int = 20000) -> list[int]:
    """Ordinary (non-special) token ids to draw synthetic prompts from."""
    special = set(tokenizer.all_special_ids)
    size = min(len(tokenizer), limit)
    return [i for i in range(size) if i not in special]


def workload(prompts: list[list[int]], num_prompts: int, batch_size: int) -> list[list[list[int]]]:
    """Batches of `batch_size` over max(num_prompts, batch_size) prompts (cycled)."""
    if not prompts:
        raise ValueError("no prompts")
    n = max(num_prompts, batch_size)
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return common.batches(cycled, batch_size)


def variant_names(args, batch_size: int) -> list[str]:
    names = [HF_GREEDY]
    if "hf-pl" in args.variants and batch_size == 1:
        names += [f"hf-pl-k{k}" for k in args.k]
    if "hf-batch" in args.variants:
        names.append("hf-batch")
    if "plk-greedy" in args.variants:
        names.append("plk-greedy")
    if "plk" in args.variants:
        names += [f"plk-k{k}" for k in args.k]
        names += [f"plk-k{k}-t{n}" for k in args.k for n in args.tree_nodes]
    return names


def _k_of(name: str) -> int | None:
    m = re.search(r"-k(\d+)", name)
    return int(m.group(1)) if m else None


def _tree_of(name: str) -> int | None:
    m = re.search(r"-t(\d+)$", name)
    return int(m.group(1)) if m else None


def run_variant(name: str, model, wrapped, batch: list[list[int]], pad: int, device, max_new_tokens: int, ngram: int) -> common.CallResult:
    if name == "hf-batch":
        return common.run_hf_generate_batch(model, batch, max_new_tokens, pad)
    ids, mask = common.left_pad(batch, pad, device)
    k = _k_of(name)
    if name.startswith("plk"):
        return common.run_plookup(wrapped, ids, mask, max_new_tokens, k, ngram, pad, _tree_of(name))
    return common.run_hf(model, ids, mask, max_new_tokens, k, ngram, pad)


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return "out of memory" in msg or "kv cache holds" in msg


def bench_batch_size(args, model, wrapped, prompts, pad: int, batch_size: int) -> list[dict]:
    """Rows (one per variant) for one batch size."""
    import torch

    names = variant_names(args, batch_size)
    groups = workload(prompts, args.num_prompts, batch_size)
    calls: list[dict] = []
    skipped: dict[str, str] = {}

    def attempt(name, batch, max_new):
        try:
            return run_variant(name, model, wrapped, batch, pad, args.device, max_new, args.ngram)
        except (RuntimeError, ValueError) as e:
            if not _is_oom(e):
                raise
            skipped[name] = f"out of memory at batch size {batch_size}: {str(e).splitlines()[0][:160]}"
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    for name in names:  # warm-up (not timed)
        attempt(name, groups[0], 2)
    for rep in range(args.repeats):
        for b, batch in enumerate(groups):
            shift = (rep * len(groups) + b) % len(names)
            results = {}
            for name in names[shift:] + names[:shift]:
                if name in skipped:
                    continue
                res = attempt(name, batch, args.max_new_tokens)
                if res is not None:
                    results[name] = res
            reference = results.get(HF_GREEDY)
            for name, res in results.items():
                calls.append({
                    "variant": name, "batch": b, "repeat": rep, "seconds": res.seconds, "tokens": res.num_tokens,
                    "row_steps": res.row_steps, "forwards": res.forwards, "rows": len(res.tokens),
                    "rows_equal": None if reference is None else sum(x == y for x, y in zip(res.tokens, reference.tokens)),
                })
    return aggregate(calls, names, batch_size, skipped)


def aggregate(calls: list[dict], names: list[str], batch_size: int, skipped: dict[str, str] | None = None) -> list[dict]:
    """One row per variant from its timed calls ({variant, batch, repeat, seconds, tokens,
    row_steps, forwards, rows, rows_equal}).

    tokens_per_second counts, for every batch, the fastest of its repeats (best-of-N, the
    least disturbed estimate on a shared machine); tokens_per_second_mean uses all calls.
    The ratio to HF greedy compares best-of figures at the same batch size."""
    skipped = skipped or {}
    rows = []
    for name in names:
        mine = [c for c in calls if c["variant"] == name]
        best: dict[int, dict] = {}
        for c in mine:
            if c["batch"] not in best or c["seconds"] < best[c["batch"]]["seconds"]:
                best[c["batch"]] = c
        best_seconds = sum(c["seconds"] for c in best.values())
        best_tokens = sum(c["tokens"] for c in best.values())
        seconds = sum(c["seconds"] for c in mine)
        tokens = sum(c["tokens"] for c in mine)
        row_steps = sum(c["row_steps"] for c in mine)
        compared = [c for c in mine if c["rows_equal"] is not None]
        rows.append({
            "batch_size": batch_size,
            "variant": name,
            "k": _k_of(name),
            "skipped": skipped.get(name),
            "tokens_per_second": best_tokens / best_seconds if best_seconds > 0 else None,
            "tokens_per_second_mean": tokens / seconds if seconds > 0 else None,
            "ratio_to_hf_greedy": None,
            "tokens_per_forward": tokens / row_steps if row_steps else None,
            "latency_per_call_s": best_seconds / len(best) if best else None,
            "equal_to_hf_greedy": (sum(c["rows_equal"] for c in compared) / sum(c["rows"] for c in compared)) if compared else None,
            "new_tokens": tokens,
            "seconds": seconds,
            "forwards": sum(c["forwards"] for c in mine),
            "calls": len(mine),
        })
    base = next((r for r in rows if r["variant"] == HF_GREEDY), None)
    if base and base["tokens_per_second"]:
        for r in rows:
            if r["tokens_per_second"]:
                r["ratio_to_hf_greedy"] = r["tokens_per_second"] / base["tokens_per_second"]
    return rows


def _f(x, spec) -> str:
    return "–" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    lines = ["| batch | variant | tok/s | × HF greedy | tokens/forward | = HF greedy | latency/call (s) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["skipped"]:
            lines.append(f"| {r['batch_size']} | {r['variant']} | skipped ({r['skipped'][:60]}) | | | | |")
            continue
        lines.append(
            f"| {r['batch_size']} | {r['variant']} | {_f(r['tokens_per_second'], '.1f')} | {_f(r['ratio_to_hf_greedy'], '.2f')} "
            f"| {_f(r['tokens_per_forward'], '.2f')} | {_f(r['equal_to_hf_greedy'], '.0%')} | {_f(r['latency_per_call_s'], '.2f')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    import torch

    import hf_plookup

    common.set_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, tokenizer = common.load_model(args.model, common.parse_dtype(args.dtype), args.device)
    load_seconds = time.perf_counter() - t0
    wrapped = hf_plookup.wrap(copy.copy(model), invariant=common.INVARIANT[args.invariant])
    pad = common.pad_id(model, tokenizer)
    if args.prompt_source == "builtin":
        prompts = builtin_prompts(tokenizer, args.num_prompts)
    else:
        prompts = synthetic_prompts(plain_vocab(tokenizer), args.num_prompts, args.prompt_len, args.seed)

    from tqdm.auto import tqdm

    rows = []
    for bs in tqdm(args.batch_sizes, desc="batch sizes"):
        rows += bench_batch_size(args, model, wrapped, prompts, pad, bs)
    table = format_table(rows)
    wall = time.perf_counter() - t_start
    lens = [len(p) for p in prompts]
    print()
    print(f"model {args.model} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads), {args.prompt_source} prompts "
          f"(n={len(prompts)}, {min(lens)}-{max(lens)} tokens), max_new_tokens {args.max_new_tokens}, ngram {args.ngram}, "
          f"repeats {args.repeats}; load {load_seconds:.1f}s, total {wall:.1f}s")
    print(table)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "config": vars(args), "machine": common.machine_info(args.device), "prompt_tokens": lens,
            "model_load_seconds": load_seconds, "wall_seconds": wall, "rows": rows,
        }, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
