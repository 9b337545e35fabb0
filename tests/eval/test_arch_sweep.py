"""eval/arch_sweep.py: the config shrinking (literal cases) and one architecture end to end."""

from __future__ import annotations

import pytest

from eval.arch_sweep import run_one, shrink


def test_shrink_sizes_layers_and_sub_configs():
    config = {
        "model_type": "x", "num_hidden_layers": 6, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000,
        "layer_types": ["sliding", "sliding", "full", "sliding", "sliding", "full"],
        "rope_scaling": {"type": "linear"},
        "per_layer": {"0": "a", "5": "b"},
        "text_config": {"model_type": "y", "num_hidden_layers": 4, "intermediate_size": 11008, "rope_theta": 1e4},
    }
    assert shrink(config) == {
        "model_type": "x", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 32000,
        "layer_types": ["sliding", "full"],  # one layer of each kind
        "rope_scaling": {"type": "linear"},
        "per_layer": {"0": "a"},  # settings of layers that are gone are dropped
        "text_config": {"model_type": "y", "num_hidden_layers": 2, "intermediate_size": 128, "rope_theta": 1e4},
    }


def test_shrink_latent_attention_keeps_a_key_head_per_query_head():
    out = shrink({"model_type": "m", "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
                  "qk_rope_head_dim": 64, "head_dim": 64})
    assert out["num_key_value_heads"] == out["num_attention_heads"] == 4
    assert out["head_dim"] == out["qk_rope_head_dim"] == 8


def test_shrink_mamba2_heads_fill_the_mixer_width():
    # expand x hidden size: 2 x 64 = 8 heads of 16
    assert shrink({"model_type": "m", "hidden_size": 4096, "mamba_expand": 2, "mamba_n_heads": 128, "mamba_d_head": 64,
                   "mamba_d_state": 256}) == {"model_type": "m", "hidden_size": 64, "mamba_expand": 2,
                                              "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16}
    # a width of its own (Falcon-H1's mamba_d_ssm): 1024 = 128 heads of 8
    out = shrink({"model_type": "f", "hidden_size": 4096, "mamba_expand": 2, "mamba_n_heads": 128, "mamba_d_head": 8,
                  "mamba_d_ssm": 1024})
    assert (out["mamba_n_heads"], out["mamba_d_head"]) == (128, 8)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen3_next"])
def test_run_one_identical(arch):
    """Llama; DeepSeek V3, whose values are narrower than its keys; Qwen3-Next, whose gated delta
    net layers keep a recurrent state."""
    assert run_one(arch, 8) == {"status": "identical", "detail": ""}


def test_whisper_decoder_ignores_logits_to_keep_and_still_matches_hf():
    """Whisper's decoder returns every row's logits whatever logits_to_keep says: the engine picks
    the kept rows itself."""
    res = run_one("whisper", 8, padded=False)
    assert res == {"status": "identical", "detail": ""}


@pytest.mark.parametrize("arch", ["whisper", "bart"])
def test_padded_batch_on_positions_counted_from_the_cache(arch):
    """Whisper's and BART's forwards take no position_ids, so HF counts a left-padded row's pads
    into its positions; the engine hands their position embeddings those positions."""
    assert run_one(arch, 8, padded=True) == {"status": "identical", "detail": ""}


def test_bert_is_swept_as_a_decoder():
    """BERT-style configs are built with is_decoder=True (HF asks for it to generate)."""
    assert shrink({"model_type": "bert", "is_decoder": False, "num_hidden_layers": 12})["is_decoder"] is True
    assert run_one("bert", 8) == {"status": "identical", "detail": ""}
