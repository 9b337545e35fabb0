"""Tensor parallel on CPU: a tiny Llama loaded with `tp_plan="auto"` under torchrun (2 ranks,
gloo) generates through hf_plookup, greedy with prompt lookup at batch 3 identical to
single-process HF greedy, and sampling with a seed drawing the same tokens on every rank.

This file is also the per-rank program: `python -m torch.distributed.run --nproc_per_node 2
tests/test_tensor_parallel.py CHECKPOINT OUT_DIR` (each rank writes OUT_DIR/rank{r}.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234
GEN = dict(max_new_tokens=10, eos_token_id=None)
SAMPLE = dict(do_sample=True, temperature=1.3, top_k=20)


def _prompts():
    from tests.conftest import left_padded

    return left_padded(3, seed=5)


def _rank_main(checkpoint: str, out_dir: str) -> None:
    """One rank: load with the model's tensor-parallel plan, wrap, generate, write the outputs."""
    import hf_plookup
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, tp_plan="auto", dtype=torch.float32).eval()
    rank = torch.distributed.get_rank()
    sharded = type(model.model.layers[0].self_attn.q_proj.weight).__name__  # DTensor when sharded
    wrapped = hf_plookup.wrap(model)  # cache sized from each rank's free RAM: the ranks take the smallest
    ids, mask = _prompts()
    greedy = wrapped.generate(ids, attention_mask=mask, do_sample=False, prompt_lookup_num_tokens=3, **GEN)
    greedy_stats = wrapped.last_stats.as_dict()
    torch.manual_seed(SEED)  # the same seed on every rank: the draws of all ranks agree
    sampled = wrapped.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=3, **SAMPLE, **GEN)
    torch.manual_seed(100 + rank)  # seeded differently: the engine copies rank 0's generator to the others
    unaligned = wrapped.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=3, **SAMPLE, **GEN)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "world_size": torch.distributed.get_world_size(), "weight_type": sharded,
        "local_q_rows": model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0]
        if hasattr(model.model.layers[0].self_attn.q_proj.weight, "to_local") else None,
        "greedy": greedy.tolist(), "sampled": sampled.tolist(), "unaligned": unaligned.tolist(),
        "cache_blocks": wrapped._engine.capacity_blocks, "tensor_parallel": wrapped._engine.tensor_parallel,
        "drafted": greedy_stats["drafted"], "forwards": greedy_stats["forwards"],
    }))
    torch.distributed.destroy_process_group()


def test_tensor_parallel_two_cpu_ranks_match_single_process(tmp_path):
    import hf_plookup
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    checkpoint = tmp_path / "tiny-llama"
    model.save_pretrained(checkpoint)
    ids, mask = _prompts()
    ref = model.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    wrapped = hf_plookup.wrap(model, max_cache_tokens=1024)
    torch.manual_seed(SEED)
    single_sampled = wrapped.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=3, **SAMPLE, **GEN)

    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__)), str(checkpoint), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world_size"] == 2 and r["weight_type"] == "DTensor"  # the weights really are sharded
        assert r["local_q_rows"] == model.model.layers[0].self_attn.q_proj.weight.shape[0] // 2
        assert r["greedy"] == ref.tolist()  # prompt lookup at batch 3 = single-process HF greedy
        assert r["drafted"] > 0 and r["tensor_parallel"]
    assert ranks[0]["cache_blocks"] == ranks[1]["cache_blocks"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"]  # every rank drew the same tokens
    assert ranks[0]["unaligned"] == ranks[1]["unaligned"]  # also when the ranks were seeded differently
    assert ranks[0]["sampled"] != ranks[0]["greedy"]  # and sampling did sample
    # fp32 partial sums are reduced across ranks in another order than one matmul sums them, so
    # single-process sampling may part after a near-tie; with this seed it does not
    assert ranks[0]["sampled"] == single_sampled.tolist()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _rank_main(sys.argv[1], sys.argv[2])
