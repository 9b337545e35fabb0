"""Larger models on a CPU: what `wrap` costs in memory and time, and what it gains, one model at a time.

For a model that may not fit twice in memory (an 8B model in bf16 on 24 GiB), HF and hf_plookup
cannot run side by side on two copies, so this runs them one after the other on the same object in
one process: HF greedy first (a first call, then `--repeats` timed calls), then `wrap`, then
hf_plookup greedy and prompt lookup (a first call each, then timed calls), on the same prompts.
Reported per model: the weights' bytes, the process's resident memory (RSS) after loading, after
HF's calls, after `wrap` and after hf_plookup's first call; `wrap`'s seconds; tokens per second of
each variant and their ratios; hf_plookup's decode step against the bandwidth bound (the weights'
bytes over the machine's copy bandwidth); whether prompt lookup gave greedy's tokens.

    python eval/cpu_memory.py --model random:qwen3-1.7b --dtype bf16 --json out.json
    python eval/cpu_memory.py --model random:qwen3-8b --dtype bf16 --max-new-tokens 32
    python eval/cpu_memory.py --model random:qwen3-1.7b --dtype bf16 --quantization torchao-int8

With --quantization NAME (eval/lib/quantization.py) the model is quantized at load by transformers'
own quantizer; HF greedy runs that quantized model, then `wrap` wraps the same object. The weights'
bytes are then their stored size, the quantized weights' included.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_plookup  # noqa: E402
from eval.lib.calls import run_hf, run_plookup  # noqa: E402
from eval.lib.cli import DTYPES, parse_dtype, set_threads, show_defaults  # noqa: E402
from eval.lib.machine import machine_info, rss_bytes  # noqa: E402
from eval.lib.models import load_model  # noqa: E402
from eval.lib.quantization import add_quantization_option, check_option, quantized_linears, weight_bytes  # noqa: E402
from eval.lib.prompts import plain_vocab, random_vocab, synthetic_prompts  # noqa: E402
from eval.lib.timing import copy_bandwidth  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:qwen3-1.7b", help="random:SHAPE (eval/lib/models.py) or a model name")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    add_quantization_option(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=2, help="distinct prompts, each timed at batch 1")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens of the prompt-lookup variant")
    p.add_argument("--max-cache-tokens", type=int, default=2048, help="wrap(max_cache_tokens=...)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per prompt and variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return show_defaults(p)


def _timed(run, prompts, repeats: int) -> tuple[float, float, list]:
    """(first call's seconds, timed calls' tokens per second, each prompt's tokens)."""
    first = run(prompts[0]).seconds
    seconds = tokens = 0.0
    outs = []
    for _ in range(repeats):
        for p in prompts:
            res = run(p)
            seconds += res.seconds
            tokens += res.num_tokens
            outs.append(res.tokens)
    return first, tokens / seconds, outs


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_option(parser, args)
    set_threads(args.threads)
    device = torch.device("cpu")
    gib = 2**30
    t0 = time.perf_counter()
    model, tok = load_model(args.model, parse_dtype(args.dtype), device, args.seed, args.quantization)
    load_s = time.perf_counter() - t0
    weights = weight_bytes(model)  # quantized weights at their stored size
    quantized = quantized_linears(model)
    vocab = plain_vocab(tok) if tok is not None else random_vocab(model.config.vocab_size)
    prompts = synthetic_prompts(vocab, args.num_prompts, args.prompt_len, args.seed)
    batches = [torch.tensor([p]) for p in prompts]
    mask = [torch.ones_like(b) for b in batches]
    bw = copy_bandwidth(device)
    rss = {"loaded": rss_bytes()}
    what = f", quantized {args.quantization} ({quantized} linears)" if args.quantization else ""
    print(f"{args.model} {args.dtype}{what}: {weights / gib:.2f} GiB of weights, loaded in {load_s:.1f} s; "
          f"{torch.get_num_threads()} threads; copy {bw / 1e9:.1f} GB/s -> bound {1e3 * weights / bw:.1f} ms/token", flush=True)

    def hf(i):
        return run_hf(model, batches[i], mask[i], args.max_new_tokens)

    idx = list(range(len(prompts)))
    hf_first, hf_rate, hf_tokens = _timed(hf, idx, args.repeats)
    rss["after_hf"] = rss_bytes()
    print(f"HF greedy: first call {hf_first:.1f} s, {hf_rate:.2f} tok/s", flush=True)
    gc.collect()
    rss["before_wrap"] = rss_bytes()
    t0 = time.perf_counter()
    hf_plookup.wrap(model, max_cache_tokens=args.max_cache_tokens)
    wrap_s = time.perf_counter() - t0
    gc.collect()
    rss["after_wrap"] = rss_bytes()

    def plk(k):
        return lambda i: run_plookup(model, batches[i], mask[i], args.max_new_tokens, k)

    g_first, g_rate, g_tokens = _timed(plk(None), idx, args.repeats)
    rss["after_first_generate"] = rss_bytes()
    k_first, k_rate, k_tokens = _timed(plk(args.k), idx, args.repeats)
    step_s = 1.0 / g_rate  # batch 1 greedy: one token per decode step (prefill included, a small share)
    added = rss["after_first_generate"] - rss["before_wrap"]
    out = {
        "model": args.model, "dtype": args.dtype, "quantization": args.quantization, "quantized_linears": quantized,
        "exactness_note": model.last_stats.exactness_note if model.last_stats is not None else None,
        "machine": machine_info(device), "weight_bytes": weights,
        "load_s": load_s, "wrap_s": wrap_s, "rss_bytes": rss, "rss_added_by_wrap_and_first_generate": added,
        "rss_added_share_of_weights": added / weights, "copy_bandwidth_Bps": bw, "bandwidth_bound_step_s": weights / bw,
        "prompt_tokens": args.prompt_len, "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
        "hf_greedy": {"first_s": hf_first, "tok_per_s": hf_rate},
        "plk_greedy": {"first_s": g_first, "tok_per_s": g_rate, "x_hf": g_rate / hf_rate, "step_s": step_s,
                       "x_bound": step_s / (weights / bw), "tokens_equal_hf": g_tokens == hf_tokens},
        f"plk_k{args.k}": {"first_s": k_first, "tok_per_s": k_rate, "x_hf": k_rate / hf_rate,
                           "x_own_greedy": k_rate / g_rate, "tokens_equal_own_greedy": k_tokens == g_tokens},
    }
    print(f"wrap {wrap_s:.1f} s; RSS loaded {rss['loaded'] / gib:.2f} GiB, before wrap {rss['before_wrap'] / gib:.2f}, "
          f"after wrap {rss['after_wrap'] / gib:.2f}, after first generate {rss['after_first_generate'] / gib:.2f} "
          f"(+{added / gib:.2f} GiB = {100 * added / weights:.1f}% of the weights)", flush=True)
    print(f"hf_plookup greedy {g_rate:.2f} tok/s = {g_rate / hf_rate:.2f}x HF greedy (first call {g_first:.1f} s), "
          f"{1e3 * step_s:.1f} ms/token = {step_s * bw / weights:.2f}x the bound; tokens equal HF's: {g_tokens == hf_tokens}",
          flush=True)
    print(f"hf_plookup k={args.k} {k_rate:.2f} tok/s = {k_rate / hf_rate:.2f}x HF greedy, {k_rate / g_rate:.2f}x its "
          f"greedy; tokens equal its greedy's: {k_tokens == g_tokens}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
