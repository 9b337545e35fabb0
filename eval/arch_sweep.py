"""Every causal-LM architecture transformers ships, tiny and random: does hf_plookup run it as HF does?

For each config type in transformers' causal-LM mapping, a tiny model is built from the default
config with its sizes shrunk (2 layers, hidden 64, 4 heads, a vocabulary of 512, ... in the config
and its sub-configs; one layer of each kind kept, with its own per-layer settings),
then HF greedy and hf_plookup (prompt lookup k=4) generate from the same left-padded batch of 2.
Each architecture runs in its own process with a time limit, or all in this one with
`--in-process` (`sweep`: no time limit, a fraction of the time; tests/eval/test_arch_sweep.py runs
it so). Outcomes:

- identical: hf_plookup ran on its engine and returned HF's tokens;
- delegated: hf_plookup handed the call to HF's `generate` (its reason);
- refused: `wrap` raised (its message);
- differs: the engine ran and the tokens are not HF's;
- crashed: hf_plookup raised inside `generate`;
- no tiny model / HF fails: the tiny model could not be built, or HF's own `generate` failed.

    python eval/arch_sweep.py                       # all of them, 2 at a time (about 10 min on 2 cores)
    python eval/arch_sweep.py --in-process          # all of them in one process (about 30 s)
    python eval/arch_sweep.py --only llama gpt_oss  # some

Writes a markdown table and JSON (default results/arch_sweep.{md,json}).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eval.lib.report import report, write_json

# sizes set wherever a config (or a sub-config) has the field
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2,
    "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 2, "head_dim": 16, "n_embd": 64,
    "d_model": 64, "ffn_dim": 128, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4,
    "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "vision_start_token_id": None,
    # embedding widths apart from the hidden size (XLM, RemBERT, OPT, xLSTM, Gemma 3n/4's per-layer
    # inputs, BLT's hashed byte groups): the largest tensors left, and the sweep's time with them
    "emb_dim": 64, "embedding_dim": 64, "word_embed_proj_dim": 64, "input_embedding_size": 32,
    "output_embedding_size": 64, "hidden_size_per_layer_input": 16, "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": 512, "rotary_dim": 8, "num_kv_shared_layers": 0,
    "linear_num_heads": 4, "linear_head_dim": 16, "d_head": 16,
}
# sizes some default configs leave None, which their models cannot build from (a default config
# that is not a model: Nemotron's KV heads, HunYuan's and Ministral's head size, DeepSeek V2's and
# dots1's experts): set where the field is there and None
UNSET = {"head_dim": 16, "num_key_value_heads": 2, "num_experts_per_tok": 2, "n_routed_experts": 4,
         "n_shared_experts": 1}
# vocabularies cut to this many tokens: an embedding and LM head of 256k rows cost more time than
# the rest of a tiny model together
VOCAB = 512
VOCAB_KEYS = ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size")
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer")  # the layer count, by the config's name for it
STATUSES = ("identical", "delegated", "refused", "differs", "crashed", "no tiny model", "HF fails", "timeout")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def shrink(d: dict, layers_before: int | None = None) -> dict:
    """A config dict with TINY's sizes where it has the fields; lists as long as the old layer
    count (per-layer types) cut to the new one; sub-config dicts shrunk the same way."""
    out = dict(d)
    n_old = next((d[k] for k in LAYER_KEYS if _int(d.get(k))), layers_before)
    for k, v in TINY.items():
        if k in out and v is not None and isinstance(out[k], int):
            out[k] = v
    for k, v in UNSET.items():
        if k in out and out[k] is None:
            out[k] = v
    # grouped expert routing (DeepSeek V3's n_group): experts split evenly into at most 2 groups
    experts = next((out[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if _int(out.get(k))), None)
    for g in ("n_group", "num_expert_group"):
        if isinstance(out.get(g), int) and experts and out[g] > 1:
            out[g] = 2 if experts % 2 == 0 else 1
            if isinstance(out.get("topk_group"), int):
                out["topk_group"] = min(out["topk_group"], out[g])
    if isinstance(out.get("num_experts_per_token"), int) and experts:  # Bailing's name for it
        out["num_experts_per_token"] = min(out["num_experts_per_token"], 2)
    # an attention width apart from the hidden size (RWKV's equal to it, Zamba's twice it): in proportion
    if all(isinstance(d.get(k), int) and d[k] > 0 for k in ("attention_hidden_size", "hidden_size")):
        out["attention_hidden_size"] = max(1, d["attention_hidden_size"] * out["hidden_size"] // d["hidden_size"])
        if isinstance(out.get("attention_head_dim"), int) and isinstance(out.get("num_attention_heads"), int):
            out["attention_head_dim"] = max(1, out["attention_hidden_size"] // out["num_attention_heads"])
    if any(_int(out.get(k)) and out[k] > VOCAB for k in VOCAB_KEYS):
        # the config's own special tokens past the cut (a pad of 163839) renumbered from the cut's
        # top down, each to its own id: they stay in the vocabulary (an embedding's padding row)
        # and apart from the prompt's tokens (3 to 99)
        ids = {k: v for k, v in d.items() if k.endswith(("token_id", "token_ids", "token_index")) and (
            _int(v) or isinstance(v, list) and v and all(_int(x) for x in v))}
        big = sorted({x for v in ids.values() for x in (v if isinstance(v, list) else [v]) if x >= VOCAB})
        new_id = {x: VOCAB - 1 - i for i, x in enumerate(big)}
        for k, v in ids.items():
            out[k] = [new_id.get(x, x) for x in v] if isinstance(v, list) else new_id.get(v, v)
        for k in VOCAB_KEYS:
            if _int(out.get(k)):
                out[k] = min(out[k], VOCAB)
    if "kv_lora_rank" in out:  # multi-head latent attention: one key/value head per query head
        out["num_key_value_heads"] = out.get("num_attention_heads")
        if "head_dim" in out and "qk_rope_head_dim" in out:  # head_dim is the rotary part there
            out["head_dim"] = out["qk_rope_head_dim"]
    n_new = next((out[k] for k in LAYER_KEYS if _int(out.get(k))), n_old)
    if isinstance(d.get("attention_types"), list) and d["attention_types"] and n_new:
        kinds = d["attention_types"][0][0]  # GPT-Neo's [[kinds, times], ...]: its first kinds, once over
        out["attention_types"] = [[kinds, max(1, n_new // len(kinds))]]
    src = kept_layers(d, n_old, n_new)
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            out[k] = shrink(v, n_old)
        elif isinstance(v, dict) and v and all(str(i).isdigit() for i in v) and n_new:
            # per-layer settings (a heterogeneous config's per_layer_config, ...): each kept layer takes
            # those of the old layer it stands for, so a kind of layer keeps its own settings (Gemma 4's
            # full-attention layers their wider heads), sizes shrunk in proportion to the global ones
            by_index = {int(i): x for i, x in v.items()}
            str_keys = all(isinstance(i, str) for i in v)
            out[k] = {(str(j) if str_keys else j): shrink_overrides(by_index[i], d, out)
                      for j, i in enumerate(src) if i in by_index}
        elif isinstance(v, list) and n_old and len(v) == n_old and n_new != n_old:
            kinds = list(dict.fromkeys(v)) if all(isinstance(x, str) for x in v) else []
            # per-layer kinds (sliding/full attention, linear attention, ...): keep one layer of each
            out[k] = (kinds + v)[:n_new] if 1 < len(kinds) <= n_new else v[:n_new]
        elif (isinstance(v, list) and n_new and len(v) > n_new and all(isinstance(x, str) for x in v)
              and 1 < len(set(v)) <= n_new and set(v[:n_new]) != set(v)):
            # a pattern of kinds repeated over the layers (RecurrentGemma's recurrent, recurrent,
            # attention): its kinds first, so the kept layers hold one of each
            kinds = list(dict.fromkeys(v))
            out[k] = (kinds + v)[: len(v)]
    # hybrids that place their attention layers by period or by index (Jamba, Bamba): one of the kept
    # layers attends (HF's own generate fails on a cache of state-space layers alone)
    if n_new and isinstance(out.get("attn_layer_period"), int) and out["attn_layer_period"] > n_new:
        out["attn_layer_period"], out["attn_layer_offset"] = n_new, n_new - 1
    if n_new and "attn_layer_indices" in out and not any(
            isinstance(i, int) and i < n_new for i in out["attn_layer_indices"] or []):
        out["attn_layer_indices"] = [n_new - 1]
    # Mamba-2 mixers: heads x head size must be the mixer's width, `mamba_d_ssm` where the config
    # has one, else expand x hidden size (the config checks it)
    for heads, dim, expand in (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"),
                               ("n_mamba_heads", "mamba_headdim", "mamba_expand")):
        if all(isinstance(out.get(k), int) for k in (heads, dim, expand, "hidden_size")):
            width = out.get("mamba_d_ssm") if isinstance(out.get("mamba_d_ssm"), int) else out[expand] * out["hidden_size"]
            out[dim] = min(out[dim], 16)
            out[heads] = max(width // out[dim], 1)
    for k in ("mamba_d_state", "ssm_state_size", "state_size"):  # state sizes of 128-256: slow and needless here
        if isinstance(out.get(k), int):
            out[k] = min(out[k], 16)
            # the scan's chunks (256): a prompt is padded to one, a second's work per forward in torch;
            # 32 still holds the sweep's prompt in one chunk
            for c in ("mamba_chunk_size", "chunk_size"):
                if _int(out.get(c)):
                    out[c] = min(out[c], 32)
    if out.get("is_decoder") is False and layers_before is None:
        # BERT-style models attend both ways unless told they decode (HF warns "add is_decoder=True"
        # when one is built as a causal LM): a causal LM checkpoint of them carries it
        out["is_decoder"] = True
    if isinstance(out.get("num_key_value_heads"), int) and isinstance(out.get("num_attention_heads"), int):
        if out["num_attention_heads"] % out["num_key_value_heads"]:
            out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def kept_layers(d: dict, n_old: int | None, n_new: int | None) -> list[int]:
    """The old layer each layer of the shrunk config stands for: where `layer_types` (or another
    per-layer list of kinds) keeps one layer of each kind, the first old layer of that kind, then
    the old layers in order; else the first `n_new` layers."""
    if not n_new:
        return []
    lists = [d["layer_types"]] if isinstance(d.get("layer_types"), list) else []
    lists += [v for v in d.values() if isinstance(v, list)]
    for v in lists:
        if n_old and len(v) == n_old != n_new and all(isinstance(x, str) for x in v):
            kinds = list(dict.fromkeys(v))
            if 1 < len(kinds) <= n_new:
                return ([v.index(x) for x in kinds] + list(range(n_old)))[:n_new]
    return list(range(n_new))


def shrink_overrides(over, d: dict, out: dict):
    """One layer's settings with TINY's sizes: a size the global config also has keeps its ratio to
    the global one (Gemma 4's full-attention head_dim 512 over 256: 2 x 16), others TINY's."""
    if not isinstance(over, dict):
        return over
    res = dict(over)
    for k, v in over.items():
        if not (_int(v) and _int(TINY.get(k))):
            continue
        old, new = d.get(k), out.get(k)
        if isinstance(old, int) and isinstance(new, int) and old > 0:
            res[k] = max(1, round(v * new / old))
        else:
            res[k] = TINY[k]
    return res


def run_one(model_type: str, max_new_tokens: int, padded: bool = True) -> dict:
    """One architecture, in this process: the outcome and its detail (`padded`: row 1 left-padded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_plookup

    torch.manual_seed(0)
    try:
        base = AutoConfig.for_model(model_type).to_dict()
        kw = {k: v for k, v in shrink(base).items() if k not in ("model_type", "transformers_version", "architectures")}
        config = AutoConfig.for_model(model_type, **kw)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as e:
        return {"status": "no tiny model", "detail": f"{type(e).__name__}: {e}"[:300]}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or 100
    pad = 0
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(3, min(vocab, 100), (2, 6), generator=g)
    ids = phrase.repeat(1, 3)  # n-grams recur: drafts find matches
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3], mask[1, :3] = pad, 0  # row 1 left-padded
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    try:
        with torch.inference_mode():
            ref = model.generate(**kw)
    except Exception as e:
        return {"status": "HF fails", "detail": f"{type(e).__name__}: {e}"[:300]}
    try:
        wrapped = hf_plookup.wrap(model)
    except (ValueError, TypeError) as e:
        return {"status": "refused", "detail": str(e)[:300]}
    except Exception as e:
        return {"status": "crashed", "detail": f"wrap: {type(e).__name__}: {e}"[:300]}
    try:
        out = wrapped.generate(**kw, prompt_lookup_num_tokens=4)
    except Exception as e:
        return {"status": "crashed", "detail": f"{type(e).__name__}: {e}"[:300]}
    stats = wrapped.last_stats
    if stats.delegated:
        return {"status": "delegated", "detail": stats.delegated_reason[:300]}
    same = out.shape == ref.shape and bool(torch.equal(out, ref))
    return {"status": "identical" if same else "differs", "detail": "" if same else f"tokens {out.tolist()} vs {ref.tolist()}"[:300]}


def sweep(types: list[str], max_new_tokens: int, on_result=None) -> list[dict]:
    """`run_one` of each type in this process, in order: its outcome with `model_type` and `seconds`
    (`on_result(result)` after each)."""
    results = []
    for model_type in types:
        t0 = time.perf_counter()
        res = run_one(model_type, max_new_tokens)
        res.update(model_type=model_type, seconds=round(time.perf_counter() - t0, 2))
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results


def counts(results: list[dict]) -> dict[str, int]:
    """{status: how many results have it} for every status of STATUSES."""
    return {s: sum(r["status"] == s for r in results) for s in STATUSES}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", help="config types to run (default: every causal-LM one)")
    p.add_argument("--jobs", type=int, default=2, help="architectures run at once (default: 2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads of each architecture's process (default: 1; jobs x threads should not "
                        "exceed the free cores)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture (default: 120)")
    p.add_argument("--in-process", action="store_true",
                   help="run every architecture in this process, one after another (no --jobs, no --timeout)")
    p.add_argument("--max-new-tokens", type=int, default=12, help="(default: 12)")
    p.add_argument("--out", default="results/arch_sweep", help="writes OUT.md and OUT.json (default: results/arch_sweep)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one architecture, print its JSON
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_one(args.one, args.max_new_tokens)))
        return 0

    import transformers

    types = args.only or causal_lm_types()

    def show(res: dict) -> None:
        print(f"{res['model_type']:28s} {res['status']:14s} {res['detail'][:110]}", flush=True)

    def child(model_type: str) -> dict:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", model_type, "--max-new-tokens",
               str(args.max_new_tokens), "--threads", str(args.threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "NUMBA_NUM_THREADS": str(args.threads),
               "TRANSFORMERS_VERBOSITY": "error"}
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            line = next((s for s in reversed(r.stdout.splitlines()) if s.startswith("{")), None)
            res = json.loads(line) if line else {"status": "crashed", "detail": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
        except subprocess.TimeoutExpired:
            res = {"status": "timeout", "detail": f"over {args.timeout:.0f} s"}
        res.update(model_type=model_type, seconds=round(time.perf_counter() - t0, 1))
        show(res)
        return res

    if args.in_process:
        import torch
        from transformers.utils import logging

        torch.set_num_threads(args.threads)
        logging.set_verbosity_error()
        results = sweep(types, args.max_new_tokens, on_result=show)
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(child, types))
    n = counts(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), report("arch_sweep", argv, args, "cpu", results, counts=n))
    lines = [f"# Architecture sweep (transformers {transformers.__version__}, {len(results)} causal-LM config types)", "",
             " · ".join(f"{s}: {k}" for s, k in n.items() if k), "", "| config type | outcome | detail |", "|---|---|---|"]
    lines += [f"| `{r['model_type']}` | {r['status']} | {r['detail'].replace('|', '/').replace(chr(10), ' ')} |" for r in results]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(" · ".join(f"{s}: {k}" for s, k in n.items() if k))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
