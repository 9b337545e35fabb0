"""What a user is told: a prompt longer than the model's context gets HF's warning before any
work, and a refused architecture is named with what it lacks, not with an internal error."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_plookup
from tests.conftest import left_padded, tiny_model, wrap_copy

HF_REMINDER = "the current text generation call has exceeded the model's predefined maximum length (32)"


def _past_context_records(caplog, logger_name):
    return [r for r in caplog.records if r.name.startswith(logger_name) and HF_REMINDER in r.getMessage()]


def test_past_context_warns_like_hf_before_the_first_forward(caplog):
    model = tiny_model("llama", max_position_embeddings=32)
    wrapped = wrap_copy(model, max_cache_tokens=256, block_size=8)
    ids, mask = left_padded(2, seed=3)  # [2, L]
    ids, mask = ids[:, -30:], mask[:, -30:]
    warned_before_forward = []
    handle = model.register_forward_pre_hook(
        lambda *_: warned_before_forward.append(bool(_past_context_records(caplog, "hf_plookup"))))
    try:
        with caplog.at_level(logging.WARNING):
            out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=6, prompt_lookup_num_tokens=2)
    finally:
        handle.remove()
    assert out.shape[1] == ids.shape[1] + 6  # a warning, as HF gives, not an error
    (record,) = _past_context_records(caplog, "hf_plookup")
    assert record.levelno == logging.WARNING and "input_ids: 30 tokens, max_new_tokens: 6" in record.getMessage()
    assert warned_before_forward and warned_before_forward[0], "warned only after work had started"

    caplog.clear()  # HF gives the same reminder (once per process, during its loop)
    with caplog.at_level(logging.WARNING):
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    hf_lines = _past_context_records(caplog, "transformers")
    if hf_lines:  # absent when an earlier test in this process already triggered HF's warning_once
        assert HF_REMINDER in hf_lines[0].getMessage()


def test_within_context_no_warning(caplog):
    model = tiny_model("llama", max_position_embeddings=32)
    wrapped = hf_plookup.wrap(model, max_cache_tokens=256, block_size=8)
    ids, mask = left_padded(1, seed=3)
    ids, mask = ids[:, -20:], mask[:, -20:]
    with caplog.at_level(logging.WARNING, logger="hf_plookup"):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=12)  # 32 tokens: exactly the context
    assert not _past_context_records(caplog, "hf_plookup")


def test_falcon_refusal_says_what_is_missing():
    config = AutoConfig.for_model("falcon", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as info:
        hf_plookup.wrap(model)
    message = str(info.value)
    assert "FalconForCausalLM (architecture 'falcon')" in message
    assert "compute attention themselves" in message and "AttentionInterface" in message
    assert "NoneType" not in message and "TypeError" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert torch.is_grad_enabled()  # the probe's inference_mode did not leak


def test_seed_argument_says_how_to_seed(llama):
    """`generate(seed=...)` (vLLM's spelling) is no HF argument: a TypeError naming it and saying how
    to seed, before any work; torch.manual_seed makes a sampled call repeatable."""
    wrapped = wrap_copy(llama, max_cache_tokens=256)
    ids, mask = left_padded(2, seed=4)
    with pytest.raises(TypeError, match=r"'seed'.*torch\.manual_seed"):
        wrapped.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=4, seed=0)
    assert wrapped.last_stats is None  # nothing ran
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(wrapped.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=8))
    assert torch.equal(runs[0], runs[1])
