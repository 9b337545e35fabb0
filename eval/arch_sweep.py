"""Every causal-LM architecture transformers ships, tiny and random: does hf_plookup run it as HF does?

For each config type in transformers' causal-LM mapping, a tiny model is built from the default
config with its sizes shrunk (2 layers, hidden 64, 4 heads, ... in the config and its sub-configs),
then HF greedy and hf_plookup (prompt lookup k=4) generate from the same left-padded batch of 2.
Each architecture runs in its own process with a time limit. Outcomes:

- identical: hf_plookup ran on its engine and returned HF's tokens;
- delegated: hf_plookup handed the call to HF's `generate` (its reason);
- refused: `wrap` raised (its message);
- differs: the engine ran and the tokens are not HF's;
- crashed: hf_plookup raised inside `generate`;
- no tiny model / HF fails: the tiny model could not be built, or HF's own `generate` failed.

    python eval/arch_sweep.py                       # all of them, 2 at a time (about 10 min on 2 cores)
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
}
STATUSES = ("identical", "delegated", "refused", "differs", "crashed", "no tiny model", "HF fails", "timeout")


def shrink(d: dict, layers_before: int | None = None) -> dict:
    """A config dict with TINY's sizes where it has the fields; lists as long as the old layer
    count (per-layer types) cut to the new one; sub-config dicts shrunk the same way."""
    out = dict(d)
    n_old = d.get("num_hidden_layers") or layers_before
    for k, v in TINY.items():
        if k in out and v is not None and isinstance(out[k], int):
            out[k] = v
    if "kv_lora_rank" in out:  # multi-head latent attention: one key/value head per query head
        out["num_key_value_heads"] = out.get("num_attention_heads")
        if "head_dim" in out and "qk_rope_head_dim" in out:  # head_dim is the rotary part there
            out["head_dim"] = out["qk_rope_head_dim"]
    n_new = out.get("num_hidden_layers", n_old)
    for k, v in d.items():
        if isinstance(v, dict) and "model_type" in v:
            out[k] = shrink(v, n_old)
        elif isinstance(v, dict) and v and all(str(i).isdigit() for i in v) and n_new:  # per-layer settings
            out[k] = {i: x for i, x in v.items() if int(i) < n_new}
        elif isinstance(v, list) and n_old and len(v) == n_old and n_new != n_old:
            kinds = list(dict.fromkeys(v)) if all(isinstance(x, str) for x in v) else []
            # per-layer kinds (sliding/full attention, linear attention, ...): keep one layer of each
            out[k] = (kinds + v)[:n_new] if 1 < len(kinds) <= n_new else v[:n_new]
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
    if out.get("is_decoder") is False and layers_before is None:
        # BERT-style models attend both ways unless told they decode (HF warns "add is_decoder=True"
        # when one is built as a causal LM): a causal LM checkpoint of them carries it
        out["is_decoder"] = True
    if isinstance(out.get("num_key_value_heads"), int) and isinstance(out.get("num_attention_heads"), int):
        if out["num_attention_heads"] % out["num_key_value_heads"]:
            out["num_key_value_heads"] = out["num_attention_heads"]
    return out


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
        print(f"{model_type:28s} {res['status']:14s} {res['detail'][:110]}", flush=True)
        return res

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(child, types))
    counts = {s: sum(r["status"] == s for r in results) for s in STATUSES}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), report("arch_sweep", argv, args, "cpu", results, counts=counts))
    lines = [f"# Architecture sweep (transformers {transformers.__version__}, {len(results)} causal-LM config types)", "",
             " · ".join(f"{s}: {n}" for s, n in counts.items() if n), "", "| config type | outcome | detail |", "|---|---|---|"]
    lines += [f"| `{r['model_type']}` | {r['status']} | {r['detail'].replace('|', '/').replace(chr(10), ' ')} |" for r in results]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(" · ".join(f"{s}: {n}" for s, n in counts.items() if n))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
