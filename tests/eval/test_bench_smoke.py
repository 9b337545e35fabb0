"""eval/bench.py's CUDA variants end to end on CPU (--smoke: tiny random Qwen3, fp32), so the GPU
measurement cannot rot where no GPU is lent; started as a script, as on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "bench.py"), "--smoke", "--json", str(out), "--tree-nodes", "6"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| random:tiny-qwen3 | 2 | plk-k4 |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["script"] == "bench" and res["machine"]["device"] == "cpu" and res["args"]["smoke"]
    assert res["proposer"]["median_s"] > 0
    (model,) = res["models"]
    assert model["attn_backend"] == "sdpa" and model["bandwidth_bound_step_s"] > 0
    rows = {(r["batch_size"], r["variant"]): r for r in res["results"]}
    assert set(rows) >= {(1, "hf-greedy"), (1, "hf-pl-k4"), (1, "plk-greedy"), (2, "plk-k4"), (2, "plk-k4-eager"),
                         (2, "hf-batch"), (2, "plk-k4-t6")}
    for key, r in rows.items():
        assert r["error"] is None and r["skipped"] is None, (key, r)
        assert r["equal_to_hf_greedy"] == 1.0, key  # fp32: token-identical to HF greedy
        if key[1].startswith("plk"):
            assert r["decode_step_s"] > 0 and r["outside_step_s"] is not None, key
            # unpadded on CPU: a step feeds the drafts the budget kept (engine.budget) + the root
            assert 1 <= r["q"] <= (7 if key[1].endswith("-t6") else 5 if "k4" in key[1] else 1), key
