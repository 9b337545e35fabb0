"""eval/cpu_memory.py end to end on a tiny random Qwen3 (fp32): HF greedy, then `wrap`, then
hf_plookup greedy and prompt lookup on the same object; the JSON holds the memory and time of each
part, and the tokens agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_memory_smoke(tmp_path):
    out = tmp_path / "cpu_memory.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / "cpu_memory.py"), "--model", "random:tiny-qwen3",
                           "--dtype", "fp32", "--prompt-len", "40", "--max-new-tokens", "12", "--threads", "2",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rss = res["rss_bytes"]
    assert set(rss) == {"loaded", "after_hf", "before_wrap", "after_wrap", "after_first_generate"}
    assert all(v > 0 for v in rss.values()) and res["wrap_s"] > 0 and res["weight_bytes"] > 0
    assert res["rss_added_by_wrap_and_first_generate"] == rss["after_first_generate"] - rss["before_wrap"]
    assert res["plk_greedy"]["tokens_equal_hf"] is True  # fp32: the engine's greedy is HF's
    assert res["plk_k4"]["tokens_equal_own_greedy"] is True
    assert res["hf_greedy"]["tok_per_s"] > 0 and res["plk_greedy"]["x_bound"] > 0
