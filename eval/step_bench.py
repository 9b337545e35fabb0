"""One decode/verify step of hf_plookup, timed per execution mode: what a k+1-token verify step
costs against a 1-token step, eager vs compiled vs CUDA graphs, and HF's compiled static-cache
forward beside it. Random weights of the real shapes (eval/lib/models.py's SHAPES): step times
do not depend on weight values.

Per model, batch size and tokens per sequence q (1 = plain decode, k+1 = verify), each mode
runs the engine's step over B sequences of --context cached tokens (pages filled with random
keys/values):
  eager            the step as the engine runs it without compile or graphs (steps.runner.
                   ModelRunner, every CPU step by default): no padding to buckets
  (the other modes run the bucketed step, steps.graphs.GraphRunner, on static buffers)
  compiled         torch.compile(fullgraph=True) of that forward (inductor; on CPU with freezing)
  graphs           eager forward captured in a CUDA graph (CUDA only)
  compiled+graphs  compiled forward captured in a CUDA graph (CUDA only; compile=True's path)
  hf-static        (--hf-static) HF's own forward over its StaticCache, torch.compile
                   mode="reduce-overhead", fullgraph=True, after a --context-token prefill
  /regional, /whole  what a compiled mode compiles: one decoder layer reused for every layer
                   (steps.regional; what captured steps run) or the whole forward as one graph
                   (uncaptured steps); --both-scopes times each compiled mode with the other too
  <mode>+invariant (--invariant) each mode again in invariant mode (wrap(invariant=True)); graph
                   modes on attn_backend triton only (sdpa's invariant form is not captured)
  kernels/...      (--kernels, CPU) the C linear and attention kernels alone, each from memory
                   and from cache in the same rounds: which of them wait on memory, which on the core,
                   and their multiply-adds a second against the fp32 GEMM's (the compute bound's rate)
Above the rows: the bandwidth bound (the weights' bytes at the copy and read bandwidth, both over buffers past
the last-level cache) and, on CPU,
the compute bound (the step's multiply-adds, step_macs, at the rate of an fp32 GEMM from cache).
First calls (compile, capture) are reported apart from the median of --iters timed calls, the q values
taking turns (one call each per round), and each q's ratio to the smallest q as the median of the rounds'. On
CUDA also the GPU kernels one un-captured forward launches (torch.profiler).

    python eval/step_bench.py --device cpu --dtype fp32 --models smollm2-135m --threads 2
    python eval/step_bench.py --models smollm2-135m qwen3-8b --batch-sizes 1 16 64 --hf-static
    python eval/step_bench.py --models smollm2-135m --q 1 5 9 --modes eager compiled+graphs --attn-backends triton --invariant
    python eval/step_bench.py --device cpu --dtype bf16 --modes eager --invariant --threads 2 --kernels
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eval.lib.cli import DTYPES, add_threads_option, show_defaults
from eval.lib.models import SHAPES, random_model
from eval.lib.report import report, write_json
from eval.lib.timing import copy_bandwidth, count_kernels, gemm_rate, interleaved, read_bandwidth, sync, timed, top_kernels
from hf_plookup.base.layout import StepLayout
from hf_plookup.attention.ops import COMPILABLE_BACKENDS
from hf_plookup.attention.registry import register
from hf_plookup.steps.graphs import GraphRunner, batch_bucket, context_bucket
from hf_plookup.cpu import huge_pages
from hf_plookup.cpu.huge_pages import to_huge_pages
from hf_plookup.cpu.packed_weight import pack_linears
from hf_plookup.engine.engine import EngineOptions
from hf_plookup.engine.kv_cache import PagedKVCache, default_num_tokens, layer_specs
from hf_plookup.steps.runner import ModelRunner

MODES = ("eager", "compiled", "graphs", "compiled+graphs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m"], choices=sorted(SHAPES))
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--q", type=int, nargs="+", default=[1, 5, 9], help="tokens per sequence of a step (k + 1)")
    p.add_argument("--context", type=int, default=700, help="cached tokens per sequence before the step")
    p.add_argument("--modes", nargs="+", default=None, choices=MODES,
                   help="default: eager compiled on CPU; all four on CUDA")
    p.add_argument("--hf-static", action="store_true", help="also time HF's compiled static-cache forward")
    p.add_argument("--both-scopes", action="store_true",
                   help="also time compiled modes with the other compile scope: '<mode>/whole' beside "
                        "'compiled+graphs/regional', '<mode>/regional' beside 'compiled/whole'")
    p.add_argument("--invariant", action="store_true",
                   help="also time each mode in invariant mode (invariant.linears), as '<mode>+invariant'")
    p.add_argument("--breakdown", action="store_true",
                   help="also split the eager invariant step's time by kind of work (CPU): the C kernels, the "
                        "linears' Python path, norms, the rest of the forward, and the drafter and greedy "
                        "sampling that run between steps")
    p.add_argument("--small-pages", action="store_true",
                   help="CPU: also time the eager invariant step with a copy of the weights on the allocator's own "
                        "pages beside the engine's 2 MB pages (cpu.huge_pages), in the same rounds")
    p.add_argument("--kernels", action="store_true",
                   help="CPU: also time the C kernels alone per q, each from memory (every layer's own weights "
                        "and pages) and from cache (the first layer's, for every layer), in the same rounds: "
                        "which of a step's kernels wait on memory and which on the core")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: with each row, the GPU kernels that take most of one un-captured forward's time "
                        "(torch.profiler), printed and in the JSON: where a step's time goes past the bound")
    p.add_argument("--attn-backends", nargs="+", default=["sdpa"], choices=["sdpa", "triton", "flash_attn", "flash_attn4"],
                   help="each mode runs once per backend")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-tokens", default=None,
                   help="the KV cache's capacity in tokens, or 'auto': as wrap sizes it by default (a share of free "
                        "memory); default: just the pages the steps use")
    p.add_argument("--iters", type=int, default=20, help="timed calls per (mode, batch, q); the median counts")
    add_threads_option(p)
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/step_bench.json, else results/step_bench.json)")
    p.add_argument("--seed", type=int, default=0)
    return show_defaults(p)


def step_plan(num_seqs: int, q: int, context: int, block_size: int, vocab: int = 1000) -> StepLayout:
    """A uniform decode step: sequence i has `context` cached tokens in its own pages
    (1 + i*W ... ; page 0 stays unused) and feeds q tokens."""
    ctx = context + q
    w = -(-ctx // block_size)
    tables = 1 + np.arange(num_seqs * w, dtype=np.int64).reshape(num_seqs, w)
    key_pos = np.arange(ctx)
    kv_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size
    pos = np.tile(np.arange(context, ctx), num_seqs)
    rng = np.random.default_rng(q)
    return StepLayout(
        input_ids=rng.integers(3, vocab, size=num_seqs * q), positions=pos, depth=np.tile(np.arange(q), num_seqs),
        slot_mapping=kv_slots[:, context:].reshape(-1), keep=np.arange(num_seqs * q),
        prefill=np.zeros(num_seqs, dtype=bool), query_pos=np.tile(np.arange(context, ctx), (num_seqs, 1)),
        kv_slots=kv_slots, context_lens=np.full(num_seqs, ctx), block_tables=tables,
        cu_seqlens_q=np.arange(num_seqs + 1) * q, cu_seqlens_k=np.arange(num_seqs + 1) * ctx,
    )


def layer_linears(model) -> list[list[torch.nn.Linear]]:
    """Each decoder layer's linears (a step's `linear` kernel calls, the LM head aside)."""
    return [[m for m in la.modules() if isinstance(m, torch.nn.Linear)] for la in model.model.layers]


def step_macs(model, batch: int, q: int, context: int) -> dict[str, int]:
    """Multiply-adds of a step of `batch` sequences of `context` cached tokens feeding q tokens each,
    by part: the decoder layers' linears, the LM head (every token's logits, as a verify step keeps
    them) and the attention (token t of q sees context + t + 1 keys, or its layer's sliding window:
    a query . key and a weight x value row each). SmolLM2 at q = 9 over 700 tokens: 955.5 M, 254.8 M and 219.3 M.

    Example (a Llama of one layer, hidden 8, 2 heads of head_dim 4 on one KV head, intermediate 16,
    vocab 10; batch 1, q 2, context 3): linears 2 x (2 x 8 x 8 + 2 x 8 x 4 + 3 x 8 x 16) = 1,152; LM head
    2 x 8 x 10 = 160; attention 2 heads x (4 + 5 keys) x (4 + 4) = 144."""
    cfg = model.config
    layers = model.model.layers
    rows = batch * q
    lin = rows * sum(m.in_features * m.out_features for ms in layer_linears(model) for m in ms)
    head = model.get_output_embeddings()
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers)
    window = getattr(cfg, "sliding_window", None)
    attn = 0
    for kind in kinds:
        for t in range(q):
            keys = context + t + 1
            attn += batch * heads * 2 * d * (min(keys, window) if kind == "sliding_attention" and window else keys)
    return {"linears": lin, "LM head": rows * head.in_features * head.out_features, "attention": attn}


def c_layers_of(model, inv):
    """The C decoder layers the engine gives invariant decode steps (steps.c_layers), or None."""
    from hf_plookup.steps.c_layers import CpuLayers

    return CpuLayers.of(model, inv.forms) if inv is not None else None


def eager_runner(model, cache, backend: str, inv) -> ModelRunner:
    """The engine's eager step runner for `model` (`inv`: its InvariantLinears, or None)."""
    return ModelRunner(model, cache, backend, invariant=inv, c_layers=c_layers_of(model, inv))


def bench_mode(model, mode: str, backend: str, args, device, cache: PagedKVCache, invariant: bool = False,
               swap_scope: bool = False) -> list[dict]:
    """`mode`'s step on `backend` at every batch size and q; `invariant`: in invariant mode
    (invariant.linears; the mode is then named `<mode>+invariant`). Compiled modes are named
    `<mode>/regional` (one decoder layer compiled for all, steps.regional: what captured steps
    run) or `<mode>/whole` (the whole forward as one graph: uncaptured steps); `swap_scope`: the
    scope the engine would not use for the mode."""
    from hf_plookup.invariant.linears import InvariantLinears

    capture, compiled = "graphs" in mode, "compiled" in mode
    regional = capture != swap_scope
    inv = InvariantLinears(model) if invariant else None
    if capture or compiled:
        gr = GraphRunner(model, cache, backend, max(args.batch_sizes), capture=capture, compiled=compiled,
                         invariant=inv, regional=regional, c_layers=c_layers_of(model, inv))
        run = gr.run
    else:
        gr, run = None, eager_runner(model, cache, backend, inv).run
    mode = mode + "+invariant" if invariant else mode
    mode = mode + ("/regional" if regional else "/whole") if compiled else mode
    rows = []
    for b in args.batch_sizes:
        plans, firsts = {}, {}
        for q in args.q:
            plans[q] = step_plan(b, q, args.context, args.block_size, model.config.vocab_size)
            t0 = time.perf_counter()
            run(plans[q])  # compile / capture
            sync(device)
            firsts[q] = time.perf_counter() - t0
        # the q values take turns, one call each per round, so that a neighbour's load on a shared
        # machine falls on all of them alike; a q's ratio to the smallest q is the median of the rounds'
        times = interleaved({q: (lambda p=plans[q]: run(p)) for q in args.q}, device, args.iters)
        q0 = min(args.q)
        for q in args.q:
            plan, step = plans[q], statistics.median(times[q])
            ratio = statistics.median(t / t0 for t, t0 in zip(times[q], times[q0]))
            row = {"mode": mode, "attn_backend": backend, "batch": b, "q": q, "step_s": step,
                   f"vs_q{q0}": ratio, "first_call_s": firsts[q], "kernels": None}
            if device.type == "cuda":
                if gr is None:
                    forward = lambda p=plan: run(p)  # noqa: E731
                else:
                    key = (plan.max_query_len, batch_bucket(b), context_bucket(plan.max_context_len, args.block_size),
                           plan.tree_mask is not None)  # GraphRunner.run's key
                    forward = lambda k=key: gr._forward(gr.graphs[k])  # noqa: E731
                if args.profile:
                    with torch.inference_mode():
                        prof = top_kernels(forward, device, n=8)
                    row["kernels"], row["profile"] = prof["kernels"], {"device_s": prof["device_s"],
                                                                       "device_top": prof["device_top"]}
                else:
                    row["kernels"] = count_kernels(forward, device)
            rows.append(row)
            kernels = row["kernels"]
            print(f"  {mode + '/' + backend:22s} batch {b:3d} q {q:2d}: {1e3 * step:8.2f} ms  {ratio:5.2f}x q {q0}  "
                  f"(first call {firsts[q]:6.1f} s" + (f", {kernels} kernels)" if kernels is not None else ")"), flush=True)
            if "profile" in row:
                for name, seconds, calls in row["profile"]["device_top"]:
                    print(f"      {1e3 * seconds:8.3f} ms {calls:5d}x  {name}", flush=True)
    return rows


def bench_pages(model, args, device, cache: PagedKVCache) -> list[dict]:
    """The eager invariant step (what wrap runs on CPU) with the weights on 2 MB pages, as the engine
    moves them (cpu.huge_pages), and with a deep copy of them on the allocator's own pages: each
    round runs every q on both (the first batch size). Rows "eager+invariant/<pages>", and each q's
    time over its time on 2 MB pages (the median of the rounds')."""
    from hf_plookup.invariant.linears import InvariantLinears

    small = copy.deepcopy(model)  # new storages from torch's allocator
    runs = {pages: eager_runner(m, cache, "sdpa", InvariantLinears(m)).run
            for pages, m in (("2M-pages", model), ("small-pages", small))}
    b = args.batch_sizes[0]
    plans = {q: step_plan(b, q, args.context, args.block_size, model.config.vocab_size) for q in args.q}
    fns = {(pages, q): (lambda r=run, p=plan: r(p)) for pages, run in runs.items() for q, plan in plans.items()}
    for fn in fns.values():
        fn()  # first calls (the C layers' check)
    times = interleaved(fns, device, args.iters)
    rows = []
    for q in plans:
        for pages in runs:
            step = statistics.median(times[pages, q])
            ratio = statistics.median(t / t2 for t, t2 in zip(times[pages, q], times["2M-pages", q]))
            rows.append({"mode": f"eager+invariant/{pages}", "attn_backend": "sdpa", "batch": b,
                         "q": q, "step_s": step, "vs_2M_pages": ratio})
            print(f"  eager+invariant/{pages:11s} batch {b:3d} q {q:2d}: {1e3 * step:8.2f} ms  "
                  f"{ratio:5.2f}x 2 MB pages", flush=True)
    return rows


def bench_kernels(model, args, device, cache: PagedKVCache, macs: dict, rate: float) -> list[dict]:
    """The CPU kernels of a step alone, per q (the first batch size): the decoder layers' linears
    (the `linear` kernel on each weight, batch x q rows) and the attention (`cpu_kernels.attend`,
    each layer's pages, batch x q tokens over --context cached ones), each run over every layer's
    own weights and pages ("memory": the weights stream from DRAM, as in a step) and over the first
    layer's, once per layer ("cache": they stay in L2/L3), all in the same rounds. A kernel that
    takes about as long from cache waits on the core's work, not on memory. Rows "kernels/<kind>/
    <memory|cache>" with each q's ratio to the smallest q's, and "vs_cache", from the same rounds, and
    "of_gemm": the kernel's multiply-adds a second (`macs`, from step_macs) over `rate`, the fp32
    GEMM's (what share of the cores' arithmetic it gets)."""
    from hf_plookup.invariant.attention import build_layout
    from hf_plookup.cpu import kernels as cpu_kernels

    layers = model.model.layers
    weights = [[m.weight for m in ms] for ms in layer_linears(model)]
    pages = [cache.layer(la.self_attn.layer_idx) for la in layers]
    cfg = model.config
    heads, head_dim = cfg.num_attention_heads, pages[0][0].shape[-1]  # (the pages' [blocks, block, H_kv, D])
    sets = {"memory": (weights, pages), "cache": ([weights[0]] * len(layers), [pages[0]] * len(layers))}
    b, gen = args.batch_sizes[0], torch.Generator().manual_seed(args.seed)
    fns = {}
    for q in args.q:
        plan = step_plan(b, q, args.context, args.block_size, cfg.vocab_size)
        runs = build_layout(plan, device).decode_runs(None)
        kv_slots = np.ascontiguousarray(plan.kv_slots, dtype=np.int64)
        xs = {w.shape[1]: torch.randn(b * q, w.shape[1], generator=gen).to(w.dtype) for w in weights[0]}
        outs = {w.shape[0]: torch.empty(b * q, w.shape[0], dtype=w.dtype) for w in weights[0]}
        qs = torch.randn(b * q, heads, head_dim, generator=gen).to(pages[0][0].dtype)
        for where, (ws, ps) in sets.items():
            # the C entry point with its arguments made beforehand, as the C layers call it (on the packed
            # weights, which cpu_kernels.packed keeps): the Python wrapper's own cost per call would weigh
            # alike on both sets and blur their ratio (the lambda holds xs and outs, whose memory the
            # pointers name)
            calls = [(xs[w.shape[1]].data_ptr(), b * q, cpu_kernels.packed(w).data_ptr(), cpu_kernels.weight_kind(w), w.shape[1], None, w.shape[0],
                      outs[w.shape[0]].data_ptr(), w.dtype == torch.bfloat16, cpu_kernels.threads())
                     for l in ws for w in l]
            fns["linears", where, q] = lambda calls=calls, held=(xs, outs): [cpu_kernels._LIB.linear(*c) for c in calls]
            fns["attention", where, q] = lambda ps=ps, qs=qs, runs=runs, kv_slots=kv_slots: [
                cpu_kernels.attend(qs, k, v, kv_slots, *runs, head_dim ** -0.5, None) for k, v in ps]
    for fn in fns.values():
        fn()
    times = interleaved(fns, device, args.iters)
    q0, rows = min(args.q), []
    for kind, where, q in ((kind, where, q) for kind in ("linears", "attention") for where in sets for q in args.q):
        ts = times[kind, where, q]
        row = {"mode": f"kernels/{kind}/{where}", "batch": b, "q": q, "step_s": statistics.median(ts),
               f"vs_q{q0}": statistics.median(t / t0 for t, t0 in zip(ts, times[kind, where, q0])),
               "vs_cache": statistics.median(t / c for t, c in zip(ts, times[kind, "cache", q])),
               "of_gemm": macs[q][kind] / statistics.median(ts) / rate}
        rows.append(row)
        print(f"  {row['mode']:24s} batch {b:3d} q {q:2d}: {1e3 * row['step_s']:8.2f} ms  "
              f"{row[f'vs_q{q0}']:5.2f}x q {q0}  {row['vs_cache']:5.2f}x from cache  "
              f"{macs[q][kind] / row['step_s'] / 1e9:6.1f} GMAC/s ({100 * row['of_gemm']:3.0f}% of the GEMM's)", flush=True)
    return rows


class _Timer:
    """Inclusive wall time of calls of `fn` (a drop-in wrapper), summed."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total += time.perf_counter() - t0


def breakdown(model, args, device, cache: PagedKVCache) -> list[dict]:
    """Where a CPU step's time goes, eager invariant mode (what wrap runs on CPU), per batch and q.
    A Llama-form model's decode steps run in C (steps.c_layers): the layers' linears (q/k/v,
    o_proj, gate/up, down, as the C code times its phases), the attention kernel, the layers' other
    C work (norms, RoPE, KV writes, residuals), the activation (torch), the final norm and LM head,
    and the rest (Python, embedding, rotary tables, the step's layout). Other models run HF's modules:
    the linear and attention kernels (cpu.kernels), the linears' Python path around the kernel,
    RMS/layer norms (the C kernel where invariant mode routes them, else HF's modules) and the rest
    of the forward. Both: per step of generation the n-gram drafter (k=q-1 over --context tokens of
    history) and greedy sampling (argmax of the q kept rows). Timers wrap the calls, so the step is a
    little slower here than in the table above."""
    from hf_plookup.drafting.ngram import NgramProposer
    from hf_plookup.cpu import kernels as cpu_kernels
    from hf_plookup.steps import c_layers
    from hf_plookup.invariant import linears as inv_mod
    from hf_plookup.invariant.linears import InvariantLinears

    inv = InvariantLinears(model)
    runner = eager_runner(model, cache, "sdpa", inv)  # the engine's eager step
    # norms: those invariant mode routes to cpu_kernels.rms_norm are timed through their routed
    # forward (inv.forwards), the others through their own
    is_linear = [type(m) is torch.nn.Linear for m in inv.modules]
    norms = [m for m in model.modules() if "norm" in type(m).__name__.lower() and m not in inv.modules]
    layers = runner.forward.c_layers
    acts = layers.acts if layers is not None else []
    rows = []
    lin_k, att_k = cpu_kernels.linear, cpu_kernels.attend
    try:
        cpu_kernels.linear, cpu_kernels.attend = _Timer(lin_k), _Timer(att_k)
        inv_mod.KERNELS["cpu"] = (inv_mod.KERNELS["cpu"][0], cpu_kernels.linear)
        inv.forwards = [_Timer(f) for f in inv.forwards]
        norm_t = {}
        for m in norms:
            norm_t[m] = _Timer(m.forward)
            m.forward = norm_t[m]
        act_t = {}
        for m in acts:
            act_t.setdefault(m, _Timer(m.forward))
            m.forward = act_t[m]
        for b in args.batch_sizes:
            for q in args.q:
                plan = step_plan(b, q, args.context, args.block_size, model.config.vocab_size)
                runner.run(plan)
                timers = [cpu_kernels.linear, cpu_kernels.attend, *inv.forwards, *norm_t.values(), *act_t.values()]
                for t in timers:
                    t.total = 0.0
                c_path = layers is not None and layers.on
                if c_path:
                    c_layers.layer_phases(True)
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    logits = runner.run(plan)
                step = (time.perf_counter() - t0) / args.iters
                lin = cpu_kernels.linear.total / args.iters
                att = cpu_kernels.attend.total / args.iters
                if c_path:
                    phases = {k: v / args.iters for k, v in c_layers.layer_phases(False).items()}
                    part = {"layers' linears": sum(v for k, v in phases.items() if k in ("q/k/v", "o_proj", "gate/up", "down")),
                            "attention kernel": phases["attention"],
                            "layers' norms, RoPE, KV writes, residuals": phases["norms, RoPE, KV writes, residuals"],
                            "activation": sum(t.total for t in act_t.values()) / args.iters,
                            "LM head": lin}
                    part["rest (Python, embedding, rotary, layout, final norm)"] = step - sum(part.values())
                    part.update({f"  {k}": v for k, v in phases.items() if k in ("q/k/v", "o_proj", "gate/up", "down")})
                else:
                    lin_py = sum(f.total for f, li in zip(inv.forwards, is_linear) if li) / args.iters - lin
                    nrm = (sum(t.total for t in norm_t.values())
                           + sum(f.total for f, li in zip(inv.forwards, is_linear) if not li)) / args.iters
                    part = {"linear kernel": lin, "attention kernel": att, "linears' Python path": lin_py, "norms": nrm,
                            "rest of the forward": step - lin - att - lin_py - nrm}
                hist = np.random.default_rng(0).integers(3, 1000, size=(b, args.context))
                prop = NgramProposer(max(q - 1, 1))
                lengths = np.full(b, args.context)
                draft = timed(lambda: prop.propose(hist, lengths), device, args.iters)
                # as the engine samples greedily (batch._targets): argmax of the logits as fp32 scores
                sample = timed(lambda: logits.float().argmax(-1).cpu().numpy(), device, args.iters)
                part.update({"drafter": draft, "greedy sampling": sample})
                rows.append({"mode": "breakdown", "batch": b, "q": q, "step_s": step, "c_layers": c_path,
                             "parts_s": part})
                print(f"  breakdown batch {b:3d} q {q:2d} ({'C layers' if c_path else 'modules'}): step "
                      f"{1e3 * step:7.2f} ms = "
                      + ", ".join(f"{k.strip()} {1e3 * v:.2f}" for k, v in part.items()
                                  if k not in ("drafter", "greedy sampling") and not k.startswith(" "))
                      + (" (linears: " + ", ".join(f"{k.strip()} {1e3 * v:.2f}" for k, v in part.items()
                                                   if k.startswith(" ")) + ")" if c_path else "")
                      + f"; between steps: drafter {1e3 * draft:.2f}, greedy sampling {1e3 * sample:.2f} ms", flush=True)
    finally:
        cpu_kernels.linear, cpu_kernels.attend = lin_k, att_k
        inv_mod.KERNELS["cpu"] = (inv_mod.KERNELS["cpu"][0], lin_k)
        for m in [*norms, *act_t]:
            if "forward" in vars(m):
                del m.forward
    return rows


def bench_hf_static(model, args, device) -> list[dict]:
    """HF's forward over a StaticCache of --context + 128 tokens (what static-cache generate
    allocates for 128 new tokens), compiled the way HF's static-cache generate compiles it. Each
    step appends its q tokens (positions advance), so a (batch, q) pair gets a fresh prefilled cache."""
    from transformers import StaticCache

    rows = []
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    vocab = model.config.vocab_size
    for b in args.batch_sizes:
        for q in args.q:
            cache = StaticCache(config=model.config, max_cache_len=args.context + 128)
            ids = torch.randint(3, vocab, (b, args.context), device=device)
            with torch.inference_mode():
                model(input_ids=ids, past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(args.context, device=device))
            step_ids = torch.randint(3, vocab, (b, q), device=device)
            state = {"pos": args.context}

            def step():
                pos = torch.arange(state["pos"], state["pos"] + q, device=device)
                state["pos"] += q
                with torch.inference_mode():
                    fwd(input_ids=step_ids, past_key_values=cache, use_cache=True, cache_position=pos)

            t0 = time.perf_counter()
            for _ in range(3):  # reduce-overhead records its graph on a later call
                step()
            sync(device)
            first = time.perf_counter() - t0
            s = timed(step, device, max(min(args.iters, 128 // q - 3), 1))
            rows.append({"mode": "hf-static", "batch": b, "q": q, "step_s": s, "first_call_s": first, "kernels": None})
            print(f"  {'hf-static':22s} batch {b:3d} q {q:2d}: {1e3 * s:8.2f} ms  (first calls {first:6.1f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.modes = args.modes or (list(MODES) if device.type == "cuda" else ["eager", "compiled"])
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or (Path(os.environ["OUT"]) / "step_bench.json" if os.environ.get("OUT") else "results/step_bench.json"))
    register()  # the "hf_plookup" attention implementation (wrap does this)
    result = report("step_bench", argv, args, device, [], models=[])
    for name in args.models:
        model = random_model(name, DTYPES[args.dtype], device, args.seed)
        # the engine packs a CPU model's linear weights in place on 2 MB pages for its invariant eager
        # steps (cpu.packed_weight); the other modes run plain weights, so they run first, below
        huge = device.type == "cpu" and huge_pages.available()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bound = weight_bytes / copy_bandwidth(device)
        read_bound = weight_bytes / read_bandwidth(device)
        print(f"== {name} {args.dtype} on {device}: bandwidth bound {1e3 * bound:.2f} ms/step "
              f"(reading the weights alone: {1e3 * read_bound:.2f} ms)" + ("; weights on 2 MB pages" if huge else ""),
              flush=True)
        macs = {q: step_macs(model, args.batch_sizes[0], q, args.context) for q in args.q}
        rate = gemm_rate(device) if device.type == "cpu" else None
        if rate:  # (on a GPU the step's own GEMMs are not fp32, so this rate would bound nothing)
            print(f"   compute bound at the fp32 GEMM rate ({rate / 1e9:.1f} GMAC/s), batch {args.batch_sizes[0]}: " +
                  ", ".join(f"q {q} {1e3 * sum(m.values()) / rate:.2f} ms" for q, m in macs.items()) +
                  " (linears, LM head and attention)", flush=True)
        bb = batch_bucket(max(args.batch_sizes))
        pages = bb * context_bucket(args.context + max(args.q), args.block_size) // args.block_size + 2
        if args.cache_tokens is not None:  # a larger cache than the steps use, as a wrapped model has
            tokens = (default_num_tokens(layer_specs(model), EngineOptions().cache_memory_fraction, model)
                      if args.cache_tokens == "auto" else int(args.cache_tokens))
            pages = max(pages, -(-tokens // args.block_size))
        cache = PagedKVCache(layer_specs(model), pages, args.block_size, scratch=True)
        print(f"   KV cache: {pages} pages of {args.block_size} tokens, "
              f"{sum(t.numel() * t.element_size() for t in cache.keys + cache.values) / 2**30:.2f} GiB", flush=True)
        for k, v in zip(cache.keys, cache.values):
            k.normal_()
            v.normal_()
        rows = []
        runs = [(backend, mode) for backend in args.attn_backends for mode in args.modes]
        for backend, mode in runs:
            if "compiled" in mode and backend not in COMPILABLE_BACKENDS:
                print(f"  {mode}/{backend}: skipped (compiled steps run attn_backend {COMPILABLE_BACKENDS})")
                continue
            rows += bench_mode(model, mode, backend, args, device, cache)
            if args.both_scopes and "compiled" in mode:
                rows += bench_mode(model, mode, backend, args, device, cache, swap_scope=True)
        if args.hf_static:
            rows += bench_hf_static(model, args, device)
        # invariant modes: compiled ones on plain weights (as the engine compiles), then the weights
        # packed in place, as the engine's eager CPU steps read them
        invariant_runs = [(b, m) for b, m in runs if args.invariant and not ("compiled" in m and b not in COMPILABLE_BACKENDS)
                          and not ("graphs" in m and b != "triton")]  # sdpa's form is not captured
        for backend, mode in sorted(invariant_runs, key=lambda r: "compiled" not in r[1]):
            if "compiled" not in mode and device.type == "cpu":
                pack_linears(model)
                to_huge_pages(model)
            rows += bench_mode(model, mode, backend, args, device, cache, invariant=True)
        if device.type == "cpu" and (args.small_pages or args.breakdown or args.kernels):
            pack_linears(model)
            to_huge_pages(model)
        if args.small_pages and huge:
            rows += bench_pages(model, args, device, cache)
        elif args.small_pages:
            print("  --small-pages: skipped (the weights are not on 2 MB pages here: no CPU, or no transparent huge pages)")
        if args.breakdown and device.type == "cpu":
            rows += breakdown(model, args, device, cache)
        if args.kernels and device.type == "cpu":
            rows += bench_kernels(model, args, device, cache, macs, rate)
        result["models"].append({"model": name, "bandwidth_bound_s": bound, "read_bound_s": read_bound,
                                 "gemm_macs_per_s": rate, "huge_pages": huge,
                                 "macs": {str(q): m for q, m in macs.items()}})
        result["results"] += [{"model": name, **r} for r in rows]
        write_json(out, result)
        del model, cache
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
