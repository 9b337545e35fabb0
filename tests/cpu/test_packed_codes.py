"""cpu.packed_codes: a quantized weight's codes held once, in the C kernels' packed bytes. For each
quantizer the C linears read (torchao int8, optimum-quanto int8 and int4 in both of its forms,
bitsandbytes nf4, GPTQ where gptqmodel is installed, compressed-tensors' W4A16 and W8A16): after `pack_quantized` the library's code
tensors are gone (no live tensor holds their memory), the model's logits and the C linears' outputs
are bitwise what they were, `state_dict` gives the same plain tensors, an in-place write reaches the
packed bytes, and `unpack_quantized` (and `hf_plookup.unwrap`) gives plain tensors back. The layouts'
inverses are checked against the libraries' own packing with literal cases."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch

import hf_plookup
from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.cpu.packed_codes import PackedCodes, _bnb_layout, _int4pack_layout, _Packed, pack_quantized, \
    unpack_quantized
from hf_plookup.invariant.linears import linear_of, linear_weight
from tests.conftest import tiny_model
from tests.steps.test_c_layers_quantized import QUANTIZERS, flat_bnb

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

DTYPES = [torch.float32, torch.bfloat16]


def _gptq(model):
    """A GPTQ 4-bit tiny Llama (eval.lib.quantization), turned into torch's int4 form by a first bf16
    forward (a float32 GPTQ model keeps its own codes: invariant.gptq)."""
    pytest.importorskip("gptqmodel")
    pytest.importorskip("optimum.gptq")
    from eval.lib.models import load_model

    model, _ = load_model("random:tiny-llama", torch.bfloat16, "cpu", seed=3, quantization="gptq-4bit")
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 7, 9, 11]]))
    return model


def _compressed_tensors(preset: str):
    """The tiny Llama compressed by compressed-tensors (`preset`, groups of 32: eval.lib.quantization)
    and held compressed (invariant.compressed_tensors), as `wrap` holds a loaded checkpoint."""
    def make(model):
        pytest.importorskip("compressed_tensors")
        from eval.lib.quantization import compress
        from hf_plookup.invariant import compressed_tensors

        compress(model, preset, group=32)
        assert compressed_tensors.hold_compressed(model) == 14
        return model

    return make


HOW = {**QUANTIZERS, "gptq": _gptq, "compressed-tensors": _compressed_tensors("W4A16"),
       "compressed-tensors-w8": _compressed_tensors("W8A16")}
# every quantizer in both dtypes, but GPTQ in bfloat16 only (a float32 GPTQ linear is not read by the C
# linears: invariant.gptq)
CASES = [pytest.param(how, dtype, id=f"{how}-{str(dtype)[6:]}") for how in HOW for dtype in DTYPES
         if how != "gptq" or dtype == torch.bfloat16]


def _model(how: str, dtype: torch.dtype):
    return HOW[how](tiny_model("llama").to(dtype))


def _code_tensors(model) -> list[torch.Tensor]:
    """The plain tensor that holds each projection's codes (cpu.kernels.values_of)."""
    return [cpu_kernels.values_of(linear_weight(m)) for name, m in model.named_modules() if name.endswith("_proj")]


def _storages_alive(refs: list) -> int:
    """How many of the storages `refs` (weak references) some tensor still holds."""
    gc.collect()
    return sum(r() is not None for r in refs)


def _plain_state(model) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each tensor subclass (torchao's) given as its flattened inner tensors."""
    out = {}
    for key, t in model.state_dict().items():
        if type(t) is torch.Tensor:
            out[key] = t.clone()
        else:
            names, _ = t.__tensor_flatten__()
            for n in names:
                inner = getattr(t, n)
                assert type(inner) is torch.Tensor, f"{key}.{n} is a {type(inner).__name__}"
                out[f"{key}.{n}"] = inner.clone()
    return out


def _storage_refs(model) -> list:
    return [weakref.ref(t.untyped_storage()) for t in _code_tensors(model)]


@pytest.mark.parametrize("how, dtype", CASES)
def test_codes_held_once_and_every_reader_sees_the_same_values(how, dtype):
    model = _model(how, dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    weights = [linear_weight(m) for name, m in model.named_modules() if name.endswith("_proj")]
    x = torch.randn(3, weights[0].shape[1], generator=torch.Generator().manual_seed(1)).to(weights[0].dtype)
    with torch.no_grad():
        logits, last = model(ids).logits, model(ids[:1, :1]).logits
        c_out = cpu_kernels.linear(x, weights[0], None)
        state = _plain_state(model)
    refs = _storage_refs(model)
    del weights
    assert _storages_alive(refs) == 14
    assert pack_quantized(model, linear_of) == 14 and pack_quantized(model, linear_of) == 0  # 7 projections a layer; once
    assert all(isinstance(t, _Packed) for t in _code_tensors(model))
    assert _storages_alive(refs) == 0  # the libraries' own code tensors are gone
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits) and torch.equal(model(ids[:1, :1]).logits, last)
        first = next(m for name, m in model.named_modules() if name.endswith("_proj"))
        assert torch.equal(cpu_kernels.linear(x, linear_weight(first), None), c_out)
        got = _plain_state(model)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    assert all(isinstance(t, _Packed) for t in _code_tensors(model))  # packed again after state_dict
    assert unpack_quantized(model, linear_of) == 14
    assert all(type(t) is torch.Tensor for t in _code_tensors(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_an_in_place_write_reaches_the_packed_bytes():
    model = QUANTIZERS["torchao"](tiny_model("llama"))
    proj = model.model.layers[0].self_attn.q_proj
    other = QUANTIZERS["torchao"](tiny_model("llama", seed=5)).model.layers[0].self_attn.q_proj
    x = torch.randn(3, proj.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want_module, want_c = other(x), cpu_kernels.linear(x, other.weight, other.bias)
        pack_quantized(model, linear_of)
        proj.load_state_dict(other.state_dict())  # torchao's copy_ writes into the PackedCodes
        assert isinstance(proj.weight.qdata, PackedCodes)
        assert torch.equal(proj(x), want_module) and torch.equal(cpu_kernels.linear(x, proj.weight, proj.bias), want_c)


def test_layouts_inverse_the_libraries_packing():
    block = cpu_kernels.int4pack_block()
    if block is not None:
        n, k = 2 * block, 64
        codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
        to_codes, from_codes = _int4pack_layout(n, k)
        torch_packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
        assert torch.equal(from_codes(codes.to(torch.uint8)), torch_packed)
        assert torch.equal(to_codes(torch_packed), codes.to(torch.uint8))
    # bitsandbytes: codes of the weight in order, two a byte, the first in the high nibble
    to_codes, from_codes = _bnb_layout(2, 2, (2, 1))
    codes = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8)
    assert from_codes(codes).flatten().tolist() == [0x12, 0x34]
    assert torch.equal(to_codes(from_codes(codes)), codes)


def test_pickled_codes_are_the_plain_tensor():
    model = QUANTIZERS["quanto-int4"](tiny_model("llama"))
    data = model.model.layers[0].mlp.up_proj.weight._data
    before = data._data.clone()
    pack_quantized(model, linear_of)
    assert isinstance(data._data, PackedCodes)
    again = pickle.loads(pickle.dumps(data._data))
    assert type(again) is torch.Tensor and torch.equal(again, before)


def test_wrap_packs_the_codes_and_unwrap_gives_them_back():
    model = QUANTIZERS["quanto"](tiny_model("llama"))
    before = [t.clone() for t in _code_tensors(model)]
    wrapped = hf_plookup.wrap(model, invariant=True)
    assert all(isinstance(t, PackedCodes) for t in _code_tensors(wrapped))
    plain = hf_plookup.unwrap(wrapped)
    codes = _code_tensors(plain)
    assert all(type(t) is torch.Tensor for t in codes) and all(torch.equal(a, b) for a, b in zip(codes, before))


def test_a_layout_that_does_not_round_trip_keeps_the_library_codes(monkeypatch):
    """The guard: an inverse that gives other bytes than the library's (here one bit flipped) leaves
    every code tensor as it was, and the model computes as before."""
    import hf_plookup.cpu.packed_codes as packed_codes

    real = packed_codes._home

    def flipped(module, weight):
        home = real(module, weight)
        wrong = lambda codes: home.from_codes(codes) ^ 1  # noqa: E731
        return packed_codes.Home(home.owner, home.attr, home.to_codes, wrong, home.holder)

    model = QUANTIZERS["torchao"](tiny_model("llama"))
    ids = torch.tensor([[5, 7, 9, 11]])
    with torch.no_grad():
        want = model(ids).logits
    monkeypatch.setattr(packed_codes, "_home", flipped)
    assert pack_quantized(model, linear_of) == 0
    assert all(type(t) is torch.Tensor for t in _code_tensors(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_save_pretrained_of_a_wrapped_4bit_model_reloads_the_same_model(tmp_path):
    """A wrapped bitsandbytes model saves a plain checkpoint (its codes rebuilt for `state_dict`) that
    HF loads back into the same logits, and stays packed itself."""
    from transformers import AutoModelForCausalLM

    model = QUANTIZERS["bnb-nf4"](tiny_model("llama"))
    ids = torch.tensor([[5, 7, 9, 11, 13]])
    with torch.no_grad():
        want = model(ids).logits
    wrapped = hf_plookup.wrap(model, invariant=True)
    wrapped.save_pretrained(tmp_path)
    assert all(isinstance(t, _Packed) for t in _code_tensors(wrapped))
    back = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu").eval()
    assert type(back.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    flat_bnb(back)  # (bitsandbytes' flat layout, as the model compared against)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


def test_a_wrapped_model_generates_with_weights_loaded_in_place():
    """`load_state_dict` into a wrapped quantized model (torchao's `copy_` writes codes and scales in
    place): its next greedy call, decode steps in the C layers included, is HF's greedy of the model
    it loaded."""
    from hf_plookup.api import _state
    from tests.conftest import left_pad, repeat_prompts

    model = QUANTIZERS["torchao"](tiny_model("llama"))
    other = QUANTIZERS["torchao"](tiny_model("llama", seed=7))
    ids, mask = left_pad(repeat_prompts(2))
    want = other.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    wrapped = hf_plookup.wrap(model, invariant=True)
    wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        wrapped.load_state_dict(other.state_dict())
    assert all(isinstance(t, PackedCodes) for t in _code_tensors(wrapped))
    got = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                           prompt_lookup_num_tokens=4)
    layers = _state(wrapped).engine.c_layers
    assert layers is not None and layers.checked and layers.on
    assert torch.equal(got, want)
