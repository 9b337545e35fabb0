"""Prefix caching: workloads whose prompts share a beginning, HF against hf_plookup with the
prefix pool on and off, side by side in one run.

    python eval/prefix_bench.py                       # all three workloads, SmolLM2-135M-Instruct, fp32
    python eval/prefix_bench.py --workloads chat --turns 6

Workloads (documents: the CNN/DailyMail sample in eval/data/):
  * chat: HF's multi-turn pattern: each turn passes the previous output's cache (`past_key_values`,
    named `cache` from transformers 5.24 on) and the whole conversation (previous output + the next
    user message); new stories arrive every other turn, so the conversation grows past 2,000 tokens;
  * questions: questions about one document of about 1,500 tokens, one call each;
  * fewshot: lm-eval's `HFLM.generate_until` on few-shot requests that share their examples.

Every variant runs the same inputs; the table gives each variant's seconds for the whole
workload (the fastest of `--repeats` rounds, variants rotated between rounds), its speed against
HF greedy, the share of prompt tokens not prefilled (from the pool or the caller's cache), and
whether its tokens equal HF's.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import hf_plookup
from eval.lib.cli import DTYPES, add_threads_option, parse_dtype, set_threads, show_defaults
from eval.lib.documents import DATA_DIR, load_jsonl
from eval.lib.models import load_model
from eval.lib.prompts import encode_prompt
from eval.lib.report import report, write_json
from hf_plookup.embedded import default_example_model
from hf_plookup.outputs import CACHE_FIELD

DATA = DATA_DIR / "cnn_dailymail.jsonl"
CHAT_FOLLOW_UPS = ["Who is named in it, and what did each of them do?", "Quote its most important sentence exactly."]
QUESTIONS = [
    "Summarize the text above in two sentences.", "Who are the people named in the text above?",
    "Which places does the text above mention?", "Which numbers appear in the text above, and what do they count?",
    "Quote the first sentence of the text above exactly.", "What happened first in the text above?",
    "What is the main claim of the text above?", "Quote the last sentence of the text above exactly.",
]
# variant -> (engine, prompt_lookup_num_tokens, prefix_cache)
VARIANTS = {
    "hf-greedy": ("hf", None, None),
    "plk-greedy": ("plookup", None, True),
    "plk-k4": ("plookup", 4, True),
    "plk-k4-nocache": ("plookup", 4, False),
    "plk-greedy-nocache": ("plookup", None, False),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_example_model(), help="embedded alias or HF id/path")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    add_threads_option(p)
    p.add_argument("--workloads", nargs="+", default=["chat", "questions", "fewshot"], choices=["chat", "questions", "fewshot"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--turns", type=int, default=6, help="chat turns")
    p.add_argument("--doc-tokens", type=int, default=1500, help="the questions workload's document length")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2, help="rounds per workload; each variant's fastest counts")
    p.add_argument("--out", default="results/prefix_bench.json")
    return show_defaults(p)


def stories(n: int) -> list[str]:
    return [d["document"] for d in load_jsonl(DATA, "article", "highlights")[:n]]


def user_turn(tok, text: str, previous: torch.Tensor | None) -> list[int]:
    """Token ids of a user message and the assistant's header: the whole chat template on the first
    turn; later turns append to the previous output (closing the assistant's message when it ran
    to the token limit), as HF's multi-turn pattern does. ChatML (SmolLM2's template)."""
    if previous is None:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    end = "" if int(previous[0, -1]) == tok.eos_token_id else tok.eos_token
    return tok(f"{end}\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def chat_messages(turns: int) -> list[str]:
    docs = stories(turns)
    out = []
    for t in range(turns):
        if t % 2 == 0:
            out.append(f"{docs[t // 2]}\n\nSummarize the story above in two sentences.")
        else:
            out.append(CHAT_FOLLOW_UPS[(t // 2) % len(CHAT_FOLLOW_UPS)])
    return out


def run_chat(model, tok, messages: list[str], k: int | None, max_new: int) -> dict:
    """The conversation with `model` (wrapped or not): seconds, tokens per turn, prompt tokens and
    those from the pool."""
    ids, past, outputs, prompt, cached = None, None, [], 0, 0
    start = time.perf_counter()
    for msg in messages:
        turn = torch.tensor([user_turn(tok, msg, ids)])
        ids = turn if ids is None else torch.cat([ids, turn], 1)
        kw = {"prompt_lookup_num_tokens": k} if k else {}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE_FIELD: past}, max_new_tokens=max_new,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=tok.pad_token_id, **kw)
        outputs.append(out.sequences[0, ids.shape[1]:].tolist())
        prompt += ids.shape[1]
        stats = getattr(model, "last_stats", None)
        cached += stats.cached_prompt_tokens if stats is not None else 0
        ids, past = out.sequences, getattr(out, CACHE_FIELD)
    return {"seconds": time.perf_counter() - start, "outputs": outputs, "prompt_tokens": prompt, "cached_prompt_tokens": cached,
            "final_length": int(ids.shape[1])}


def question_prompts(tok, doc_tokens: int) -> list[list[int]]:
    text, docs = "", stories(40)
    while len(tok(text, add_special_tokens=False)["input_ids"]) < doc_tokens and docs:
        text += docs.pop(0) + "\n\n"
    ids = tok(text, add_special_tokens=False)["input_ids"][:doc_tokens]
    doc = tok.decode(ids)
    return [encode_prompt(tok, tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\n{q}"}],
                                                               add_generation_prompt=True, tokenize=False), True)
            for q in QUESTIONS]


def run_calls(model, tok, prompts: list[list[int]], k: int | None, max_new: int) -> dict:
    outputs, prompt, cached, later_prompt, later_cached = [], 0, 0, 0, 0
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        kw = {"prompt_lookup_num_tokens": k} if k else {}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tok.pad_token_id, **kw)
        outputs.append(out[0, ids.shape[1]:].tolist())
        stats = getattr(model, "last_stats", None)
        c = stats.cached_prompt_tokens if stats is not None else 0
        prompt, cached = prompt + len(p), cached + c
        if i:
            later_prompt, later_cached = later_prompt + len(p), later_cached + c
    return {"seconds": time.perf_counter() - start, "outputs": outputs, "prompt_tokens": prompt, "cached_prompt_tokens": cached,
            "cached_share_after_first": later_cached / later_prompt if later_prompt else None}


def fewshot_requests(n_shots: int = 3, n_queries: int = 8) -> list[tuple[str, dict]]:
    rows = load_jsonl(DATA, "article", "highlights")
    shots = "".join(f"Article: {r['document'][:1200]}\nHighlights: {r['summary']}\n\n" for r in rows[:n_shots])
    return [(f"{shots}Article: {r['document'][:1200]}\nHighlights:", {"until": ["\n\n", "Article:"]})
            for r in rows[n_shots : n_shots + n_queries]]


def run_fewshot(model, tok, requests, k: int | None, max_new: int) -> dict:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=4096)
    extra = {"prompt_lookup_num_tokens": k} if k else {}
    reqs = [Instance("generate_until", {}, (ctx, {**gen, "max_gen_toks": max_new, "do_sample": False, **extra}), i)
            for i, (ctx, gen) in enumerate(requests)]
    cached = [0]
    if hasattr(model, "last_stats"):  # every generate call's pooled tokens
        inner = model.generate

        def counting(*a, **kw):
            out = inner(*a, **kw)
            cached[0] += model.last_stats.cached_prompt_tokens
            return out

        model.generate = counting
    start = time.perf_counter()
    try:
        texts = lm.generate_until(reqs, disable_tqdm=True)
    finally:
        model.__dict__.pop("generate", None)
    prompt = sum(len(tok(ctx)["input_ids"]) for ctx, _ in requests)
    return {"seconds": time.perf_counter() - start, "outputs": texts, "prompt_tokens": prompt, "cached_prompt_tokens": cached[0]}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    model, tok = load_model(args.model, parse_dtype(args.dtype), args.device)
    # the engines share a deep copy's modules: on CPU `wrap` packs their linear weights in place
    # (hf_plookup/cpu/packed_weight.py), and HF runs `model`, plain
    shared = copy.deepcopy(model)
    wrapped = {True: hf_plookup.wrap(copy.copy(shared)), False: hf_plookup.wrap(copy.copy(shared), prefix_cache=False)}
    workloads = {
        "chat": (run_chat, chat_messages(args.turns)),
        "questions": (run_calls, question_prompts(tok, args.doc_tokens)),
        "fewshot": (run_fewshot, fewshot_requests()),
    }
    doc = report("prefix_bench", argv, args, args.device, [])
    for name in args.workloads:
        fn, inputs = workloads[name]
        best: dict[str, dict] = {}
        for r in range(args.repeats):
            order = args.variants[r % len(args.variants):] + args.variants[: r % len(args.variants)]
            for v in order:
                engine, k, cache = VARIANTS[v]
                m = model if engine == "hf" else wrapped[cache]
                if engine != "hf":
                    m.clear_prefix_cache()  # every round starts with an empty pool
                res = fn(m, tok, inputs, k, args.max_new_tokens)
                if v not in best or res["seconds"] < best[v]["seconds"]:
                    best[v] = res
        base = best.get("hf-greedy")
        rows = []
        for v in args.variants:
            res = best[v]
            rows.append({
                "variant": v, "seconds": res["seconds"],
                "speedup_vs_hf": base["seconds"] / res["seconds"] if base else None,
                "prompt_tokens": res["prompt_tokens"], "cached_prompt_tokens": res["cached_prompt_tokens"],
                "cached_share": res["cached_prompt_tokens"] / res["prompt_tokens"] if res["prompt_tokens"] else 0.0,
                "cached_share_after_first": res.get("cached_share_after_first"),
                "identical_to_hf": base is not None and res["outputs"] == base["outputs"],
                **({"final_length": res["final_length"]} if "final_length" in res else {}),
            })
        doc["results"] += [{"workload": name, **row} for row in rows]
        extra = f", conversation {best[args.variants[0]].get('final_length')} tokens" if name == "chat" else ""
        print(f"\n{name} ({len(inputs)} {'turns' if name == 'chat' else 'calls'}{extra}), fastest of {args.repeats}:")
        print("| variant | seconds | × HF greedy | prompt tokens not prefilled (pool, caller's cache) | = HF tokens |")
        print("|---|---:|---:|---:|---|")
        for row in rows:
            share = f"{row['cached_share']:.0%}"
            if row["cached_share_after_first"] is not None:
                share += f" ({row['cached_share_after_first']:.0%} after the first call)"
            sp = f"{row['speedup_vs_hf']:.2f}" if row["speedup_vs_hf"] else "–"
            print(f"| {row['variant']} | {row['seconds']:.1f} | {sp} | {share} | {row['identical_to_hf']} |")
    out = write_json(args.out, doc)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
