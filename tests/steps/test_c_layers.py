"""steps.c_layers: decode steps of Llama- and Gemma-form models in C give bitwise the logits of the same
steps through HF's modules (invariant mode), and the first decode step's check keeps the modules
wherever they differ."""

from __future__ import annotations

import pytest
import torch

from hf_plookup.api import _state
from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.steps.c_layers import llama_form
from tests.conftest import greedy_logits, left_pad, repeat_prompts, tiny_model, wrap_copy

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

# mistral with a sliding window of 8, qwen3 with per-head q/k norms; gemma2 and gemma3_text with norms on
# the attention's and the MLP's outputs, scaled embeddings, sliding layers (gemma3_text: their own
# rotary tables), gemma2 with soft-capped attention and logits
TAKEN = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"]


def _layers(model):
    return _state(model).engine.c_layers


def _both(hf, **gen):
    """Greedy logits [B, new, V] of the engine with its C layers and without (the modules)."""
    ids, mask = left_pad(repeat_prompts(3))
    fast, plain = wrap_copy(hf, invariant=True), wrap_copy(hf, invariant=True)
    _state(plain).engine.c_layers = None
    got, _ = greedy_logits(fast, ids, mask, 16, **gen)
    want, _ = greedy_logits(plain, ids, mask, 16, **gen)
    return got, want, _layers(fast)


def test_llama_form_names_what_it_does_not_take():
    assert llama_form(tiny_model("llama")) is None
    assert llama_form(tiny_model("qwen3")) is None  # per-head q_norm and k_norm
    assert "qkv_proj" in llama_form(tiny_model("phi3"))
    assert "post_feedforward_layernorm" in llama_form(tiny_model("olmo2"))
    assert llama_form(tiny_model("gpt_neox")).startswith("not a decoder of model.model")
    mixed = tiny_model("llama")
    mixed.lm_head.half()
    assert llama_form(mixed) == ("its weights are not all plain (or quantized as the C linears read) CPU tensors "
                                 "of one dtype, float32, bfloat16 or float16")


# every architecture the C layers take in fp32 and bf16; fp16 (the same kernels, its own roundings) on
# a Llama, a Qwen3 (q/k norms) and a Gemma 3 (four norms a layer, "one_plus" norms, local layers)
DTYPE_CASES = ([(a, torch.float32) for a in TAKEN] + [(a, torch.bfloat16) for a in TAKEN]
               + [(a, torch.float16) for a in ("llama", "qwen3", "gemma3_text")])


@pytest.mark.parametrize("arch, dtype", DTYPE_CASES, ids=[f"{a}-{str(d)[6:]}" for a, d in DTYPE_CASES])
@pytest.mark.parametrize("gen", [{}, {"prompt_lookup_num_tokens": 4},
                                 {"prompt_lookup_num_tokens": 4, "prompt_lookup_tree_nodes": 8}],
                         ids=["greedy", "chain", "tree"])
def test_c_layers_give_the_modules_logits(arch, dtype, gen):
    got, want, layers = _both(tiny_model(arch).to(dtype), **gen)
    assert layers is not None and layers.checked and layers.on
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["granite", "smollm3"])
def test_check_keeps_the_modules_where_they_differ(arch):
    """Granite scales embeddings, residuals and logits, SmolLM3 leaves RoPE out of some layers:
    Llama-shaped, other forwards. The first decode step's check finds it and the modules stay."""
    hf = tiny_model(arch)
    assert llama_form(hf) is None
    got, want, layers = _both(hf, prompt_lookup_num_tokens=4)
    assert layers.checked and not layers.on
    assert torch.equal(got, want)


def test_swapped_weights_are_read_again():
    """The C structs hold raw addresses: a weight replaced (or its `.data` swapped) after a call
    is picked up at the next step, as the modules would."""
    hf = tiny_model("llama")
    fast, plain = wrap_copy(hf, invariant=True), wrap_copy(hf, invariant=True)
    _state(plain).engine.c_layers = None
    ids, mask = left_pad(repeat_prompts(2))
    before, _ = greedy_logits(fast, ids, mask, 8, prompt_lookup_num_tokens=4)
    g = torch.Generator().manual_seed(3)
    down = hf.model.layers[1].mlp.down_proj
    down.weight.data = torch.randn(down.weight.shape, generator=g) * 0.2
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().flip(0).clone())
    got, _ = greedy_logits(fast, ids, mask, 8, prompt_lookup_num_tokens=4)
    want, _ = greedy_logits(plain, ids, mask, 8, prompt_lookup_num_tokens=4)
    assert _layers(fast).on and not torch.equal(got, before)
    assert torch.equal(got, want)


def test_hooked_modules_run_their_forwards():
    """A forward hook on a module the C path skips (a layer, the LM head) fires in every step, as
    without hf_plookup: such steps run the modules. Removing the hook brings the C path back."""
    hf = tiny_model("llama")
    model = wrap_copy(hf, invariant=True)
    ids, mask = left_pad(repeat_prompts(2))
    seen = []
    handle = hf.model.layers[1].register_forward_hook(lambda m, a, out: seen.append(a[0].shape[1]))
    try:
        _, stats = greedy_logits(model, ids, mask, 8, prompt_lookup_num_tokens=4)
    finally:
        handle.remove()
    assert len(seen) == stats.forwards and not _layers(model).checked
    greedy_logits(model, ids, mask, 8, prompt_lookup_num_tokens=4)
    assert _layers(model).on


def test_wrapped_forwards_run():
    """A layer whose forward was replaced on the instance (as accelerate's hooks do) runs it in
    every step."""
    hf = tiny_model("llama")
    model = wrap_copy(hf, invariant=True)
    layer = hf.model.layers[0]
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = forward
    ids, mask = left_pad(repeat_prompts(2))
    try:
        _, stats = greedy_logits(model, ids, mask, 8, prompt_lookup_num_tokens=4)
    finally:
        del layer.forward
    assert len(calls) == stats.forwards and not _layers(model).checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("gen", [{}, {"prompt_lookup_num_tokens": 4},
                                 {"prompt_lookup_num_tokens": 4, "prompt_lookup_tree_nodes": 8}],
                         ids=["greedy", "chain", "tree"])
def test_head_screen_gives_the_full_heads_tokens(dtype, gen):
    """Greedy steps in C take their tokens from the head's int8 screen (steps.head_screen): the same
    tokens as the full head's argmax (head_screen=False), and in fp32 as HF's greedy."""
    hf = tiny_model("llama").to(dtype)
    ids, mask = left_pad(repeat_prompts(3))
    kw = dict(max_new_tokens=20, do_sample=False, **gen)
    screened, full = wrap_copy(hf, invariant=True), wrap_copy(hf, invariant=True, head_screen=False)
    got = screened.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, full.generate(ids, attention_mask=mask, **kw))
    if dtype == torch.float32:  # (HF's own prompt lookup takes one row: its plain greedy)
        assert torch.equal(got, hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))
    screen = _layers(screened).screen
    assert screen.steps > 0 and screen.fallbacks == 0
    assert _layers(full).screen is None


@pytest.mark.parametrize("gen", [{}, {"prompt_lookup_num_tokens": 4},
                                 {"prompt_lookup_num_tokens": 4, "prompt_lookup_tree_nodes": 8}],
                         ids=["greedy", "chain", "tree"])
def test_head_screen_takes_processors_that_only_ban_tokens(gen):
    """`suppress_tokens`, `min_new_tokens` and `min_length` only set some tokens' scores to -inf:
    greedy steps under them still take the screen's tokens, those tokens taken out, and give HF's
    greedy under the same processors, where the bans change the text."""
    hf = tiny_model("llama")
    ids, mask = left_pad(repeat_prompts(3))
    plain = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    new = plain[:, ids.shape[1]:]
    values, counts = new.unique(return_counts=True)
    kw = dict(max_new_tokens=20, do_sample=False, suppress_tokens=[int(values[counts.argmax()])],
              min_new_tokens=12, min_length=ids.shape[1] + 6, eos_token_id=int(new[0, 2]))  # (an EOS met early)
    model = wrap_copy(hf, invariant=True)
    got = model.generate(ids, attention_mask=mask, **kw, **gen)
    assert torch.equal(got, hf.generate(ids, attention_mask=mask, **kw))
    assert got.shape != plain.shape or not torch.equal(got, plain)
    screen = _layers(model).screen
    assert screen.steps > 0 and screen.fallbacks == 0


def test_bans_only_names_the_processors_that_only_ban_tokens():
    from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                        RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor)

    from hf_plookup.drafting.sampling import bans_only

    bans = [MinNewTokensLengthLogitsProcessor(4, 2, 0), SuppressTokensLogitsProcessor([5])]
    assert bans_only(LogitsProcessorList(bans)) and bans_only(LogitsProcessorList())
    assert not bans_only(LogitsProcessorList([*bans, RepetitionPenaltyLogitsProcessor(1.2)]))


def test_head_screen_only_where_tokens_are_all_a_step_needs():
    """Recorded logits, a logits processor that changes scores (a repetition penalty) or sampling
    need the logits: the screen stays idle."""
    hf = tiny_model("llama")
    model = wrap_copy(hf, invariant=True)
    ids, mask = left_pad(repeat_prompts(2))
    greedy_logits(model, ids, mask, 8, prompt_lookup_num_tokens=4)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, repetition_penalty=1.2)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=4)
    assert _layers(model).screen.steps == 0
    with pytest.raises(ValueError, match="head_screen must be True or False"):
        wrap_copy(hf, head_screen="yes")
