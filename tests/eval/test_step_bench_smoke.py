"""eval/step_bench.py end to end on CPU (tiny random Qwen3, fp32): the eager step as the engine runs
it (steps.runner.ModelRunner), its invariant form, the same with the weights on the allocator's pages
(--small-pages), the breakdown of a C-layers step and the kernels alone from memory and from cache
(--kernels); and the multiply-adds it counts for the compute bound, on a literal case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import transformers

from eval.step_bench import step_macs
from hf_plookup.cpu import huge_pages

ROOT = Path(__file__).resolve().parents[2]


def test_step_bench_smoke(tmp_path):
    out = tmp_path / "step_bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "step_bench.py"), "--models", "tiny-qwen3", "--device", "cpu",
                           "--dtype", "fp32", "--modes", "eager", "--invariant", "--breakdown", "--small-pages", "--kernels", "--q", "1", "3",
                           "--context", "40", "--iters", "2", "--threads", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    (model,) = res["models"]
    assert model["model"] == "tiny-qwen3" and model["bandwidth_bound_s"] > 0 and model["read_bound_s"] > 0
    assert model["gemm_macs_per_s"] > 0 and set(model["macs"]) == {"1", "3"}
    rows = {(r["mode"], r["q"]): r for r in res["results"]}
    pages = ("eager+invariant/2M-pages", "eager+invariant/small-pages") if model["huge_pages"] else ()
    assert model["huge_pages"] == huge_pages.available()  # the engine's CPU weights on 2 MB pages where Linux has them
    kernels = tuple(f"kernels/{k}/{w}" for k in ("linears", "attention") for w in ("memory", "cache"))
    assert set(rows) == {(m, q) for m in ("eager", "eager+invariant", "breakdown", *pages, *kernels) for q in (1, 3)}
    assert all(r["step_s"] > 0 for r in rows.values())
    for m in ("eager", "eager+invariant"):  # the q values timed side by side: ratios to q=1
        assert rows[(m, 1)]["vs_q1"] == 1.0 and rows[(m, 3)]["vs_q1"] > 0
    for q in (1, 3) if pages else ():  # both copies of the weights in the same rounds: ratios to 2 MB pages
        assert rows[(pages[0], q)]["vs_2M_pages"] == 1.0 and rows[(pages[1], q)]["vs_2M_pages"] > 0
    for m in kernels:  # each kernel's q values and its two sources timed in the same rounds
        assert rows[(m, 1)]["vs_q1"] == 1.0 and rows[(m, 3)]["vs_q1"] > 0
        assert all(rows[(m, q)]["vs_cache"] == 1.0 if m.endswith("cache") else rows[(m, q)]["vs_cache"] > 0
                   for q in (1, 3))
        assert all(rows[(m, q)]["of_gemm"] > 0 for q in (1, 3))
    for q in (1, 3):
        b = rows[("breakdown", q)]
        assert b["c_layers"], "a Qwen3 decode step runs the C layers"
        assert b["parts_s"]["attention kernel"] > 0 and b["parts_s"]["LM head"] > 0


def _llama(**kw):
    cfg = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=kw.pop("layers", 1),
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10, **kw)
    return transformers.LlamaForCausalLM(cfg)


def test_step_macs_literal():
    # per token: q and o 8 x 8, k and v 8 x 4, gate, up and down 8 x 16: 576; the head 8 x 10; token t of 2
    # after 3 cached sees 4 + t keys, a query . key and a weight x value row (4 + 4) for each of 2 heads
    assert step_macs(_llama(), batch=1, q=2, context=3) == {"linears": 1152, "LM head": 160, "attention": 144}
    assert step_macs(_llama(), batch=3, q=2, context=3) == {"linears": 3456, "LM head": 480, "attention": 432}
    # a sliding window of 4 on the second of two layers: its tokens see 4 keys each, not 4 and 5
    m = _llama(layers=2, sliding_window=4, layer_types=["full_attention", "sliding_attention"])
    assert step_macs(m, batch=1, q=2, context=3)["attention"] == 144 + 2 * 8 * (4 + 4)
