"""The C linears over gptqmodel's 4-bit weights: GPTQ's (`TorchAtenLinear`, made here by
transformers' `GPTQConfig` at load on a tiny random Llama) and AWQ's (`TorchAtenAwqLinear`: a
checkpoint made by gptqmodel's AWQ quantizer, loaded by transformers), which invariant.gptq shows
as plain linears once a bf16 forward has turned them into torch's int4 form: the codes and scales
read are the ones the module's own kernel uses, a linear is bitwise the float linear of those
values and each row as alone, and `F.linear` of the view is the module's forward; the same for a
linear first run in float32, which dequantizes on every call (the "sub_mul_f16" form, from GPTQ's
layout or AWQ's); and the turned form in fp16.
Needs gptqmodel (and optimum for GPTQ; docs/measurements/cpu-avx2-2026-11-29-gptq/NOTES.md: they
do not install from PyPI alone); skipped without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant import gptq
from hf_plookup.invariant.linears import linear_module, linear_weight
from tests.conftest import at_every_simd_level, rows_alone_and_float_linear

pytest.importorskip("gptqmodel")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

ROWS = (1, 2, 5, 9, 13, 40)
# quantization of eval/lib/quantization.py -> the random model it quantizes (AWQ's quantizer takes
# linears of a multiple of 64 outputs, which the tiny Llama's keys and values are not)
MODELS = {"gptq-4bit": "random:tiny-llama", "awq-4bit": "random:tiny-llama-128"}
DEQUANT_VIEWS = {"gptq-4bit": gptq.GptqDequantWeight, "awq-4bit": gptq.AwqDequantWeight}


def _model(quantization: str, dtype: torch.dtype):
    from eval.lib.models import load_model

    if quantization == "gptq-4bit":
        pytest.importorskip("optimum.gptq")  # transformers' GPTQ quantizer calibrates through optimum
    model, _ = load_model(MODELS[quantization], dtype, "cpu", seed=3, quantization=quantization)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 7, 9, 11]]))  # a first forward: bf16 turns the linears
    return model


def _linears(model) -> list:
    return [m for layer in model.model.layers for m in layer.modules() if type(m).__module__.startswith("gptqmodel.")]


@pytest.fixture(scope="module", params=[(q, d) for q in MODELS for d in (torch.bfloat16, torch.float16)],
                ids=lambda p: f"{p[0]}-{str(p[1])[6:]}")
def turned_linears(request):
    """The GPTQ or AWQ linears of a model turned by a first forward in bf16 or fp16 (transformers'
    default dtype "auto" loads most published GPTQ and AWQ checkpoints in fp16)."""
    return _linears(_model(*request.param))


def test_turned_linears_are_linears_whose_f_linear_is_the_modules(turned_linears):
    for m in turned_linears:
        assert gptq.is_gptq_linear(m) and linear_module(m)
        w = linear_weight(m)
        dtype = w.dtype
        assert type(w) is gptq.GptqWeight and tuple(w.shape) == (m.out_features, m.in_features)
        assert dtype in (torch.bfloat16, torch.float16) and linear_weight(m) is w  # made once
        xs = torch.randn(7, m.in_features, generator=torch.Generator().manual_seed(2)).to(dtype)
        with torch.no_grad():
            assert torch.equal(F.linear(xs, w), m(xs))


def test_values_are_the_modules_int4_kernels(turned_linears):
    """The "fma" form's values (float32, exact in float64) rounded to the model's dtype are what a
    1-row call of the module's own kernel gives for each unit vector."""
    read = 0
    for m in turned_linears:
        w = linear_weight(m)
        parts = cpu_kernels.q4_parts(w)
        if parts is None:  # (columns not a whole number of torch's int4pack blocks on this CPU)
            assert m.out_features % cpu_kernels.int4pack_block()
            continue
        read += 1
        n, k = w.shape
        assert (parts.form, parts.offset, parts.group) == ("fma", 8.0, 64)
        codes = parts.codes().view(n, k // parts.group, parts.group).double()
        values = ((codes - 8) * parts.scales[..., None].double() + parts.shifts[..., None].double()).view(n, k)
        with torch.no_grad():
            theirs = m(torch.eye(k, dtype=w.dtype)).t()
        assert torch.equal(values.float().to(w.dtype), theirs)
    assert read > 0


def test_linear_is_the_float_linear_of_its_values_row_by_row(turned_linears):
    x = torch.randn(40, max(m.in_features for m in turned_linears), generator=torch.Generator().manual_seed(3))
    for m in turned_linears:
        w = linear_weight(m)
        parts = cpu_kernels.q4_parts(w)
        if parts is None:
            continue
        n, k = w.shape
        xs = x[:, :k].to(w.dtype)
        codes = parts.codes().view(n, k // parts.group, parts.group).double()
        values = ((codes - 8) * parts.scales[..., None].double() + parts.shifts[..., None].double()).view(n, k).float()
        rows = torch.cat([cpu_kernels.linear(xs[i : i + 1], w, None) for i in range(xs.shape[0])])
        for r in ROWS:
            got = cpu_kernels.linear(xs[:r], w, None)
            assert torch.equal(got, rows[:r])
            assert torch.equal(got, cpu_kernels.linear(xs[:r].float(), values, None).to(w.dtype))
        outs = at_every_simd_level(lambda: [cpu_kernels.linear(xs[:r], w, None) for r in ROWS])
        assert all(torch.equal(a, b) for got in outs.values() for a, b in zip(got, outs[0]))


@pytest.fixture(scope="module", params=list(MODELS))
def fp32_model(request):
    """(quantization, the model): its first forward in float32, so the linears dequantize from then on."""
    return request.param, _model(request.param, torch.float32)


def test_fp32_linears_dequantize_and_are_read_as_gptq_dequantizes(fp32_model):
    """In float32 gptqmodel dequantizes the whole weight on every call: the view's values are its
    dequantized weight (the module's output for each unit vector), `F.linear` of the view is the
    module's forward, and the C linear is the float linear of those values, each row as alone, at
    every SIMD level."""
    quantization, model = fp32_model
    linears = _linears(model)
    assert linears
    x = torch.randn(40, max(m.in_features for m in linears), generator=torch.Generator().manual_seed(4))
    for m in linears:
        assert gptq.is_gptq_linear(m) and linear_module(m) and not m._cpu_transformed
        w = linear_weight(m)
        assert type(w) is DEQUANT_VIEWS[quantization] and w.dtype == torch.float32 and linear_weight(m) is w
        parts = cpu_kernels.q4_parts(w)
        assert (parts.form, parts.offset, parts.group) == ("sub_mul_f16", 0.0, 64)
        n, k = w.shape
        with torch.no_grad():
            theirs = m(torch.eye(k)).t()  # [N, K]: each weight alone
            values = w.dequantized().t().float()
            assert torch.equal(values, theirs)
            xs = x[:, :k]
            assert torch.equal(F.linear(xs, w), m(xs))
        rows_alone_and_float_linear(w, None, values, xs, ROWS)
        outs = at_every_simd_level(lambda: [cpu_kernels.linear(xs[:r], w, None) for r in ROWS])
        assert all(torch.equal(a, b) for got in outs.values() for a, b in zip(got, outs[0]))


def test_an_fp32_gptq_model_decodes_in_the_c_layers_as_hf_greedy(fp32_model):
    """Wrapped in float32, its decode steps run in the C layers over GPTQ's (or AWQ's) own layout,
    and greedy with drafts at batch 1 and 2 equals HF's greedy of the same model."""
    import hf_plookup
    from tests.conftest import left_padded

    fp32_model = fp32_model[1]

    refs = {}
    for batch in (1, 2):
        ids, mask = left_padded(batch, seed=5)
        refs[batch] = (ids, mask, fp32_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16))
    w = hf_plookup.wrap(fp32_model, max_cache_tokens=512, tree_min_score=0.0)
    try:
        assert w._engine.c_layers is not None
        for ids, mask, ref in refs.values():
            for k in (None, 4):
                out = w.generate(ids, attention_mask=mask, max_new_tokens=16, prompt_lookup_num_tokens=k,
                                 do_sample=False)  # (gptqmodel saves AWQ checkpoints with do_sample=True)
                assert torch.equal(out, ref), (k, ids.shape[0])
        assert w._engine.c_layers.on  # the first decode step ran both ways and the C path gave HF's bits
    finally:
        hf_plookup.unwrap(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("quantization", list(MODELS))
def test_a_gptq_model_decodes_in_the_c_layers_losslessly(quantization, dtype):
    """Wrapped in bf16 or fp16 (transformers' dtype "auto" loads most published GPTQ and AWQ
    checkpoints in fp16), its linears turned into torch's int4 form, its decode steps run in the C
    layers (where every linear is read: whole int4pack blocks of columns on this CPU), and greedy
    with drafts at batch 1 and 2 equals its own greedy."""
    import hf_plookup
    from tests.conftest import left_padded

    model = _model(quantization, dtype)
    gptqs = [m for m in model.modules() if gptq.is_gptq_linear(m)]
    read = all(cpu_kernels.q4_parts(linear_weight(m)) is not None for m in gptqs)
    assert gptqs and linear_weight(gptqs[0]).dtype == dtype
    w = hf_plookup.wrap(model, max_cache_tokens=512, tree_min_score=0.0)
    layers = w._engine.c_layers
    assert (layers is not None) == read
    for batch in (1, 2):
        ids, mask = left_padded(batch, seed=5)
        kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)  # (AWQ's saved config samples)
        greedy = w.generate(ids, **kw)
        assert torch.equal(w.generate(ids, prompt_lookup_num_tokens=4, **kw), greedy)
        assert w.last_stats.invariant
    if read:
        assert layers.on  # the first decode step ran both ways and the C path gave the modules' bits
