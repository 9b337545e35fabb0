"""eval/prefix_bench.py: its workloads' inputs (literal cases) and the calls workload on a tiny model."""

from __future__ import annotations

import copy

import torch

import hf_plookup
from eval import prefix_bench
from eval.lib.models import load_model


def test_chat_alternates_stories_and_follow_ups():
    msgs = prefix_bench.chat_messages(4)
    assert len(msgs) == 4
    assert msgs[0].endswith("Summarize the story above in two sentences.") and len(msgs[0]) > 1000
    assert msgs[1] == prefix_bench.CHAT_FOLLOW_UPS[0] and msgs[3] == prefix_bench.CHAT_FOLLOW_UPS[1]
    assert msgs[2] != msgs[0]  # the next story


def test_fewshot_requests_share_their_examples():
    reqs = prefix_bench.fewshot_requests(n_shots=2, n_queries=3)
    assert len(reqs) == 3 and all(gen == {"until": ["\n\n", "Article:"]} for _, gen in reqs)
    shots = reqs[0][0][: reqs[0][0].rindex("Article:")]
    assert shots.count("Highlights:") == 2 and all(ctx.startswith(shots) for ctx, _ in reqs)
    assert all(ctx.endswith("\nHighlights:") for ctx, _ in reqs)


def test_calls_sharing_a_document_come_from_the_pool(tiny_ckpt):
    model, tok = load_model(str(tiny_ckpt), torch.float32, "cpu")
    wrapped = hf_plookup.wrap(copy.copy(model), block_size=8, max_batch_tokens=32, max_cache_tokens=4096, invariant=True)
    doc = torch.randint(5, 60, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [doc + [7 + q, 8, 9] for q in range(4)]
    hf = prefix_bench.run_calls(model, tok, prompts, None, 6)
    res = prefix_bench.run_calls(wrapped, tok, prompts, 4, 6)
    assert res["outputs"] == hf["outputs"] and hf["cached_prompt_tokens"] == 0
    assert res["cached_prompt_tokens"] == 3 * 96  # the three later calls: 3 whole 32-token units each
    assert res["cached_share_after_first"] == 96 / 123
