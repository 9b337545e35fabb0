"""eval/summarize.py and eval/bench.py end to end on tiny random models (CPU, seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eval import bench, summarize
from eval.lib import calls

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--num-docs", "4", "--batch-size", "2", "--max-new-tokens", "12", "--k", "2", "4", "--threads", "1",
         "--rouge-backend", "rouge_score"]


def test_summarize_main_passes_accuracy_check(tiny_chat_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    rc = summarize.main(["--model", str(tiny_chat_ckpt), *SMALL, "--with-hf-plookup", "--check-accuracy", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "accuracy check passed" in printed and "| hf_plookup k=4 |" in printed
    res = json.loads((out / "results.json").read_text())
    names = [v["name"] for v in res["results"]]
    assert names == ["hf-greedy", "plk-k2", "plk-k4", "hf-pl-k2", "hf-pl-k4"]
    for v in res["results"]:
        assert v["num_docs"] == 4 and v["exact_match"] == 1.0  # fp32: every document identical
        assert v["new_tokens"] > 0 and v["tokens_per_second"] > 0
    plk = res["results"][2]
    assert len(plk["acceptance_per_position"]) == 4 and plk["tokens_per_forward"] >= 1.0
    assert res["prompt_style"] == "chat" and res["prompt"].startswith("chat template") and res["num_processes"] == 1
    assert res["machine"]["threads"] == 1  # --threads survives hf_plookup.wrap()
    assert len(res["documents"]) == 4 * 5
    assert (out / "results.md").exists() and (out / "results.png").exists()


def test_summarize_main_fails_accuracy_check(tiny_ckpt, tmp_path, capsys, monkeypatch):
    real = calls.run_plookup

    def corrupted(*args, **kwargs):  # an engine that gets the last token of every row wrong
        res = real(*args, **kwargs)
        res.tokens = [t[:-1] + [t[-1] + 1] if t else t for t in res.tokens]
        return res

    monkeypatch.setattr(calls, "run_plookup", corrupted)
    rc = summarize.main(["--model", str(tiny_ckpt), *SMALL, "--check-accuracy", "--out", str(tmp_path), "--no-plot"])
    assert rc == 1
    captured = capsys.readouterr()
    assert "ACCURACY CHECK FAILED" in captured.err and "exact match 0.000 < 1.0" in captured.err
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["prompt_style"] == "fewshot"  # no chat template: a base model's few-shot prompt
    assert "prompt style fewshot" in (tmp_path / "results.md").read_text()
    assert res["accuracy_check"]["failures"] and res["results"][1]["mean_first_divergence"] > 0
    # without --check-accuracy the same run reports but exits 0
    assert summarize.main(["--model", str(tiny_ckpt), *SMALL, "--out", str(tmp_path), "--no-plot"]) == 0


def test_bench_main(tiny_ckpt, tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc = bench.main(["--model", str(tiny_ckpt), "--batch-sizes", "1", "3", "--k", "3", "--num-prompts", "2",
                     "--max-new-tokens", "8", "--device", "cpu", "--threads", "1", "--json", str(path)])
    assert rc == 0
    assert "| 3 | plk-k3 |" in capsys.readouterr().out
    res = json.loads(path.read_text())
    assert res["script"] == "bench" and res["args"]["batch_sizes"] == [1, 3] and res["machine"]["threads"] == 1
    rows = res["results"]
    assert [(r["batch_size"], r["variant"]) for r in rows] == [
        (1, "hf-greedy"), (1, "hf-pl-k3"), (1, "plk-greedy"), (1, "plk-k3"),
        (3, "hf-greedy"), (3, "plk-greedy"), (3, "plk-k3")]
    for r in rows:
        assert r["skipped"] is None and r["tokens_per_second"] > 0
        assert r["equal_to_hf_greedy"] == 1.0
    assert rows[0]["ratio_to_hf_greedy"] == 1.0


def test_summarize_two_processes(tiny_ckpt, tmp_path):
    """accelerate launch with 2 CPU processes: documents sharded, one merged report."""
    out = tmp_path / "dp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(REPO / "eval" / "summarize.py"), "--model", str(tiny_ckpt), "--device", "cpu",
           "--num-docs", "5", "--batch-size", "2", "--max-new-tokens", "6", "--k", "2",
           "--check-accuracy", "--no-plot", "--rouge-backend", "rouge_score", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["num_processes"] == 2
    assert sorted({d["index"] for d in res["documents"]}) == [0, 1, 2, 3, 4]
    assert sorted({(b["rank"], b["batch"]) for b in res["batches"] if b["variant"] == "hf-greedy"}) == [(0, 0), (0, 1), (1, 0)]
    assert all(v["exact_match"] == 1.0 for v in res["results"])


def test_draft_replay_with_step_costs(tiny_chat_ckpt, tmp_path, capsys):
    """eval/draft_replay.py on a step bench's costs: the budget's drafters beside the fixed ones, and
    every drafter's modeled decode speed over greedy (greedy itself: 1 token a step, speed 1)."""
    from eval import draft_replay

    costs = tmp_path / "steps.json"
    costs.write_text(json.dumps({"results": [
        {"mode": "eager+invariant", "batch": 1, "q": q, "step_s": s} for q, s in ((1, 0.020), (5, 0.024), (9, 0.030))]
        + [{"mode": "eager", "batch": 1, "q": 1, "step_s": 0.05}]}))
    path = tmp_path / "replay.json"
    rc = draft_replay.main(["--model", str(tiny_chat_ckpt), "--num-prompts", "2", "--max-new-tokens", "12", "--k", "3",
                            "--tree-nodes", "4", "--threads", "1", "--step-costs", str(costs), "--json", str(path)])
    assert rc == 0 and "modeled decode speed x greedy" in capsys.readouterr().out
    rows = {r["drafter"]: r for r in json.loads(path.read_text())["results"]}
    assert {"chain (budget)", "tree 6 (budget)", "tree 4 (budget)", "chain (min score 0)"} <= set(rows)
    for name, r in rows.items():
        if name != "within-document oracle":
            assert r["modeled_speed_vs_greedy"] > 0 and r["tokens_per_forward"] >= 1.0, name
    assert draft_replay.step_costs(str(costs)).seconds(np.array([1, 9])).tolist() == [0.020, 0.030]  # invariant rows


def test_summarize_with_draft_memory(tiny_ckpt, tmp_path):
    """--draft-memory: each hf_plookup variant drafts from its own earlier calls; outputs unchanged."""
    rc = summarize.main(["--model", str(tiny_ckpt), *SMALL, "--draft-memory", "256", "--check-accuracy",
                         "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["args"]["draft_memory"] == 256 and all(v["exact_match"] == 1.0 for v in res["results"])
    with pytest.raises(SystemExit):
        summarize.parse_args(["--draft-memory", "-1"])
