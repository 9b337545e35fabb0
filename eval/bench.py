"""Throughput of hf_plookup against HF `generate`, measured side by side in one run, on CPU or CUDA.

Per model and batch size the variants (eval/lib/variants.py) run on the same prompts, interleaved
batch by batch in rotating order so drift in machine speed hits all of them alike; tok/s takes
each batch's fastest of --repeats passes:
  hf-greedy        HF generate, greedy, left-padded batch (the reference of every ratio)
  hf-pl-k{k}       HF's own prompt lookup (HF allows it at batch size 1 only)
  hf-static        HF generate(cache_implementation="static") with one max_cache_len for every call:
                   HF compiles its forward once, on CUDA; "× HF best" is against the faster of it
                   and hf-greedy
                   (the compiling first call is reported as first_call_s)
  hf-batch         HF continuous batching, model.generate_batch (paged attention, greedy, no
                   speculative decoding)
  plk-greedy       hf_plookup, plain batched greedy (wrap's defaults: attn_backend and compile
                   "auto", CUDA graphs on CUDA)
  plk-k{k}         hf_plookup with prompt lookup, prompt_lookup_num_tokens=k
  plk-k{k}-t{n}    the same with candidate trees of n nodes (--tree-nodes)
  plk-*-nocompile  plk-greedy and the first k with compile=False (CUDA graphs of the eager forward)
  plk-*-eager      the same with cuda_graphs=False, compile=False
A variant that runs out of memory at a batch size is reported as skipped, one that fails as an
error (the run goes on; the exit status is 1). Per hf_plookup variant also the median decode
step (1 token per sequence for greedy, k+1 for prompt lookup; device-synchronised around the
engine's forward) and, on CUDA, the GPU kernels one un-captured forward of that step launches;
per model its weight bytes, the measured copy bandwidth and the bound of a decode step that
reads every weight once; with --proposer-cost the numba proposer's time at batch 256 with
8k-token contexts.

Models (--model, one after another): an embedded alias (smollm2-135m, gemma3-270m), a hub id or
checkpoint directory, a .gguf file, or random:SHAPE, random weights of a real model's shape
(SHAPE: smollm2-135m, qwen3-0.6b, qwen3-1.7b, qwen3-8b, tiny-qwen3; no tokenizer, so synthetic
prompts). With random weights drafts are accepted as often as the random model repeats itself:
tokens/forward is reported, and step times are the portable result (a k+1-token verify step pays
off when tokens/forward exceeds its time over a 1-token step's). Defaults depend on --device:
the CPU ones give README's figures, the CUDA ones the four random shapes in bf16.

    python eval/bench.py --model smollm2-135m --batch-sizes 1 8 --k 4 10 --max-new-tokens 128
    python eval/bench.py --device cuda --model random:qwen3-8b --batch-sizes 1 16 64 --time-budget 540
    python eval/bench.py --device cuda --model shared/SmolLM2-135M-Instruct.Q4_1.gguf --batch-sizes 1 16 --k 4 8
    python eval/bench.py --smoke --json /tmp/bench.json     # every variant on a tiny random model, CPU, seconds
    python eval/bench.py --model smollm2-135m --quantization torchao-int8   # HF's quantizer at load, for every variant

--quantization NAME (eval/lib/quantization.py) quantizes each model at load with transformers' own
quantizer; the HF variants, hf-greedy the reference among them, run the same quantized model (its
own copy, as for a plain model), and the table's model column names the quantization.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch

import hf_plookup
from hf_plookup.engine.kv_cache import available_memory
from eval.lib.batching import left_pad, pad_id, workload
from eval.lib.calls import CallResult, run_hf, run_hf_generate_batch, run_plookup
from eval.lib.cli import DTYPES, INVARIANT, add_threads_option, default_device, default_model, parse_dtype, set_threads, show_defaults
from eval.lib.models import SHAPES, check_name, is_random, label, load_model
from eval.lib.quantization import add_quantization_option, check_option, copy_model, quantized_linears, weight_bytes
from eval.lib.prompts import builtin_prompts, dataset_prompts, plain_vocab, random_vocab, synthetic_prompts
from eval.lib.report import cell, report, write_json
from eval.lib.machine import rss_bytes
from eval.lib.timing import StepTimer, copy_bandwidth, count_kernels, top_kernels
from eval.lib.variants import ENGINE_OPTIONS, FAMILIES, HF_GREEDY, engine_of, k_of, tree_of, variant_names

# option -> (default on CPU, default on CUDA); None in the CPU column of `model`: the embedded default
DEVICE_DEFAULTS = {
    "model": (None, ["random:smollm2-135m", "random:qwen3-0.6b", "random:qwen3-1.7b", "random:qwen3-8b"]),
    "dtype": ("fp32", "bf16"),
    "batch_sizes": ([1, 4], [1, 16, 64]),
    "k": ([4, 10], [4, 8]),
    "prompt_len": (256, 512),
    "num_prompts": (8, None),  # None: the batch size, one batch of distinct prompts per batch size
    "max_new_tokens": (64, 128),
    "repeats": (1, 2),
    "variants": (["hf-greedy", "hf-pl", "plk-greedy", "plk"], list(FAMILIES)),
    "invariant": ("auto", "off"),
    "proposer_cost": (False, True),
}
# --smoke: the CUDA defaults (every variant family) on CPU with a tiny random model, in seconds,
# so their code paths run where no GPU is; these replace the CUDA defaults and any value given
SMOKE = dict(model=["random:tiny-qwen3"], dtype="fp32", batch_sizes=[1, 2], k=[4], prompt_len=36, max_new_tokens=8, repeats=1)
# warm-up calls generate this many tokens (a prefill and a few decode steps: lazy inits, compiles
# and graph captures of the first buckets stay out of the timed calls); hf-static, and hf_plookup
# on CUDA, warm up on the full length (HF compiles for its static cache's length, hf_plookup
# captures a graph per context bucket)
WARMUP_NEW_TOKENS = 4
# the baselines a variant is compared with: HF greedy with its dynamic cache, and HF's static cache
# (one fixed length for every call, so HF compiles its forward once): ratio_to_hf_best is against
# the faster of the two on the same batches, the peer a speed-minded HF user would pick
HF_BASELINES = ("hf-greedy", "hf-static")


def _defaults(name: str) -> str:
    """An option's help on its two defaults: "default: 1 4 on CPU, 1 16 64 on CUDA"."""
    shown = [" ".join(map(str, v)) if isinstance(v, list) else str(v) for v in DEVICE_DEFAULTS[name]]
    return f"default: {shown[0]} on CPU, {shown[1]} on CUDA"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--model", nargs="+", default=None,
                   help="models, one after another: embedded alias (gemma3-270m, smollm2-135m), HF id/path, .gguf file, or "
                        f"random:SHAPE ({', '.join(sorted(SHAPES))}) (default: the embedded default on CPU, "
                        f"{' '.join(DEVICE_DEFAULTS['model'][1])} on CUDA)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help=_defaults("dtype"))
    add_quantization_option(p)
    add_threads_option(p, "torch CPU threads (--smoke: 1)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=_defaults("batch_sizes"))
    p.add_argument("--k", type=int, nargs="+", default=None, help=f"prompt_lookup_num_tokens values ({_defaults('k')})")
    p.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size (HF's default: 2)")
    p.add_argument("--hf-pl-k", type=int, nargs="+", default=None,
                   help="the k values HF's own prompt lookup (hf-pl) runs with (default: every --k)")
    p.add_argument("--tree-nodes", type=int, nargs="*", default=[],
                   help="also run hf_plookup with candidate trees of these many nodes (prompt_lookup_tree_nodes) at every k")
    p.add_argument("--prompt-source", default="auto", choices=["auto", "builtin", "cnn_dailymail", "synthetic"],
                   help="builtin: summary requests for the builtin documents; cnn_dailymail: for the CNN/DailyMail "
                        "articles shipped in eval/data/ (news, of different lengths, cut to --max-doc-tokens); "
                        "synthetic: random token prompts with repeats; auto: builtin for a model with a tokenizer, "
                        "synthetic for random weights")
    p.add_argument("--max-doc-tokens", type=int, default=900,
                   help="cnn_dailymail: articles cut to their first this many tokens")
    p.add_argument("--prompt-len", type=int, default=None, help=f"tokens per synthetic prompt ({_defaults('prompt_len')})")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per batch size, at least the batch size (distinct where the source holds "
                        "enough; cycled when it does not); default: 8 on CPU, on CUDA the batch size")
    p.add_argument("--max-new-tokens", type=int, default=None, help=_defaults("max_new_tokens"))
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed passes over the prompts; tok/s takes the fastest pass of each batch ({_defaults('repeats')})")
    p.add_argument("--variants", nargs="+", default=None, choices=list(FAMILIES),
                   help="variant families to run, hf-greedy always: " + "; ".join(f"{k}: {v}" for k, v in FAMILIES.items())
                        + f" (default: {' '.join(DEVICE_DEFAULTS['variants'][0])} on CPU, all on CUDA)")
    p.add_argument("--attn-backend", default="auto", help="hf_plookup's attn_backend for the plk variants")
    p.add_argument("--invariant", default=None, choices=list(INVARIANT),
                   help="hf_plookup's invariant mode (wrap(invariant=...)): drafts change no token's arithmetic; CUDA "
                        f"graphs then need --attn-backend triton ({_defaults('invariant')})")
    p.add_argument("--proposer-cost", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the numba proposer at batch 256 with 8,192-token contexts (default: off on CPU, on on CUDA)")
    p.add_argument("--engine-cache", default="sized", choices=["sized", "wrap"],
                   help="the KV cache of the hf_plookup engines besides the default one: sized for the run's "
                        "prompts (sized), or as wrap sizes it by default, a share of free memory (wrap)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed passes, profile one call of each hf_plookup engine's greedy variant "
                        "(torch.profiler): its top GPU kernels and host ops by time, in the JSON")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; models and batch sizes not started by then are skipped (default: none)")
    p.add_argument("--json", default=None,
                   help="write the results here, after every batch size (default: none on CPU; on CUDA $OUT/bench.json "
                        "where $OUT is set, else results/bench.json)")
    p.add_argument("--smoke", action="store_true",
                   help="every variant family on a tiny random Qwen3 on CPU, fp32, a few tokens (seconds; for tests)")
    p.add_argument("--seed", type=int, default=0)
    return show_defaults(p)


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_option(p, args)
    if args.smoke:
        args.device = args.device or "cpu"
        args.threads = args.threads or 1
    args.device = args.device or default_device()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device (use --device cpu, or --smoke for every variant on a tiny model on CPU)")
    column = 1 if args.device.startswith("cuda") or args.smoke else 0
    for name, values in DEVICE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, copy.copy(values[column]))
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, copy.copy(value))
    if args.model is None:
        args.model = [default_model()]
    for name in ("max_new_tokens", "prompt_len", "repeats", "ngram", "max_doc_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if any(b < 1 for b in args.batch_sizes):
        p.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if any(k < 1 for k in args.k):
        p.error(f"--k values must be >= 1, got {args.k}")
    if any(n < 1 for n in args.tree_nodes):
        p.error(f"--tree-nodes must be >= 1, got {args.tree_nodes}")
    for name in args.model:
        if check_name(name):
            p.error(check_name(name))
        if args.prompt_source in ("builtin", "cnn_dailymail") and is_random(name):
            p.error(f"--prompt-source {args.prompt_source} needs a tokenizer, and {name} has none (random weights): "
                    "use synthetic")
    args.k = list(dict.fromkeys(args.k))
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    args.model = list(dict.fromkeys(args.model))
    if HF_GREEDY not in args.variants:
        args.variants = [HF_GREEDY] + args.variants
    if args.json is None and column == 1:
        args.json = os.path.join(os.environ["OUT"], "bench.json") if os.environ.get("OUT") else "results/bench.json"
    return args


# -- one batch size -------------------------------------------------------------------------------
def run_variant(name: str, model, engines: dict, batch: list[list[int]], pad: int, device, max_new_tokens: int,
                ngram: int, static_len: int | None = None) -> tuple[CallResult, list[tuple[int, float]], float | None]:
    """One timed call of variant `name` on `batch` (unpadded prompts): its result and, for
    hf_plookup, (tokens per sequence, seconds) of its decode steps that ran the whole batch and
    the seconds per decode step spent outside the forwards (StepTimer.outside_per_step).
    `static_len`: hf-static's cache length, the same for every call of the workload."""
    if name == "hf-batch":
        return run_hf_generate_batch(model, batch, max_new_tokens, pad), [], None
    ids, mask = left_pad(batch, pad, device)
    k = k_of(name)
    if name.startswith("plk"):
        with StepTimer(device) as timer:
            res = run_plookup(engines[engine_of(name)], ids, mask, max_new_tokens, k, ngram, pad, tree_of(name))
        return res, timer.decode_steps(len(batch)), timer.outside_per_step(res.seconds)
    static = name == "hf-static"
    hf = run_hf(model, ids, mask, max_new_tokens, k, ngram, pad, cache_implementation="static" if static else None,
                max_cache_len=static_len if static else None)
    return hf, [], None


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return "out of memory" in msg or "kv cache holds" in msg


def bench_batch_size(args, model, engines: dict, prompts: list[list[int]], pad: int, batch_size: int,
                     hf_skip: str | None = None) -> list[dict]:
    """Rows (one per variant) for one batch size. `model` runs the HF variants (a plain copy where
    `wrap` packed the engines' weights in place: `hf_model_for`)."""
    names = variant_names(args.variants, args.k, args.tree_nodes, batch_size, args.hf_pl_k)
    groups = workload(prompts, args.num_prompts or batch_size, batch_size)
    calls: list[dict] = []
    skipped: dict[str, str] = {n: hf_skip for n in names if hf_skip and n.startswith("hf")}
    errors: dict[str, str] = {}
    first: dict[str, float] = {}
    static_len = max(len(p) for g in groups for p in g) + args.max_new_tokens  # hf-static's one cache length

    def attempt(name, batch, max_new):
        try:
            return run_variant(name, model, engines, batch, pad, args.device, max_new, args.ngram, static_len)
        except Exception as e:  # keep measuring the other variants; the row says what happened
            if _is_oom(e):
                skipped[name] = f"out of memory at batch size {batch_size}: {str(e).splitlines()[0][:160]}"
            else:
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    first_paths: dict[str, dict | None] = {}
    for name in names:  # warm-up (not timed, but its time is reported: compiles, captures)
        if name in skipped:
            continue
        t0 = time.perf_counter()
        # on CUDA hf_plookup warms up on the full length too: its steps are captured (or compiled) per
        # context bucket, and a short warm-up would leave the longer contexts' buckets to the timed calls
        full = name == "hf-static" or (name.startswith("plk") and torch.device(args.device).type == "cuda")
        out = attempt(name, groups[0], args.max_new_tokens if full else WARMUP_NEW_TOKENS)
        first[name] = time.perf_counter() - t0
        first_paths[name] = _step_paths(out[0].stats) if out is not None else None
    for rep in range(args.repeats):
        for b, batch in enumerate(groups):
            shift = (rep * len(groups) + b) % len(names)
            results, steps, outside = {}, {}, {}
            for name in names[shift:] + names[:shift]:
                if name in skipped or name in errors:
                    continue
                out = attempt(name, batch, args.max_new_tokens)
                if out is not None:
                    results[name], steps[name], outside[name] = out
            reference = results.get(HF_GREEDY)
            for name, res in results.items():
                calls.append({
                    "variant": name, "batch": b, "repeat": rep, "seconds": res.seconds, "tokens": res.num_tokens,
                    "row_steps": res.row_steps, "forwards": res.forwards, "rows": len(res.tokens),
                    "rows_equal": None if reference is None else sum(x == y for x, y in zip(res.tokens, reference.tokens)),
                    "decode_steps": steps[name], "outside_step_s": outside[name],
                    "drafted": res.stats["drafted"] if res.stats else None,
                    "accepted": res.stats["accepted"] if res.stats else None,
                    "attn_backend": res.stats["attn_backend"] if res.stats else None,
                    "step_paths": _step_paths(res.stats),
                })
    rows = aggregate(calls, names, batch_size, skipped, errors, first)
    for r in rows:
        r["first_call_paths"] = first_paths.get(r["variant"])
    return rows


def _step_paths(stats: dict | None) -> dict | None:
    """How a call's steps ran (hf_plookup's SpecStats): decode steps by path, why any ran off the
    captured path, and the seconds it spent compiling and capturing new buckets."""
    if not stats:
        return None
    return {"decode_steps_by_path": stats["decode_steps_by_path"], "eager_reasons": stats["eager_reasons"],
            "prefill_forwards": stats["prefill_forwards"], "compile_s": stats["compile_time"],
            "capture_s": stats["capture_time"]}


def aggregate(calls: list[dict], names: list[str], batch_size: int, skipped: dict[str, str] | None = None,
              errors: dict[str, str] | None = None, first_calls: dict[str, float] | None = None) -> list[dict]:
    """One row per variant from its timed calls ({variant, batch, repeat, seconds, tokens,
    row_steps, forwards, rows, rows_equal}; hf_plookup's also decode_steps [(q, seconds)],
    outside_step_s, drafted, accepted, attn_backend).

    tokens_per_second counts, for every batch, the fastest of its repeats (best-of-N, the
    least disturbed estimate on a shared machine); tokens_per_second_mean uses all calls.
    The ratio to HF greedy compares best-of figures at the same batch size; decode_step_s is the
    median over the decode steps of those fastest calls."""
    skipped, errors, first_calls = skipped or {}, errors or {}, first_calls or {}
    fastest: dict[tuple[str, int], dict] = {}  # (variant, batch) -> its fastest call
    for c in calls:
        key = (c["variant"], c["batch"])
        if key not in fastest or c["seconds"] < fastest[key]["seconds"]:
            fastest[key] = c
    rows = []
    for name in names:
        mine = [c for c in calls if c["variant"] == name]
        best = {b: c for (v, b), c in fastest.items() if v == name}
        best_seconds = sum(c["seconds"] for c in best.values())
        best_tokens = sum(c["tokens"] for c in best.values())
        seconds = sum(c["seconds"] for c in mine)
        tokens = sum(c["tokens"] for c in mine)
        row_steps = sum(c["row_steps"] for c in mine)
        compared = [c for c in mine if c["rows_equal"] is not None]
        steps = [s for c in best.values() for s in c.get("decode_steps") or []]
        drafted = sum(c.get("drafted") or 0 for c in mine)
        rows.append({
            "batch_size": batch_size,
            "variant": name,
            "batches": sorted(best),
            "call_seconds": [round(c["seconds"], 4) for c in mine],
            "k": k_of(name),
            "skipped": skipped.get(name),
            "error": errors.get(name),
            "tokens_per_second": best_tokens / best_seconds if best_seconds > 0 else None,
            "tokens_per_second_mean": tokens / seconds if seconds > 0 else None,
            "ratio_to_hf_greedy": None,
            "ratio_to_hf_static": None,
            "ratio_to_hf_best": None,
            "tokens_per_forward": tokens / row_steps if row_steps else None,
            "latency_per_call_s": best_seconds / len(best) if best else None,
            "equal_to_hf_greedy": (sum(c["rows_equal"] for c in compared) / sum(c["rows"] for c in compared)) if compared else None,
            "new_tokens": tokens,
            "seconds": seconds,
            "forwards": sum(c["forwards"] for c in mine),
            "calls": len(mine),
            "first_call_s": first_calls.get(name),
            "decode_step_s": statistics.median(t for _, t in steps) if steps else None,
            # host seconds per decode step outside the forwards, the fastest calls' median
            "outside_step_s": statistics.median(outside) if (outside := [c["outside_step_s"] for c in best.values()
                                                                         if c.get("outside_step_s") is not None]) else None,
            "q": max(q for q, _ in steps) if steps else None,
            "kernels_per_step": None,
            "acceptance_rate": sum(c.get("accepted") or 0 for c in mine) / drafted if drafted else None,
            "attn_backend": next((c["attn_backend"] for c in mine if c.get("attn_backend")), None),
            "step_paths": _sum_paths([c.get("step_paths") for c in mine]),
        })
    # each variant against each HF baseline on the batches both ran, and against the faster one
    for r in rows:
        for base in HF_BASELINES:
            r["ratio_to_" + base.replace("-", "_")] = _ratio(fastest, r["variant"], base, r["batches"])
        ratios = [r["ratio_to_hf_greedy"], r["ratio_to_hf_static"]]
        r["ratio_to_hf_best"] = min((x for x in ratios if x is not None), default=None)
    return rows


def _ratio(fastest: dict[tuple[str, int], dict], name: str, base: str, batches: list[int]) -> float | None:
    """`name`'s tokens per second over `base`'s on the batches both ran (fastest calls), or None.

    Example: name ran batches 0 and 1 in 1 s each, base only batch 0 in 2 s, 10 tokens each call:
    on batch 0, 10 tok/s against 5: 2.0."""
    shared = [b for b in batches if (base, b) in fastest]
    if not shared:
        return None
    mine = [fastest[name, b] for b in shared]
    ref = [fastest[base, b] for b in shared]
    if not sum(c["seconds"] for c in mine) or not sum(c["seconds"] for c in ref):
        return None
    ref_rate = sum(c["tokens"] for c in ref) / sum(c["seconds"] for c in ref)
    return (sum(c["tokens"] for c in mine) / sum(c["seconds"] for c in mine)) / ref_rate


def _sum_paths(parts: list[dict | None]) -> dict | None:
    """The step paths of several calls (`_step_paths`), added up."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    out = {"decode_steps_by_path": {}, "eager_reasons": {}, "prefill_forwards": 0, "compile_s": 0.0, "capture_s": 0.0}
    for p in parts:
        for key in ("decode_steps_by_path", "eager_reasons"):
            for k, v in p[key].items():
                out[key][k] = out[key].get(k, 0) + v
        for key in ("prefill_forwards", "compile_s", "capture_s"):
            out[key] += p[key]
    return out


def step_kernels(engines: dict, name: str, batch: int, q: int | None, device) -> int | None:
    """GPU kernels one un-captured forward of the variant's decode step launches (its engine's
    bucketed step for `batch` sequences of q tokens; None off CUDA or when it has none)."""
    gr = engines[engine_of(name)]._engine._graphs
    if gr is None or q is None or torch.device(device).type != "cuda":
        return None
    from hf_plookup.steps.graphs import batch_bucket

    keys = [key for key in gr.graphs if key[0] == q and key[1] == batch_bucket(batch)]
    if not keys:
        return None
    return count_kernels(lambda: gr._forward(gr.graphs[max(keys)]), device)


# -- one model ------------------------------------------------------------------------------------
def hf_model_for(model, args, device, reload=None) -> tuple[object, str | None]:
    """The model HF's variants run (and why they cannot run, or None). On CPU `wrap` packs the linear
    weights of the modules it is given in place (cpu.packed_weight), and the engines here share
    `model`'s modules: HF's variants get a copy taken before, where two copies fit in memory;
    where they do not, no HF variant runs (eval/cpu_memory.py measures such models one after the other).
    The copy is a deep copy, or `reload()` (the same load again) for quantized weights that cannot
    be deep-copied (quantization.copy_model): a quantized model's HF variants run it quantized."""
    if device.type != "cpu" or not any(v.startswith("hf") for v in args.variants):
        return model, None
    need = weight_bytes(model)
    free = available_memory()
    if free is not None and need > 0.8 * free:
        return model, f"no memory for the plain copy HF's variants need ({need / 2**30:.1f} GiB of {free / 2**30:.1f})"
    return (copy.deepcopy(model) if reload is None else copy_model(model, reload)), None


def bench_model(args, name: str, on_rows=lambda rows: None, deadline: float = float("inf")) -> tuple[dict, list[dict]]:
    """One model's (info, rows). `on_rows(rows)` runs after every batch size with the rows so far
    (partial results survive a kill); batch sizes not started before `deadline` (perf_counter
    seconds) are skipped."""
    device = torch.device(args.device)
    tag = label(name)
    t0 = time.perf_counter()
    quantization = args.quantization
    model, tok = load_model(name, parse_dtype(args.dtype), device, args.seed, quantization)
    load_s = time.perf_counter() - t0
    stored_bytes = weight_bytes(model)  # quantized weights at their stored size
    bw = copy_bandwidth(device)
    pad = pad_id(model, tok)
    source = args.prompt_source if args.prompt_source != "auto" else ("synthetic" if tok is None else "builtin")
    n = max(args.num_prompts or 0, max(args.batch_sizes))  # distinct prompts for the largest batch too
    if source == "builtin":
        prompts = builtin_prompts(tok, n)
    elif source == "cnn_dailymail":
        prompts = dataset_prompts(tok, "cnn_dailymail", n, args.max_doc_tokens)
    else:
        vocab = plain_vocab(tok) if tok is not None else random_vocab(model.config.vocab_size)
        prompts = synthetic_prompts(vocab, n, args.prompt_len, args.seed)
    lens = [len(p) for p in prompts]

    inv = INVARIANT[args.invariant]
    hf_model, hf_skip = hf_model_for(model, args, device,
                                     lambda: load_model(name, parse_dtype(args.dtype), device, args.seed, quantization)[0])
    wanted = {engine_of(v) for b in args.batch_sizes
              for v in variant_names(args.variants, args.k, args.tree_nodes, b, args.hf_pl_k)} - {None}
    # the extra engines get a cache sized for the run: sized from free memory, as the default
    # engine's is on CUDA, each would take a share of what the others need
    need = max(args.batch_sizes) * (max(lens) + args.max_new_tokens + max(args.k) + 1)
    sized = args.engine_cache == "sized"
    options = {e: dict(o, max_cache_tokens=need + need // 4) if e != "default" and sized else o
               for e, o in ENGINE_OPTIONS.items()}
    # the compiled engines build the step buckets of this run's calls when wrapped (wrap(warmup=...)),
    # so that no timed call and no first call compiles; their wrap seconds say what that cost
    warm = {"max_batch_size": max(args.batch_sizes), "prompt_lookup_num_tokens": [0, args.k[0]],
            "max_length": max(lens) + args.max_new_tokens + max(args.k) + 1}
    for e in ("compiled", "compiled_nographs"):
        options[e] = dict(options[e], warmup=warm)
    rss_before, t0 = rss_bytes(), time.perf_counter()
    engines, wrap_by_engine = {}, {}
    for e in ENGINE_OPTIONS:
        if e in wanted:
            t = time.perf_counter()
            engines[e] = hf_plookup.wrap(copy.copy(model), attn_backend=args.attn_backend, invariant=inv, **options[e])
            wrap_by_engine[e] = time.perf_counter() - t
    wrap_s, rss_wrapped = time.perf_counter() - t0, rss_bytes()
    engine = engines["default"]._engine if "default" in engines else None
    info = {
        "model": tag, "name": name, "weights": "random" if is_random(name) else "pretrained", "dtype": args.dtype,
        "quantization": quantization, "quantized_linears": quantized_linears(model),
        "load_s": load_s, "num_params": sum(p.numel() for p in model.parameters()), "weight_bytes": stored_bytes,
        "copy_bandwidth_Bps": bw, "bandwidth_bound_step_s": stored_bytes / bw, "prompt_source": source, "prompt_tokens": lens,
        "attn_backend": engine.options.attn_backend if engine else None, "block_size": engine.options.block_size if engine else None,
        "cuda_graphs": engine.use_graphs if engine else None, "compile": engine.use_compile if engine else None,
        "wrap_s": wrap_s, "wrap_s_by_engine": wrap_by_engine, "rss_before_wrap": rss_before,
        "rss_after_wrap": rss_wrapped, "hf_variants_skipped": hf_skip,
        # wrap's note when it accepted the model on its quantized arithmetic's floor (docs/usage.md,
        # "Quantized models"): greedy may then part from HF's after a near-tie
        "exactness_note": engine.plan.exactness_note if engine else None,
    }
    quantized = f", quantized {quantization} ({info['quantized_linears']} linears)" if quantization else ""
    print(f"\n== {tag} ({info['weights']} weights, {info['num_params'] / 1e9:.2f}B params, {stored_bytes / 2**30:.2f} GiB), "
          f"{args.dtype}{quantized} on {device}, {torch.get_num_threads()} threads; {source} prompts (n={len(prompts)}, "
          f"{min(lens)}-{max(lens)} tokens), max_new_tokens {args.max_new_tokens}, ngram {args.ngram}, repeats {args.repeats}; "
          f"load {load_s:.1f}s; backend {info['attn_backend']} block {info['block_size']} graphs {info['cuda_graphs']} "
          f"compile {info['compile']}; copy {bw / 1e12:.3f} TB/s -> bound {1e3 * stored_bytes / bw:.2f} ms/step; wrap s "
          + ", ".join(f"{e} {t:.1f}" for e, t in wrap_by_engine.items()), flush=True)
    print(HEADER, flush=True)
    rows: list[dict] = []
    for bs in args.batch_sizes:
        if time.perf_counter() > deadline:
            row = {"model": tag, "quantization": quantization, "batch_size": bs, "variant": None,
                   "skipped": f"time budget {args.time_budget}s spent", "error": None}
            new = [row]
        else:
            new = [{"model": tag, "quantization": quantization, **r}
                   for r in bench_batch_size(args, hf_model, engines, prompts, pad, bs, hf_skip)]
            if "rss_after_first_batch" not in info:
                info["rss_after_first_batch"] = rss_bytes()
            for r in new:
                if r["variant"].startswith("plk") and r["q"] is not None:
                    r["kernels_per_step"] = step_kernels(engines, r["variant"], bs, r["q"], device)
        for r in new:
            print(format_row(r), flush=True)
        for r in new:
            if r.get("step_paths"):
                p, f = r["step_paths"], r.get("first_call_paths") or {}
                print(f"   {r['variant']}: decode steps {p['decode_steps_by_path']}"
                      + (f", eager because {p['eager_reasons']}" if p["eager_reasons"] else "")
                      + f"; timed calls compiled {p['compile_s']:.1f} s, captured {p['capture_s']:.1f} s; first call "
                        f"compiled {f.get('compile_s', 0):.1f} s, captured {f.get('capture_s', 0):.1f} s", flush=True)
        rows += new
        on_rows(rows)
    if args.profile:
        info["profiles"] = profiles(args, engines, prompts, pad, device)
    info["step_summary"] = step_summary(info, rows)
    for line in info["step_summary"]["lines"]:
        print(line, flush=True)
    gr = engine._graphs if engine else None
    info["graphs_captured"] = sorted(list(key) for key in gr.graphs) if gr is not None else []
    # what the default engine's uniform steps measured to cost, per (width, batch bucket): the
    # costs its verify steps chose their widths by (engine.widths)
    info["step_costs_s"] = ({f"width {q}, bucket {b}": s for (q, b), s in sorted(engine.step_costs.seconds.items())}
                            if engine else {})
    del engines, engine, gr, model, hf_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info, rows


def profiles(args, engines: dict, prompts: list[list[int]], pad: int, device) -> dict:
    """Each hf_plookup engine's greedy call on the first prompt, profiled after the timed passes
    (its buckets compiled and captured): where the call's time goes, GPU kernels and host ops."""
    out = {}
    ids, mask = left_pad(prompts[:1], pad, device)
    for e, wrapped in engines.items():
        print(f"profile: engine {e!r}", flush=True)
        out[e] = top_kernels(lambda w=wrapped: run_plookup(w, ids, mask, args.max_new_tokens, None, args.ngram, pad),
                             device)
        for line in out[e]["lines"]:
            print("  " + line, flush=True)
    return out


def step_summary(info: dict, rows: list[dict]) -> dict:
    """Per batch size: decode step times of greedy (1 token/seq) and prompt lookup (k+1) on the
    default engine, their ratio (the tokens/forward a verify step must reach to pay off), and the
    bandwidth bound."""
    by = {(r["batch_size"], r["variant"]): r for r in rows if r.get("decode_step_s")}
    out, lines = {}, []
    for batch in sorted({b for b, _ in by}):
        one = by.get((batch, "plk-greedy"), {}).get("decode_step_s")
        entry = {"step_1_s": one}
        parts = [f"{info['model']} batch {batch}: 1-token step {cell(None if one is None else 1e3 * one, '.2f')} ms"]
        for (b, v), r in sorted(by.items()):
            k = k_of(v)
            if b == batch and k and engine_of(v) == "default" and not tree_of(v):
                entry[f"step_{k + 1}_s"] = r["decode_step_s"]
                ratio = r["decode_step_s"] / one if one else None
                entry[f"ratio_{k + 1}"] = ratio
                parts.append(f"{k + 1}-token {1e3 * r['decode_step_s']:.2f} ms (x{cell(ratio, '.2f')})")
        out[batch] = entry
        lines.append(", ".join(parts) + f"; bandwidth bound {1e3 * info['bandwidth_bound_step_s']:.2f} ms")
    return {"per_batch": out, "lines": lines}


def proposer_cost(batch: int = 256, context: int = 8192, k: int = 8, calls: int = 20) -> dict:
    """Median seconds of one batched numba proposer call (contexts of repeated phrases)."""
    import numba

    from hf_plookup.drafting.ngram import NgramProposer

    rng = np.random.default_rng(0)
    phrases = rng.integers(3, 32000, size=(64, 16))
    hist = phrases[rng.integers(0, 64, size=(batch, context // 16))].reshape(batch, context)  # [B, L]
    lengths = np.full(batch, context, dtype=np.int64)
    prop = NgramProposer(k, 3)
    prop.propose(hist, lengths)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        prop.propose(hist, lengths)
        times.append(time.perf_counter() - t0)
    return {"batch": batch, "context": context, "k": k, "max_ngram": 3, "median_s": statistics.median(times),
            "min_s": min(times), "numba_threads": numba.get_num_threads()}


# -- the table -----------------------------------------------------------------------------------
HEADER = ("| model | batch | variant | tok/s | × HF greedy | × HF best | tokens/forward | = HF greedy | latency/call (s) "
          "| decode step ms (tokens/seq) | outside steps ms/step | kernels/step | first call s |\n"
          "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def format_row(r: dict) -> str:
    """One table row; a quantized model's cell names its quantization: "smollm2-135m torchao-int8"."""
    model = r.get("model", "") + (f" {r['quantization']}" if r.get("quantization") else "")
    head = f"| {model} | {r['batch_size']} | {r['variant'] or '–'} |"
    if r.get("skipped") or r.get("error"):
        what = f"skipped ({r['skipped'][:60]})" if r.get("skipped") else f"error ({r['error'][:100]})"
        return f"{head} {what} | | | | | | | | | |"
    step, outside = r.get("decode_step_s"), r.get("outside_step_s")
    return (f"{head} {cell(r['tokens_per_second'], '.1f')} | {cell(r['ratio_to_hf_greedy'], '.2f')} "
            f"| {cell(r.get('ratio_to_hf_best'), '.2f')} "
            f"| {cell(r['tokens_per_forward'], '.2f')} | {cell(r['equal_to_hf_greedy'], '.0%')} | {cell(r['latency_per_call_s'], '.2f')} "
            f"| {cell(None if step is None else 1e3 * step, '.2f')} ({cell(r.get('q'), 'd')}) "
            f"| {cell(None if outside is None else 1e3 * outside, '.2f')} | {cell(r.get('kernels_per_step'), 'd')} "
            f"| {cell(r.get('first_call_s'), '.1f')} |")


def format_table(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in rows])


def main(argv=None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    rows: list[dict] = []
    doc = report("bench", argv, args, args.device, rows, models=[])

    def save():
        doc["wall_s"] = time.perf_counter() - start
        if args.json:
            write_json(args.json, doc)

    if args.proposer_cost:
        doc["proposer"] = p = proposer_cost(*((8, 256) if args.smoke else ()))
        print(f"proposer: batch {p['batch']} x {p['context']} tokens, k={p['k']}: median {1e3 * p['median_s']:.2f} ms "
              f"({p['numba_threads']} numba threads)")
    deadline = start + args.time_budget if args.time_budget is not None else float("inf")
    for name in args.model:
        if time.perf_counter() > deadline:
            doc["models"].append({"model": label(name), "name": name, "skipped": f"time budget {args.time_budget}s spent"})
            continue
        done = len(rows)

        def partial(model_rows, done=done):
            rows[done:] = model_rows
            save()

        try:
            info, model_rows = bench_model(args, name, partial, deadline)
        except Exception as e:  # e.g. out of memory while loading: keep the other models' results
            traceback.print_exc()
            info = {"model": label(name), "name": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(f"{label(name)}: {info['error']}", flush=True)
        else:
            rows[done:] = model_rows
        doc["models"].append(info)
        save()
    save()
    failed = [r for r in rows if r.get("error")] + [m for m in doc["models"] if m.get("error")]
    print(f"\ntotal {doc['wall_s']:.1f}s" + (f"; wrote {args.json}" if args.json else "")
          + (f"; {len(failed)} failed (see error)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
