"""wrap(): passthrough, options, restoration of the model, bad input, block accounting on errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_plookup
from tests.conftest import PAD, REFUSED_ARCHS, left_padded, tiny_model


@pytest.fixture()
def pair():
    model = tiny_model("llama")
    return model, hf_plookup.wrap(model, max_cache_tokens=2048)


def test_passthrough(pair, tmp_path):
    model, wrapped = pair
    assert wrapped.config is model.config and wrapped.device == model.device
    assert wrapped.model is model and wrapped.generation_config is model.generation_config
    ids, mask = left_padded(2)
    torch.testing.assert_close(wrapped(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    wrapped.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
    wrapped.some_flag = 3  # attributes set on the wrapper land on the model
    assert model.some_flag == 3
    assert "PlookupModel" in repr(wrapped)


def test_wrap_twice_is_harmless(pair):
    model, wrapped = pair
    assert hf_plookup.wrap(wrapped) is wrapped
    again = hf_plookup.wrap(wrapped, block_size=8)
    assert again.model is model and again.options.block_size == 8 and again.options.max_cache_tokens == 2048
    ids, mask = left_padded(2)
    assert torch.equal(again.generate(ids, attention_mask=mask, max_new_tokens=5), wrapped.generate(ids, attention_mask=mask, max_new_tokens=5))


def test_model_unchanged_outside_generate(pair):
    model, wrapped = pair
    impl = model.config._attn_implementation
    ids, mask = left_padded(2)
    before = model(ids, attention_mask=mask).logits
    wrapped.generate(ids, attention_mask=mask, max_new_tokens=6, prompt_lookup_num_tokens=3)
    assert model.config._attn_implementation == impl
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, before)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert ref.shape[1] == ids.shape[1] + 6


@pytest.mark.parametrize("arch", sorted(REFUSED_ARCHS))
def test_unsupported_architecture_named_at_wrap_time(arch):
    """Decided by a probe forward, not by a class flag: the message names the class, the
    architecture and the reason."""
    config = AutoConfig.for_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} \(architecture '{arch}'\).*{REFUSED_ARCHS[arch]}"):
        hf_plookup.wrap(model)


def test_layer_sharing_another_layers_keys_is_refused():
    """Cross-layer KV sharing (a layer attending with another layer's index) cannot get pages of its own."""
    model = tiny_model("llama")
    model.model.layers[1].self_attn.layer_idx = 0
    with pytest.raises(ValueError, match=r"layers \[1\] do not call"):
        hf_plookup.wrap(model)


def test_cache_layout_from_real_keys_not_config_fields():
    """A GPT-NeoX config carrying num_key_value_heads=2 (the architecture ignores it): pages get
    the 4 heads the keys really have."""
    model = tiny_model("gpt_neox_kv_field")
    assert model.config.num_key_value_heads == 2
    wrapped = hf_plookup.wrap(model, max_cache_tokens=256)
    assert {s.num_kv_heads for s in wrapped._engine.specs} == {4}
    ids, mask = left_padded(2)
    assert torch.equal(wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=3),
                       model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))


def test_bad_wrap_options():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="unknown hf_plookup.wrap option"):
        hf_plookup.wrap(model, cache_size=10)
    with pytest.raises(ValueError, match="block_size"):
        hf_plookup.wrap(model, block_size=0)
    with pytest.raises(ValueError, match="max_cache_tokens"):
        hf_plookup.wrap(model, max_cache_tokens=-5)
    with pytest.raises(TypeError, match="model"):
        hf_plookup.wrap("not a model")


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        ({"prompt_lookup_num_tokens": 0}, ValueError, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": -2}, ValueError, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": 2.5}, TypeError, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": True}, TypeError, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 0}, ValueError, "max_matching_ngram_size"),
        ({"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": "2"}, TypeError, "max_matching_ngram_size"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be greater than 0"),
    ],
)
def test_bad_generate_arguments(pair, kwargs, exc, name):
    _, wrapped = pair
    ids, mask = left_padded(2)
    kwargs.setdefault("max_new_tokens", 5)
    with pytest.raises(exc, match=name):
        wrapped.generate(ids, attention_mask=mask, **kwargs)
    assert wrapped._engine.blocks is None or wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks


def test_bad_inputs(pair):
    _, wrapped = pair
    ids, mask = left_padded(3)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="row 1 is empty"):
        wrapped.generate(ids, attention_mask=empty, max_new_tokens=4)
    with pytest.raises(ValueError, match="attention_mask"):
        wrapped.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=4)
    with pytest.raises(TypeError, match="input_ids"):
        wrapped.generate([[1, 2, 3]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_length"):
        wrapped.generate(ids, attention_mask=mask, max_length=ids.shape[1])
    vocab = wrapped.get_input_embeddings().weight.shape[0]
    for bad in (vocab, -1):
        oov = ids.clone()
        oov[2, -1] = bad
        with pytest.raises(ValueError, match=rf"input_ids holds token id {bad}, outside the vocabulary .* size {vocab}"):
            wrapped.generate(oov, attention_mask=mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="attention_mask must hold only 0 and 1"):
        wrapped.generate(ids, attention_mask=mask * 2, max_new_tokens=4)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        wrapped.generate(ids, attention_mask=mask.tolist(), max_new_tokens=4)
    with pytest.raises(ValueError, match="no rows"):
        wrapped.generate(ids[:0], max_new_tokens=4)
    assert wrapped._engine.blocks is None or wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks


def test_prompt_that_cannot_fit_names_the_option():
    model = tiny_model("llama")
    wrapped = hf_plookup.wrap(model, max_cache_tokens=32, block_size=8)
    ids, mask = left_padded(1)
    with pytest.raises(ValueError, match="max_cache_tokens"):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=10)
    assert wrapped._engine.blocks is None or wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks


def test_blocks_all_free_after_an_error_mid_generation():
    model = tiny_model("llama")
    wrapped = hf_plookup.wrap(model, max_cache_tokens=2048, block_size=4)
    calls = {"n": 0}

    def explode(module, args, output):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")

    handle = model.model.layers[1].register_forward_hook(explode)
    ids, mask = left_padded(3)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            wrapped.generate(ids, attention_mask=mask, max_new_tokens=10, prompt_lookup_num_tokens=4)
    finally:
        handle.remove()
    blocks = wrapped._engine.blocks
    assert blocks.num_free == blocks.num_blocks and not blocks.tables
    assert model.config._attn_implementation != "hf_plookup"
    assert wrapped.last_stats is not None and wrapped.last_stats.forwards == 3
    # and the engine still works afterwards
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(wrapped.generate(ids, attention_mask=mask, max_new_tokens=10, prompt_lookup_num_tokens=4), ref)


def test_delegates_what_engine_does_not_do(pair, caplog):
    model, wrapped = pair
    ids, mask = left_padded(2)
    with caplog.at_level("WARNING", logger="hf_plookup"):
        out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False)
    assert torch.equal(out, ref)
    assert wrapped.last_stats.delegated and "num_beams" in wrapped.last_stats.delegated_reason
    assert "delegating" in caplog.text


def test_wrap_keeps_torch_thread_count():
    """numba's threading start-up (proposer warm-up) must not change the user's torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf_plookup.wrap(tiny_model("llama"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
