"""wrap(): the wrapped model is the model (class swap: isinstance, chaining, copies, pickling,
device/dtype changes, saving, unwrap), options, restoration of the model, bad input, block
accounting on errors."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, LlamaForCausalLM, PreTrainedModel

import hf_plookup
from tests.conftest import PAD, REFUSED_ARCHS, left_padded, tiny_model, wrap_copy


@pytest.fixture()
def pair():
    """(plain reference model, wrapped model): the same weights, two objects."""
    # every draft fed: what the tests count must not depend on the machine (conftest.wrap_copy)
    return tiny_model("llama"), hf_plookup.wrap(tiny_model("llama"), max_cache_tokens=2048, tree_min_score=0.0)


def greedy(model, n=20, batch=2):
    ids, mask = left_padded(batch)
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


def plookup(model, n=20, batch=2):
    ids, mask = left_padded(batch)
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, prompt_lookup_num_tokens=3)


def test_wrap_returns_the_same_model_with_its_class_swapped():
    model = tiny_model("llama")
    wrapped = hf_plookup.wrap(model, max_cache_tokens=2048)
    assert wrapped is model
    for cls in (LlamaForCausalLM, PreTrainedModel, GenerationMixin, torch.nn.Module, hf_plookup.PlookupModel):
        assert isinstance(wrapped, cls), cls
    assert type(wrapped).__name__ == type(wrapped).__qualname__ == "LlamaForCausalLM"
    assert type(wrapped) is type(hf_plookup.wrap(tiny_model("llama")))  # one swapped class per model class
    assert type(wrapped).can_generate()
    assert not any("plookup" in name for name in wrapped.state_dict())
    assert not any("plookup" in name for name, _ in wrapped.named_modules())


def test_calls_and_attributes_are_the_models(pair):
    model, wrapped = pair
    ids, mask = left_padded(2)
    torch.testing.assert_close(wrapped(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    assert wrapped.model is wrapped.get_decoder()  # HF's own attribute (the decoder), not hf_plookup's
    assert "LlamaForCausalLM(" in repr(wrapped) and "Plookup" not in repr(wrapped)


@pytest.mark.parametrize("chain", ["eval", "train", "to", "cpu", "float", "requires_grad_", "half_then_float"])
def test_chained_methods_return_the_wrapped_model(pair, chain):
    """Each returns the same object and prompt lookup still runs after it (drafts in last_stats)."""
    model, wrapped = pair
    calls = {"eval": lambda m: m.eval(), "train": lambda m: m.train().eval(), "to": lambda m: m.to("cpu", torch.float32),
             "cpu": lambda m: m.cpu(), "float": lambda m: m.float(), "requires_grad_": lambda m: m.requires_grad_(False),
             "half_then_float": lambda m: m.half().float()}
    out = calls[chain](wrapped)
    assert out is wrapped and isinstance(out, hf_plookup.PlookupModel)
    assert torch.equal(plookup(out), greedy(calls[chain](model)))  # the reference gets the same call
    assert out.last_stats.drafted > 0 and not out.last_stats.delegated


def test_train_mode_returns_the_wrapped_model(pair):
    _, wrapped = pair
    assert wrapped.train() is wrapped and wrapped.training
    assert wrapped.train(False) is wrapped and not wrapped.training


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_copies_and_pickling_round_trip(pair, how):
    model, wrapped = pair
    first = plookup(wrapped)
    clone = {"deepcopy": copy.deepcopy, "copy": copy.copy,
             "pickle": lambda m: pickle.loads(pickle.dumps(m))}[how](wrapped)
    assert clone is not wrapped and type(clone) is type(wrapped)
    assert clone.options == wrapped.options
    assert clone.__dict__["_hf_plookup"].engine is None  # rebuilt on first use
    assert torch.equal(plookup(clone), first) and torch.equal(first, greedy(model))
    assert clone.last_stats.drafted > 0
    if how != "copy":
        assert clone.lm_head.weight is not wrapped.lm_head.weight
        torch.testing.assert_close(clone.lm_head.weight, wrapped.lm_head.weight)
    assert torch.equal(plookup(wrapped), first)  # the original is untouched


def test_dtype_changes_rebuild_the_engine(pair):
    """fp32 -> bf16 -> fp32: each change rebuilds the cache pages (and probe) at the next
    generate, which then matches the plain model's greedy in that dtype."""
    model, wrapped = pair
    ref32 = greedy(model)
    assert torch.equal(plookup(wrapped), ref32)
    first = wrapped._engine
    assert wrapped.bfloat16() is wrapped
    out16 = plookup(wrapped)
    assert wrapped._engine is not first and {s.dtype for s in wrapped._engine.specs} == {torch.bfloat16}
    assert torch.equal(out16, greedy(model.bfloat16()))
    assert wrapped.float() is wrapped
    assert torch.equal(plookup(wrapped), greedy(model.float()))  # (bf16-rounded weights: not ref32)
    assert {s.dtype for s in wrapped._engine.specs} == {torch.float32}
    same = wrapped._engine
    plookup(wrapped)
    assert wrapped._engine is same  # nothing changed: kept


def test_save_pretrained_writes_a_plain_checkpoint(pair, tmp_path):
    _, wrapped = pair
    wrapped.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "plookup" not in (tmp_path / "config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is LlamaForCausalLM and not isinstance(loaded, hf_plookup.PlookupModel)
    theirs, ours = loaded.state_dict(), wrapped.state_dict()
    assert theirs.keys() == ours.keys()
    for name in ours:
        assert torch.equal(theirs[name], ours[name]), name


def test_unwrap_restores_the_plain_model(pair):
    model, wrapped = pair
    plookup(wrapped)
    plain = hf_plookup.unwrap(wrapped)
    assert plain is wrapped and type(plain) is LlamaForCausalLM
    assert not isinstance(plain, hf_plookup.PlookupModel) and "_hf_plookup" not in plain.__dict__
    assert torch.equal(greedy(plain), greedy(model))
    assert hf_plookup.unwrap(plain) is plain  # not wrapped: as is
    with pytest.raises(TypeError, match="model"):
        hf_plookup.unwrap("not a model")
    again = hf_plookup.wrap(plain, tree_min_score=0.0)  # and it wraps again
    assert torch.equal(plookup(again), greedy(model)) and again.last_stats.drafted > 0


def test_wrap_twice_is_harmless(pair):
    _, wrapped = pair
    engine = wrapped._engine
    assert hf_plookup.wrap(wrapped) is wrapped and wrapped._engine is engine
    again = hf_plookup.wrap(wrapped, block_size=8)
    assert again is wrapped and again.options.block_size == 8 and again.options.max_cache_tokens == 2048
    assert again._engine is not engine and again._engine.options.block_size == 8
    assert type(again).__mro__.count(hf_plookup.PlookupModel) == 1  # not swapped twice
    ids, mask = left_padded(2)
    assert torch.equal(again.generate(ids, attention_mask=mask, max_new_tokens=5),
                       hf_plookup.unwrap(again).generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))


def test_refused_model_keeps_its_class():
    model = tiny_model("llama")
    model.model.layers[1].self_attn.layer_idx = 0
    with pytest.raises(ValueError):
        hf_plookup.wrap(model)
    assert type(model) is LlamaForCausalLM and "_hf_plookup" not in model.__dict__


def test_model_unchanged_outside_generate(pair):
    ref, model = pair  # model: the wrapped one; ref: a plain copy of its weights
    wrapped = model
    impl = model.config._attn_implementation
    ids, mask = left_padded(2)
    before = model(ids, attention_mask=mask).logits
    wrapped.generate(ids, attention_mask=mask, max_new_tokens=6, prompt_lookup_num_tokens=3)
    assert model.config._attn_implementation == impl
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, before)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False),
                       ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("arch", sorted(REFUSED_ARCHS))
def test_unsupported_architecture_named_at_wrap_time(arch):
    """Decided by a probe forward, not by a class flag: the message names the class, the
    architecture and the reason."""
    config = AutoConfig.for_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} \(architecture '{arch}'\).*{REFUSED_ARCHS[arch]}"):
        hf_plookup.wrap(model)


def test_attention_kernel_unlike_eager_named_with_the_fix():
    """A model whose configured attention kernel computes other than its eager attention (as
    sdpa dropped Gemma 2's attention softcap before transformers 5.2x): refused, the message
    naming the kernel and the fix."""
    from transformers import AttentionInterface
    from transformers.models.gemma2 import modeling_gemma2

    def no_softcap(module, query, key, value, attention_mask, **kwargs):
        return modeling_gemma2.eager_attention_forward(module, query, key, value, attention_mask,
                                                       **{**kwargs, "softcap": None})

    AttentionInterface.register("no_softcap", no_softcap)
    model = tiny_model("gemma2")
    model.config._attn_implementation = "no_softcap"
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM.*attn_implementation='no_softcap'.*differ from its eager "
                                         r".*attn_implementation='eager'"):
        hf_plookup.wrap(model)
    assert type(model) is modeling_gemma2.Gemma2ForCausalLM


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
                       tiny_model("gpt_neox_kv_field").generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))


def test_bad_wrap_options():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="unknown hf_plookup.wrap option"):
        hf_plookup.wrap(model, cache_size=10)
    with pytest.raises(ValueError, match="block_size"):
        hf_plookup.wrap(model, block_size=0)
    with pytest.raises(ValueError, match="max_cache_tokens"):
        hf_plookup.wrap(model, max_cache_tokens=-5)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        hf_plookup.wrap(model, max_batch_tokens=0)
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
    ref = tiny_model("llama").generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
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


def test_prefill_chunk_by_device():
    """max_batch_tokens: what the user gives, else the device type's default (engine.plan.MAX_BATCH_TOKENS)."""
    from hf_plookup.engine.plan import MAX_BATCH_TOKENS

    model = tiny_model("llama")
    assert wrap_copy(model, max_cache_tokens=512)._engine.options.max_batch_tokens == MAX_BATCH_TOKENS["cpu"] == 1024
    assert wrap_copy(model, max_cache_tokens=512, max_batch_tokens=48)._engine.options.max_batch_tokens == 48
