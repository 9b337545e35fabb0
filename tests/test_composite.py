"""Composite (multimodal) models that `AutoModelForCausalLM` returns for Gemma 3 (4B and larger)
and Gemma 4: text-only prompts run on the engine over the language model's layers, token-identical
to HF greedy with prompt lookup in a left-padded batch; a prompt with an image is delegated to
HF's own `generate`. (Gemma 3n's vision tower needs timm, which does not install beside this
project's torch: not covered.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config, Gemma4Config

from tests.conftest import BOS, EOS, PAD, VOCAB, left_padded, wrap_copy

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=1024, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, initializer_range=0.3)
IMAGE_TOKEN = VOCAB - 1


def _gemma3():
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    return Gemma3Config(text_config={**TEXT, "query_pre_attn_scalar": 24}, vision_config=vision, mm_tokens_per_image=4,
                        image_token_index=IMAGE_TOKEN, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3,
                        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)


def _gemma4():  # text only (no vision or audio tower); its per-layer input embeddings kept small
    text = {**TEXT, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16}
    return Gemma4Config(text_config=text, vision_config=None, audio_config=None, pad_token_id=PAD, eos_token_id=EOS,
                        bos_token_id=BOS)


def _model(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("make, cls", [(_gemma3, "Gemma3ForConditionalGeneration"),
                                       (_gemma4, "Gemma4ForConditionalGeneration")])
def test_text_prompts_run_on_the_engine(make, cls):
    model = _model(make())
    assert type(model).__name__ == cls
    ids, mask = left_padded(3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    ref = model.generate(**kw)
    wrapped = wrap_copy(model)
    out = wrapped.generate(**kw, prompt_lookup_num_tokens=4)
    stats = wrapped.last_stats
    assert not stats.delegated and stats.drafted > 0 and stats.forwards < 20
    assert torch.equal(out, ref)


def test_a_prompt_with_an_image_is_delegated():
    model = _model(_gemma3())
    ids, _ = left_padded(1)
    ids = torch.cat([torch.full((1, 4), IMAGE_TOKEN), ids[:, -10:]], 1)  # the image's 4 soft tokens, then text
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(1, 3, 32, 32),
              max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    ref = model.generate(**kw)
    wrapped = wrap_copy(model)
    out = wrapped.generate(**kw, prompt_lookup_num_tokens=4)
    assert wrapped.last_stats.delegated and "pixel_values" in wrapped.last_stats.delegated_reason
    assert torch.equal(out, ref)
