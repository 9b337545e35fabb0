"""Pure harness functions of eval/summarize.py, eval/bench.py and eval/lib/."""

from __future__ import annotations

import json

import pytest
import torch

from eval import bench, summarize
from eval.lib import batching, documents, prompts
from eval.lib.variants import variant_names


# -- exact match / divergence ---------------------------------------------------------------
@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 5, 3], 1),
        ([9, 2, 3], [1, 2, 3], 0),
        ([1, 2], [1, 2, 3], 2),  # one is a prefix of the other: diverges where the shorter ends
        ([1, 2, 3], [1, 2], 2),
        ([], [], None),
        ([], [4], 0),
    ],
)
def test_first_divergence(a, b, expected):
    assert batching.first_divergence(a, b) == expected
    assert summarize.exact_match(a, b) == (expected is None)


def test_exact_match_stats_hand_computed():
    base = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    outs = [[1, 2, 3], [4, 5, 0, 7], [8]]  # identical, diverges at 2, prefix -> diverges at 1
    s = summarize.exact_match_stats(outs, base)
    assert s["exact_match"] == pytest.approx(1 / 3)
    assert s["diverged"] == 2
    assert s["mean_first_divergence"] == pytest.approx(1.5)
    s = summarize.exact_match_stats(base, base)
    assert s == {"exact_match": 1.0, "diverged": 0, "mean_first_divergence": None}
    with pytest.raises(ValueError):
        summarize.exact_match_stats(outs[:2], base)


# -- ROUGE ----------------------------------------------------------------------------------
def test_rouge_hand_computed():
    scores = summarize.rouge_per_doc(["the cat sat", "a b c d"], ["the cat ran", "a b c d"], backend="rouge_score")
    # unigrams: 2 of 3 shared -> P = R = F = 2/3; bigrams: 1 of 2 -> 1/2; LCS "the cat" -> 2/3
    assert scores[0]["rouge1"] == pytest.approx(2 / 3)
    assert scores[0]["rouge2"] == pytest.approx(1 / 2)
    assert scores[0]["rougeL"] == pytest.approx(2 / 3)
    assert scores[1] == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert summarize.rouge_per_doc([], [], backend="rouge_score") == []
    with pytest.raises(ValueError):
        summarize.rouge_per_doc(["x"], [], backend="rouge_score")


def test_rouge_auto_falls_back_offline(monkeypatch):
    import evaluate

    def no_hub(*a, **k):
        raise FileNotFoundError("no hub here")

    monkeypatch.setattr(evaluate, "load", no_hub)
    monkeypatch.setattr(summarize, "_ROUGE_CACHE", {})
    scores = summarize.rouge_per_doc(["the cat sat"], ["the cat ran"], backend="auto")
    assert scores[0]["rouge1"] == pytest.approx(2 / 3)
    assert summarize.rouge_backend_used() == "rouge_score"
    monkeypatch.setattr(summarize, "_ROUGE_CACHE", {})
    with pytest.raises(RuntimeError, match="evaluate.load"):
        summarize.rouge_per_doc(["x"], ["x"], backend="evaluate")


def test_spread():
    assert summarize.spread([1.0, 3.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "std": 1.0}
    assert summarize.spread([2.0])["std"] == 0.0
    assert summarize.spread([])["mean"] is None


# -- sharding / merging ---------------------------------------------------------------------
def test_shard_covers_everything_once():
    items = list(range(7))
    parts = [summarize.shard(items, r, 2) for r in range(2)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6]]
    for world in (1, 2, 3, 5, 9):
        parts = [summarize.shard(items, r, world) for r in range(world)]
        assert sum(parts, []) == items
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [summarize.shard([0], r, 3) for r in range(3)] == [[0], [], []]
    with pytest.raises(ValueError):
        summarize.shard(items, 2, 2)


def test_merge_records_sorts_and_rejects_duplicates():
    recs = [{"variant": "b", "index": 1}, {"variant": "a", "index": 2}, {"variant": "a", "index": 0}]
    merged = summarize.merge_records(recs)
    assert [(r["variant"], r["index"]) for r in merged] == [("a", 0), ("a", 2), ("b", 1)]
    with pytest.raises(ValueError, match="duplicate"):
        summarize.merge_records(recs + [{"variant": "a", "index": 0}])


# -- summarizing records / accuracy gate ----------------------------------------------------
def _records():
    specs = summarize.variant_specs([2], with_hf_plookup=False, batch_size=2)
    r = {"rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.5}
    docs = [
        {"variant": "hf-greedy", "index": 0, "tokens": [1, 2, 3], "rouge": r},
        {"variant": "hf-greedy", "index": 1, "tokens": [4, 5], "rouge": r},
        {"variant": "plk-k2", "index": 0, "tokens": [1, 2, 3], "rouge": r},
        {"variant": "plk-k2", "index": 1, "tokens": [4, 6], "rouge": {"rouge1": 0.4, "rouge2": 0.25, "rougeL": 0.3}},
    ]
    batches = [
        {"variant": "hf-greedy", "rank": 0, "batch": 0, "seconds": 1.0, "tokens": 5, "row_steps": 5,
         "drafted_per_position": [], "accepted_per_position": []},
        {"variant": "plk-k2", "rank": 0, "batch": 0, "seconds": 0.5, "tokens": 5, "row_steps": 2,
         "drafted_per_position": [4, 3], "accepted_per_position": [3, 1]},
    ]
    return docs, batches, specs


def test_summarize_results_hand_computed():
    docs, batches, specs = _records()
    base, plk = summarize.summarize_results(docs, batches, specs)
    assert base["speedup"] == 1.0 and base["exact_match"] == 1.0 and base["tokens_per_forward"] == 1.0
    assert base["acceptance_per_position"] is None
    assert plk["tokens_per_second"] == 10.0 and plk["speedup"] == pytest.approx(2.0)
    assert plk["speedup_per_batch"]["min"] == pytest.approx(2.0)
    assert plk["tokens_per_forward"] == pytest.approx(2.5)
    assert plk["acceptance_per_position"] == pytest.approx([0.75, 1 / 3])
    assert plk["acceptance_rate"] == pytest.approx(4 / 7)
    assert plk["exact_match"] == 0.5 and plk["mean_first_divergence"] == 1.0
    assert plk["rouge"]["rougeL"] == pytest.approx(0.4)
    assert plk["rouge_drop"]["rougeL"] == pytest.approx(0.1)
    assert plk["rouge_drop"]["rouge2"] == pytest.approx(0.0)


def test_check_accuracy_thresholds():
    docs, batches, specs = _records()
    variants = summarize.summarize_results(docs, batches, specs)
    assert summarize.check_accuracy(variants, min_exact_match=0.5, max_rouge_drop=0.1 + 1e-9) == []
    fails = summarize.check_accuracy(variants, min_exact_match=1.0, max_rouge_drop=0.05)
    assert len(fails) == 2
    assert "exact match 0.500 < 1.0" in fails[0] and "rougeL drops by 0.1000" in fails[1]


def test_thresholds_default_per_dtype():
    a = summarize.parse_args(["--dtype", "fp32"])
    assert (a.min_exact_match, a.max_rouge_drop) == summarize.DEFAULT_THRESHOLDS["fp32"] and a.min_exact_match == 1.0
    b = summarize.parse_args(["--dtype", "bf16"])
    assert b.min_exact_match < 1.0 and b.max_rouge_drop > 0
    c = summarize.parse_args(["--dtype", "fp16", "--min-exact-match", "0.9", "--max-rouge-drop", "0.001"])
    assert (c.min_exact_match, c.max_rouge_drop) == (0.9, 0.001)
    default = summarize.parse_args([])
    assert default.dataset == "cnn_dailymail" and default.num_docs == summarize.DEFAULT_NUM_DOCS["cnn_dailymail"]
    assert summarize.parse_args(["--dataset", "builtin"]).num_docs == 8
    assert default.out.startswith("results/summarize/cnn_dailymail-")  # a new folder per run
    assert summarize.parse_args(["--dataset", "data/x.jsonl"]).out.startswith("results/summarize/x-")
    assert summarize.parse_args(["--dataset", "x.jsonl"]).num_docs == 100
    with pytest.raises(SystemExit):
        summarize.parse_args(["--k", "0"])


# -- report ---------------------------------------------------------------------------------
def test_write_report(tmp_path):
    docs, batches, specs = _records()
    variants = summarize.summarize_results(docs, batches, specs)
    results = {
        "args": {"model": "tiny", "dtype": "fp32", "device": "cpu", "dataset": "builtin", "max_new_tokens": 3, "ngram": 2},
        "num_docs": 2, "num_processes": 1, "rouge_backend": "rouge_score", "results": variants,
        "accuracy_check": {"enabled": True, "min_exact_match": 1.0, "max_rouge_drop": 0.0, "failures": ["x failed"]},
    }
    paths = summarize.write_report(results, tmp_path / "out")
    assert set(paths) == {"json", "md", "png"} and all(p.exists() for p in paths.values())
    loaded = json.loads(paths["json"].read_text())
    assert [v["name"] for v in loaded["results"]] == ["hf-greedy", "plk-k2"]
    md = paths["md"].read_text()
    assert "HF greedy (baseline)" in md and "hf_plookup k=2" in md and "FAIL: x failed" in md
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert "png" not in summarize.write_report(results, tmp_path / "noplot", plot=False)
    off = {**results, "accuracy_check": {**results["accuracy_check"], "enabled": False, "failures": []}}
    assert "accuracy check" not in summarize.write_report(off, tmp_path / "off", plot=False)["md"].read_text()


# -- data and prompts -----------------------------------------------------------------------
def test_load_jsonl_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "text": "doc one", "ref": "one"}\n\n{"text": "doc two", "ref": "two"}\n')
    docs = documents.load_jsonl(path, text_field="text", summary_field="ref")
    assert docs == [{"id": "a", "document": "doc one", "summary": "one"}, {"id": "line-3", "document": "doc two", "summary": "two"}]
    loaded, info = summarize.load_documents(str(path), 2, text_field="text", summary_field="ref")
    assert loaded == [{"id": "a", "document": "doc one", "summary": "one"}, {"id": "row-1", "document": "doc two", "summary": "two"}]
    assert info == {"name": "d.jsonl", "license": "the file's own", "source": str(path), "origin": "file", "documents": 2}
    with pytest.raises(SystemExit, match="--summary-field"):
        summarize.load_documents(str(path), 2, text_field="text")
    csv = tmp_path / "d.csv"
    csv.write_text("body,abstract\nfirst doc,first\nsecond doc,second\n")
    loaded, _ = summarize.load_documents(str(csv), 5, text_field="body", summary_field="abstract")
    assert loaded == [{"id": "row-0", "document": "first doc", "summary": "first"},
                      {"id": "row-1", "document": "second doc", "summary": "second"}]
    with pytest.raises(SystemExit, match="must be one of"):
        summarize.load_documents(str(tmp_path / "missing.jsonl"), 1)
    with pytest.raises(ValueError, match="--text-field"):
        documents.load_jsonl(path)
    with pytest.raises(ValueError, match="--summary-field"):
        documents.load_jsonl(path, text_field="text")
    assert documents.load_jsonl(path, text_field="text", summary_field=None)[0]["summary"] is None


def test_builtin_documents():
    docs, info = summarize.load_documents("builtin", 5)
    assert len(docs) == 5 and all(d["document"] and d["summary"] for d in docs)
    assert docs[0]["id"] == "builtin-01" and info["origin"] == "shipped sample"
    assert len(summarize.load_documents("builtin", 1000)[0]) == 28


def test_shipped_datasets():
    """The samples in eval/data/: counts, ids as the datasets define them, licenses in the report."""
    import hashlib
    import json

    docs, info = summarize.load_documents("cnn_dailymail", 1000)
    assert len(docs) == 150 and info["license"] == "Apache-2.0" and info["origin"] == "shipped sample"
    rows = [json.loads(line) for line in (summarize.DATA_DIR / "cnn_dailymail.jsonl").read_text().splitlines()]
    assert all(r["id"] == hashlib.sha1(r["url"].encode()).hexdigest() for r in rows)  # CNN/DM's story id
    assert [d["id"] for d in docs] == [r["id"] for r in rows] and len({d["document"] for d in docs}) == 150
    bills, info = summarize.load_documents("billsum", 1000)
    assert len(bills) == 50 and info["license"] == "CC0-1.0" and bills[0]["id"] == "billsum-test-0"
    assert sum(b["document"].startswith("SECTION 1.") for b in bills) >= 45 and all(b["summary"] for b in bills)
    assert all(p.stat().st_size < 5_000_000 for p in summarize.DATA_DIR.iterdir())


def test_bootstrap_ci_literal_cases():
    assert summarize.bootstrap_ci([0.5, 0.5, 0.5]) == [0.5, 0.5]
    assert summarize.bootstrap_ci([0.1, 0.9], resamples=0) is None and summarize.bootstrap_ci([], 100) is None
    lo, hi = summarize.bootstrap_ci([0.0] * 50 + [1.0] * 50, resamples=2000)
    assert 0.38 < lo < 0.45 and 0.55 < hi < 0.62  # mean 0.5, standard error 0.05: about 0.5 -+ 0.098
    assert summarize.bootstrap_ci([0.0, 1.0, 0.3], 500, seed=1) == summarize.bootstrap_ci([0.0, 1.0, 0.3], 500, seed=1)


def test_prompts_plain_and_chat(tiny_ckpt, tiny_chat_ckpt):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert not prompts.has_chat_template(plain)
    fewshot = prompts.build_prompt(plain, "the doc")  # a base model: one example, then the document
    assert fewshot.startswith("Article: ") and fewshot.endswith("\n\nArticle: the doc\nSummary:")
    assert fewshot.count("Summary:") == 2 and "Summarize" not in fewshot
    chat = AutoTokenizer.from_pretrained(tiny_chat_ckpt)
    text = prompts.build_prompt(chat, "the doc")
    assert text.startswith("<s><user> ") and "the doc" in text and text.endswith("<assistant> ")
    assert prompts.encode_prompt(chat, text, chat=True).count(chat.bos_token_id) == 1
    long_doc = " ".join(["river"] * 50)
    assert prompts.truncate_document(plain, long_doc, 10) == " ".join(["river"] * 10)
    assert prompts.truncate_document(plain, long_doc, None) == long_doc


def test_summary_text_cuts_the_fewshot_pattern():
    assert prompts.summary_text(" The board met.\n\nArticle: next one", use_chat=False) == "The board met."
    assert prompts.summary_text(" The board met.\nArticle: next", use_chat=False) == "The board met."
    assert prompts.summary_text(" Line one.\n\nLine two.", use_chat=True) == "Line one.\n\nLine two."


def test_use_chat_follows_the_model_not_the_attached_template(tiny_ckpt, tiny_chat_ckpt):
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(tiny_chat_ckpt)
    assert prompts.use_chat(str(tiny_chat_ckpt), chat) and not prompts.use_chat(str(tiny_ckpt), AutoTokenizer.from_pretrained(tiny_ckpt))
    assert not prompts.use_chat("gemma3-270m", chat)  # a base model, though a chat template is attached
    assert prompts.use_chat("smollm2-135m", chat)


def test_left_pad_and_new_tokens():
    ids, mask = batching.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    seqs = torch.tensor([[5, 6, 7, 3, 2, 9], [0, 0, 8, 4, 4, 4]])
    assert batching.new_tokens(seqs, 3, eos={2}) == [[3, 2], [4, 4, 4]]
    with pytest.raises(ValueError):
        batching.left_pad([[1], []], 0)
    assert batching.batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_bench_workload_and_synthetic_prompts():
    assert batching.workload([[1], [2], [3]], num_prompts=3, batch_size=2) == [[[1], [2]], [[3]]]
    assert batching.workload([[1], [2]], num_prompts=2, batch_size=4) == [[[1], [2], [1], [2]]]
    ps = prompts.synthetic_prompts(list(range(10, 60)), n=3, length=40, seed=1)
    assert len(ps) == 3 and all(len(p) == 40 for p in ps)
    assert ps == prompts.synthetic_prompts(list(range(10, 60)), n=3, length=40, seed=1)
    p = ps[0]  # some 4-gram occurs twice: the repeats n-gram lookup feeds on
    grams = [tuple(p[i : i + 4]) for i in range(len(p) - 3)]
    assert len(set(grams)) < len(grams)
    args = bench.parse_args(["--k", "3", "5", "--device", "cpu"])
    assert args.batch_sizes == [1, 4]
    names = [variant_names(args.variants, args.k, args.tree_nodes, b) for b in (1, 4)]
    assert names[0] == ["hf-greedy", "hf-pl-k3", "hf-pl-k5", "plk-greedy", "plk-k3", "plk-k5"]
    assert names[1] == ["hf-greedy", "plk-greedy", "plk-k3", "plk-k5"]


def test_bench_aggregate_best_of_repeats():
    def call(v, b, r, s, tok=10, eq=None):
        return {"variant": v, "batch": b, "repeat": r, "seconds": s, "tokens": tok, "row_steps": tok if v == "hf-greedy" else tok // 2,
                "forwards": 5, "rows": 2, "rows_equal": eq}
    calls = [call("hf-greedy", 0, 0, 2.0, eq=2), call("hf-greedy", 0, 1, 1.0, eq=2), call("hf-greedy", 1, 0, 1.0, eq=2),
             call("plk-k4", 0, 0, 0.5, eq=2), call("plk-k4", 0, 1, 1.5, eq=1), call("plk-k4", 1, 0, 0.5, eq=2)]
    for c, outside in zip(calls[3:], (1e-3, 9e-3, 3e-3)):
        c["outside_step_s"] = outside
    hf, plk, missing = bench.aggregate(calls, ["hf-greedy", "plk-k4", "plk-k8"], 2, {"plk-k8": "out of memory"})
    assert hf["tokens_per_second"] == pytest.approx(20 / 2.0)  # best of batch 0 (1.0 s) + batch 1 (1.0 s)
    assert hf["tokens_per_second_mean"] == pytest.approx(30 / 4.0)
    assert plk["tokens_per_second"] == pytest.approx(20 / 1.0) and plk["ratio_to_hf_greedy"] == pytest.approx(2.0)
    assert plk["tokens_per_forward"] == pytest.approx(2.0)
    assert plk["outside_step_s"] == pytest.approx(2e-3) and hf["outside_step_s"] is None  # fastest calls' median
    assert "| 2.00 |" in bench.format_table([plk])
    assert plk["equal_to_hf_greedy"] == pytest.approx(5 / 6)
    assert hf["ratio_to_hf_greedy"] == 1.0 and hf["latency_per_call_s"] == pytest.approx(1.0)
    assert missing["skipped"] == "out of memory" and missing["tokens_per_second"] is None
    assert "skipped" in bench.format_table([missing])


# -- the benchmark's variants and the reports' shape ------------------------------------------
def test_step_timer_outside_per_step():
    from eval.lib.timing import StepTimer

    timer = StepTimer("cpu")
    assert timer.outside_per_step(1.0) is None  # no decode step
    timer.steps = [(False, 1, 40, 0.1)] + [(True, 1, 5, 0.008)] * 100  # a prompt chunk, 100 decode steps
    assert timer.outside_per_step(1.0) == pytest.approx(0.1 / 100)


def test_variant_name_parts():
    from eval.lib.variants import FAMILIES, engine_of, k_of, tree_of

    assert [k_of(n) for n in ("hf-greedy", "hf-pl-k4", "plk-k10-t16", "plk-k4-eager")] == [None, 4, 10, 4]
    assert [tree_of(n) for n in ("plk-k4", "plk-k4-t16", "plk-greedy")] == [None, 16, None]
    assert [engine_of(n) for n in ("hf-static", "plk-greedy", "plk-k4-t6", "plk-k4-nocompile", "plk-greedy-eager")] == [
        None, "default", "default", "nocompile", "eager"]
    assert variant_names(list(FAMILIES), [4, 8], [16], 1) == [
        "hf-greedy", "hf-pl-k4", "hf-pl-k8", "hf-static", "hf-batch", "plk-greedy", "plk-k4", "plk-k8", "plk-k4-t16",
        "plk-k8-t16", "plk-greedy-nocompile", "plk-k4-nocompile", "plk-greedy-eager", "plk-k4-eager",
        "plk-greedy-compiled", "plk-k4-compiled", "plk-greedy-compiled_nographs", "plk-k4-compiled_nographs",
        "plk-greedy-noscreen", "plk-k4-noscreen"]
    assert variant_names(["hf-pl", "plk-compiled"], [4, 8], [], 1, hf_pl_ks=[4]) == [
        "hf-greedy", "hf-pl-k4", "plk-greedy-compiled", "plk-k4-compiled"]
    assert [engine_of(n) for n in ("plk-k4-compiled", "plk-greedy-compiled_nographs", "plk-k4-noscreen")] == [
        "compiled", "compiled_nographs", "noscreen"]


def test_bench_ratio_on_the_batches_a_variant_ran():
    """hf-static runs on the first batch only: its ratio is against HF greedy on that batch."""
    def call(v, b, s, tok=10):
        return {"variant": v, "batch": b, "repeat": 0, "seconds": s, "tokens": tok, "row_steps": tok, "forwards": tok,
                "rows": 1, "rows_equal": 1}
    calls = [call("hf-greedy", 0, 2.0), call("hf-greedy", 1, 1.0), call("hf-static", 0, 0.5)]
    hf, static = bench.aggregate(calls, ["hf-greedy", "hf-static"], 1)
    assert hf["ratio_to_hf_greedy"] == pytest.approx(1.0) and static["ratio_to_hf_greedy"] == pytest.approx(4.0)
    assert static["batches"] == [0] and static["call_seconds"] == [0.5]


def test_bench_ratio_to_the_faster_hf_baseline():
    """ratio_to_hf_best divides by the faster of HF greedy and HF's static cache, batch by batch
    as each ran: plk at 10 tok/s is 5x HF greedy (2 tok/s) but 2x the static cache (5 tok/s)."""
    def call(v, b, s, tok=10):
        return {"variant": v, "batch": b, "repeat": 0, "seconds": s, "tokens": tok, "row_steps": tok, "forwards": tok,
                "rows": 1, "rows_equal": 1}
    calls = [call("hf-greedy", 0, 5.0), call("hf-static", 0, 2.0), call("plk-k4", 0, 1.0)]
    hf, static, plk = bench.aggregate(calls, ["hf-greedy", "hf-static", "plk-k4"], 1)
    assert plk["ratio_to_hf_greedy"] == pytest.approx(5.0) and plk["ratio_to_hf_static"] == pytest.approx(2.0)
    assert plk["ratio_to_hf_best"] == pytest.approx(2.0) and static["ratio_to_hf_best"] == pytest.approx(1.0)
    assert hf["ratio_to_hf_best"] == pytest.approx(0.4)  # HF greedy against the faster static cache
    alone = bench.aggregate([call("hf-greedy", 0, 5.0), call("plk-k4", 0, 1.0)], ["hf-greedy", "plk-k4"], 1)[1]
    assert alone["ratio_to_hf_static"] is None and alone["ratio_to_hf_best"] == pytest.approx(5.0)


def test_dataset_prompts_are_distinct_requests():
    from tests.eval.tiny import build_tokenizer

    tok = build_tokenizer(chat=True)  # a word-level tokenizer with a chat template
    ps = prompts.dataset_prompts(tok, "cnn_dailymail", 4, max_doc_tokens=60)
    assert len(ps) == 4 and len({tuple(p) for p in ps}) == 4
    # the article cut to its first 60 tokens (this tokenizer drops the unknown ones on the way),
    # in the chat template: the benchmarks' request before it, the main job's after it
    assert all(len(p) <= 60 + 15 for p in ps)
    assert tok.decode(ps[0]).startswith("<s> <user> <unk> the following text in two or three <unk> . will be")
    main_job = prompts.dataset_prompts(tok, "cnn_dailymail", 1, 60, prompts.SUMMARY_REQUEST)
    assert tok.decode(main_job[0]).endswith("<unk> the text above in two or three <unk> . </s_turn> <assistant>")
    with pytest.raises(ValueError, match="dataset must be one of"):
        prompts.dataset_prompts(tok, "xsum", 1)
    with pytest.raises(ValueError, match="holds 150"):
        prompts.dataset_prompts(tok, "cnn_dailymail", 151)


def test_gpu_check_plan_shrinks_for_the_cpu():
    from eval import gpu_check

    argv = gpu_check.stage_argv(gpu_check.STAGES[0][2], "bf16", "smollm2-135m", "cpu", "/tmp/x.json", 100)
    assert argv[argv.index("--batch-sizes") + 1: argv.index("--batch-sizes") + 4] == ["1", "2", "--num-prompts"]
    assert argv[argv.index("--max-new-tokens") + 1] == "4" and argv[argv.index("--dtype") + 1] == "fp32"
    assert "plk-compiled" not in argv and "plk" in argv
    settings = dict((name, args) for name, _, args in gpu_check.STAGES)["settings"]
    argv = gpu_check.stage_argv(settings, "bf16", "smollm2-135m", "cpu", "/tmp/x.json", 100)
    assert "plk-eager" in argv and "plk-compiled_nographs" not in argv  # a CPU compiles a bucket for minutes
    gpu = gpu_check.stage_argv(gpu_check.STAGES[0][2], "bf16", "smollm2-135m", "cuda", "/tmp/x.json", 100)
    assert {"plk-compiled", "hf-static"} <= set(gpu) and gpu[gpu.index("--dtype") + 1] == "bf16"
    bench.parse_args(gpu[:gpu.index("--device")] + ["--device", "cpu"] + gpu[gpu.index("--device") + 2:])
    # the quantized stages: fp32 (token identity with HF greedy of the same quantized model), each its quantizer
    stages = {name: (dtype, args) for name, dtype, args in gpu_check.STAGES}
    assert {n: gpu_check.stage_quantization(stages[n][1]) for n in ("nf4", "int8", "fp32")} == {
        "nf4": "bnb-nf4", "int8": "torchao-int8", "fp32": None}
    for name in ("nf4", "int8"):
        argv = gpu_check.stage_argv(stages[name][1], stages[name][0], "smollm2-135m", "cuda", "/tmp/x.json", 100)
        assert argv[argv.index("--dtype") + 1] == "fp32" and "plk" in argv
        bench.parse_args(argv[:argv.index("--device")] + ["--device", "cpu"] + argv[argv.index("--device") + 2:])


def test_report_shape(tmp_path):
    import argparse

    from eval.lib.report import report, write_json

    args = argparse.Namespace(k=[4], json=str(tmp_path / "r.json"))
    doc = report("bench", ["--k", "4"], args, "cpu", [{"variant": "plk-k4"}], wall_s=1.5)
    assert list(doc) == ["script", "command", "machine", "args", "results", "wall_s"]
    assert doc["command"] == ["eval/bench.py", "--k", "4"] and doc["args"] == {"k": [4], "json": args.json}
    assert doc["machine"]["device"] == "cpu" and doc["machine"]["torch"]
    assert json.loads(write_json(tmp_path / "sub" / "r.json", doc).read_text()) == doc


def test_random_model_names():
    from eval.lib.models import check_name, label, load_model

    assert check_name("random:qwen3-8b") is None and check_name("smollm2-135m") is None
    assert "random:SHAPE takes one of" in check_name("random:qwen9")
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--model", "random:qwen9"])
    with pytest.raises(SystemExit):  # random weights have no tokenizer for the builtin documents
        bench.parse_args(["--device", "cpu", "--model", "random:tiny-qwen3", "--prompt-source", "builtin"])
    model, tok = load_model("random:tiny-qwen3", torch.float32, "cpu")
    assert tok is None and model.config.num_hidden_layers == 2 and batching.pad_id(model, tok) == 0
    assert label("random:tiny-qwen3") == "random:tiny-qwen3"


def test_busy_machine_warning():
    from eval.lib.machine import busy_warning

    assert busy_warning(1.9, 2) is None and busy_warning(2.0, 2) is None
    line = busy_warning(3.4, 2)
    assert "load (3.4 over the last minute) exceeds its 2 cores" in line and "--threads 1" in line
