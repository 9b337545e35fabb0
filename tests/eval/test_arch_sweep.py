"""eval/arch_sweep.py: the config shrinking (literal cases) and one architecture end to end."""

from __future__ import annotations

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


def test_run_one_llama_is_identical():
    assert run_one("llama", 8) == {"status": "identical", "detail": ""}
