"""steps.c_layers on heterogeneous configs: sizes that differ by layer (Gemma 4's full-attention
layers have heads twice as wide) are read per layer, never from the global config, where reading
them raises transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError: a getattr default
does not catch it). The C layers take one shape for every layer, so such a model keeps its modules,
with the reason said, and generates HF greedy's tokens."""

from __future__ import annotations

import pytest
import torch

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.steps.c_layers import CpuLayers, layer_shape, llama_form
from tests.conftest import BOS, EOS, PAD, left_pad, repeat_prompts, tiny_model, wrap_copy

# Gemma 4's text models: a sliding-attention layer with heads of 16, a full-attention one with heads of 32
GEMMA4 = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"],
              per_layer_config={1: {"head_dim": 32}}, hidden_size_per_layer_input=16, vocab_size_per_layer_input=96,
              sliding_window=8, max_position_embeddings=1024, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)


def _gemma4(model_type: str) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    model = tiny_model(model_type, **GEMMA4)
    if not getattr(model.config, "is_heterogeneous", False):
        pytest.skip("this transformers keeps no per-layer sizes")
    return model


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified_text"])
def test_per_layer_head_sizes_are_read_per_layer(model_type):
    model = _gemma4(model_type)
    with pytest.raises(RuntimeError, match="per-layer attribute"):  # the global value is ambiguous
        getattr(model.config, "head_dim", None)
    layers = model.model.layers
    assert [layer_shape(model.config, la.self_attn, i) for i, la in enumerate(layers)] == [(4, 2, 16), (4, 2, 32)]


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")
def test_layers_of_different_shapes_keep_their_modules_with_the_reason():
    model = _gemma4("gemma4_unified_text")  # its layers are otherwise of the Gemma form the C path takes
    assert llama_form(model) == ("layer 1's attention has 4 heads of 32 over 2 KV heads, layer 0's 4 of 16 over 2: "
                                 "the C layers take one shape for every layer")
    assert CpuLayers.of(model) is None


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified_text"])
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "plain"])
def test_per_layer_head_sizes_generate_hf_greedy_tokens(model_type, invariant):
    """`wrap` once raised AmbiguousGlobalPerLayerAttributeError on these (invariant mode, the CPU
    default, builds the C layers' check)."""
    model = _gemma4(model_type)
    ids, mask = left_pad(repeat_prompts(2))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    with torch.inference_mode():
        want = model.generate(**kw)
    fast = wrap_copy(model, invariant=invariant)
    got = fast.generate(**kw, prompt_lookup_num_tokens=4)
    assert not fast.last_stats.delegated
    assert torch.equal(got, want)
