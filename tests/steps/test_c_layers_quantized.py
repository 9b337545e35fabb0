"""steps.c_layers and the invariant linears on weight-only quantized models (torchao's
`Int8WeightOnlyConfig` and int4 `IntxWeightOnlyConfig`, optimum-quanto's qint8 and qint4, bitsandbytes' nf4 through HF's
`BitsAndBytesConfig`, the LM head left as it is, as HF's quantizers leave it): decode steps run in C
on the quantized weights (cpu.kernels W_Q8, W_Q4) with
bitwise the logits of the same steps through the modules, and greedy with drafts gives HF's greedy of the quantized model (float32) or
hf_plookup's own greedy (bfloat16)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from hf_plookup.api import _state
from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant.linears import linear_module, linear_weight, row_strategy
from hf_plookup.steps.c_layers import llama_form
from tests.conftest import greedy_logits, left_pad, repeat_prompts, tiny_model, wrap_copy

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")


def _torchao(model, config=None):
    tq = pytest.importorskip("torchao.quantization")
    tq.quantize_(model, config or tq.Int8WeightOnlyConfig(),
                 filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    return model


def _torchao_intx4(model):
    """torchao's int4 weights for CPUs (`IntxWeightOnlyConfig`: int4 values one a byte, groups of 32)."""
    tq = pytest.importorskip("torchao.quantization")
    return _torchao(model, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(32)))


def _quanto(model, bits: int = 8):
    quanto = pytest.importorskip("optimum.quanto")
    quanto.quantize(model, weights=quanto.qint8 if bits == 8 else quanto.qint4, exclude=["lm_head"])
    quanto.freeze(model)
    return model


def _bnb_nf4(model, nested: bool = False):
    """`model` saved and loaded again by HF with bitsandbytes' nf4 (its absmax quantized again where
    `nested`: double quantization), computing in the model's dtype, in bitsandbytes' flat layout on
    every CPU (tests/cpu/test_bnb4bit_linear.py says why)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = next(model.parameters()).dtype
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                bnb_4bit_use_double_quant=nested)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, quantization_config=config, device_map="cpu", dtype=dtype).eval()
    return flat_bnb(model)


def flat_bnb(model):
    """`model` with its bitsandbytes 4-bit modules kept in the flat layout on every CPU (their
    repacking on AVX-512 BF16 CPUs turned off, as `wrap` turns it off: invariant.bnb4bit)."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


QUANTIZERS = {"torchao": _torchao, "quanto": _quanto, "quanto-int4": lambda m: _quanto(m, 4), "bnb-nf4": _bnb_nf4,
              "torchao-intx4": _torchao_intx4}
KINDS = {"torchao": cpu_kernels.W_Q8, "quanto": cpu_kernels.W_Q8, "quanto-int4": cpu_kernels.W_Q4,
         "bnb-nf4": cpu_kernels.W_Q4, "torchao-intx4": cpu_kernels.W_Q4}


def _kind(weight) -> int:
    """The weight kind a quantized weight is read as: W_Q4's may be W_Q4K (cpu.kernels.q4_kind)."""
    kind = cpu_kernels.weight_kind(weight)
    parts = cpu_kernels.q4_parts(weight)
    return kind if parts is None or kind != cpu_kernels.q4_kind(weight.shape[1], parts.group) else cpu_kernels.W_Q4


def _quantized(arch: str, dtype: torch.dtype, how: str):
    return QUANTIZERS[how](tiny_model(arch).to(dtype))


@pytest.mark.parametrize("how", list(QUANTIZERS))
def test_quantized_linears_take_the_c_kernel(how):
    model = _quantized("llama", torch.float32, how)
    projections = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert projections and all(linear_module(m) and _kind(linear_weight(m)) == KINDS[how]
                               for m in projections)
    assert all(row_strategy(linear_weight(m), m.bias) == "cpu" for m in projections)
    assert llama_form(model) is None


@pytest.mark.parametrize("how", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_c_layers_on_quantized_weights_give_the_modules_logits(arch, dtype, how):
    hf = _quantized(arch, dtype, how)
    ids, mask = left_pad(repeat_prompts(3))
    fast, plain = wrap_copy(hf, invariant=True), wrap_copy(hf, invariant=True)
    _state(plain).engine.c_layers = None
    got, _ = greedy_logits(fast, ids, mask, 16, prompt_lookup_num_tokens=4)
    want, _ = greedy_logits(plain, ids, mask, 16, prompt_lookup_num_tokens=4)
    layers = _state(fast).engine.c_layers
    assert layers is not None and layers.checked and layers.on
    assert torch.equal(got, want)


@pytest.mark.parametrize("how", list(QUANTIZERS))
def test_quantized_greedy_with_drafts(how):
    """float32: HF's greedy of the same quantized model; bfloat16: lossless against hf_plookup's own
    greedy, batched, with chains and trees."""
    ids, mask = left_pad(repeat_prompts(3))
    hf = _quantized("llama", torch.float32, how)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    model = wrap_copy(hf)
    for kw in ({}, {"prompt_lookup_num_tokens": 4}, {"prompt_lookup_num_tokens": 4, "prompt_lookup_tree_nodes": 8}):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, **kw), want)
    assert _state(model).engine.c_layers.on
    bf = wrap_copy(_quantized("llama", torch.bfloat16, how))
    own = bf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for kw in ({"prompt_lookup_num_tokens": 4}, {"prompt_lookup_num_tokens": 4, "prompt_lookup_tree_nodes": 8}):
        assert torch.equal(bf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, **kw), own)


def test_quanto_int4_tinygemm_form():
    """bfloat16 with groups of 128: quanto keeps its weights in the tinygemm form, which runs in
    inference mode (the plain form does not); decode steps in C, greedy with drafts lossless against
    the model's own greedy."""
    model = _quanto(tiny_model("llama", hidden_size=256, intermediate_size=512).to(torch.bfloat16), 4)
    projections = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert all(type(m.weight).__name__ == "TinyGemmWeightQBitsTensor" for m in projections)
    assert all(cpu_kernels.q4_parts(m.weight).form == "fma" for m in projections)
    ids, mask = left_pad(repeat_prompts(3))
    bf = wrap_copy(model)
    own = bf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    for kw in ({"prompt_lookup_num_tokens": 4}, {"prompt_lookup_num_tokens": 4, "prompt_lookup_tree_nodes": 8}):
        assert torch.equal(bf.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, **kw), own)
    assert _state(bf).engine.c_layers.on and not _state(bf).engine.plan.no_grad


def test_wrap_keeps_bitsandbytes_flat_layout():
    """On a CPU with AVX-512 BF16 bitsandbytes sets each `Linear4bit`'s `support_avx512bf16_for_cpu` at
    load, and repacks the module's codes at its first forward (its own bfloat16 kernel from then on);
    `wrap` turns that off before its probe's forward (invariant.bnb4bit.hold_flat), so the C linears
    read the flat codes and greedy with drafts is HF's greedy of the flat model; `unwrap` turns it on
    again. The flag is set here as such a CPU sets it, so that
    every machine checks the hold (none runs the repacked layout)."""
    import hf_plookup
    from hf_plookup.invariant import bnb4bit

    hf = _quantized("llama", torch.float32, "bnb-nf4")  # (the flat layout: the flags off)
    ids, mask = left_pad(repeat_prompts(3))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    modules = [m for m in hf.modules() if bnb4bit.is_linear4bit(m)]
    for m in modules:
        m.support_avx512bf16_for_cpu = True
    model = hf_plookup.wrap(hf)
    assert bnb4bit.held(model) and not any(m.support_avx512bf16_for_cpu for m in modules)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in modules)
    assert all(_kind(linear_weight(m)) == cpu_kernels.W_Q4 for m in modules)
    assert _state(model).engine.c_layers.on
    hf_plookup.unwrap(model)
    assert not bnb4bit.held(hf) and all(m.support_avx512bf16_for_cpu for m in modules)


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested-absmax"])
def test_wrap_puts_repacked_bitsandbytes_back_flat(nested):
    """A model that ran a forward before `wrap` on a CPU with AVX-512 BF16 has its `Linear4bit`s
    repacked by bitsandbytes (its own layout, the absmax rounded to bf16, a nested one undone). `wrap`
    puts them back in the flat layout with that rounded absmax (invariant.bnb4bit._flatten), and
    the C linears read them: greedy with drafts in fp32 is HF's greedy of the flat model with the
    same absmax. The repacking is bitsandbytes' own function, called here as its forward calls it
    on such a CPU, so that every machine checks the return."""
    import bitsandbytes.functional as bnb_f

    import hf_plookup
    from hf_plookup.invariant import bnb4bit

    hf, reference = (_bnb_nf4(tiny_model("llama"), nested) for _ in range(2))
    for m in (m for m in reference.modules() if bnb4bit.is_linear4bit(m)):  # the repacking's values, flat
        state = m.weight.quant_state
        assert bool(state.nested) == nested
        absmax = bnb_f.dequantize_blockwise(state.absmax, state.state2) + state.offset if nested else state.absmax
        state.absmax, state.nested = absmax.to(torch.bfloat16).float(), False
    ids, mask = left_pad(repeat_prompts(3))
    want = reference.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    modules = [m for m in hf.modules() if bnb4bit.is_linear4bit(m)]
    for m in modules:
        m.weight.data, m.weight.quant_state = bnb_f._convert_weight_packed_for_cpu(m.weight.data, m.weight.quant_state)
        m.support_avx512bf16_for_cpu = True
    assert all(bnb4bit._repacked(m.weight.quant_state) for m in modules)
    model = hf_plookup.wrap(hf)
    assert bnb4bit.held(model) and not any(bnb4bit._repacked(m.weight.quant_state) for m in modules)
    assert all(_kind(linear_weight(m)) == cpu_kernels.W_Q4 for m in modules)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want) and _state(model).engine.c_layers.on
    assert not model.last_stats.exactness_note
    hf_plookup.unwrap(model)
    assert all(m.support_avx512bf16_for_cpu for m in modules)
