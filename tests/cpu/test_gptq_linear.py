"""The C linears over GPTQ weights (gptqmodel's `TorchAtenLinear`, made here by transformers'
`GPTQConfig` at load on a tiny random Llama), which invariant.gptq shows as plain linears once a bf16
forward has turned them into torch's int4 form: the codes and scales read are the ones the module's
own kernel uses, a linear is bitwise the float linear of those values and each row as alone, and
`F.linear` of the view is the module's forward; the same for a linear first run in float32, which
dequantizes on every call (the "sub_mul_f16" form); and the turned form in fp16.
Needs gptqmodel and optimum (docs/measurements/cpu-avx2-2026-11-29-gptq/NOTES.md: they do not
install from PyPI alone); skipped without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant import gptq
from hf_plookup.invariant.linears import linear_module, linear_weight
from tests.conftest import at_every_simd_level, rows_alone_and_float_linear

pytest.importorskip("gptqmodel")
pytest.importorskip("optimum.gptq")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

ROWS = (1, 2, 5, 9, 13, 40)


def _model(dtype: torch.dtype):
    from eval.lib.models import load_model

    model, _ = load_model("random:tiny-llama", dtype, "cpu", seed=3, quantization="gptq-4bit")
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 7, 9, 11]]))  # a first forward: bf16 turns the linears
    return model


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def turned_linears(request):
    """The GPTQ linears of a model turned by a first forward in bf16 or fp16 (transformers' default
    dtype "auto" loads most published GPTQ checkpoints in fp16)."""
    model = _model(request.param)
    return [m for layer in model.model.layers for m in layer.modules() if type(m).__module__.startswith("gptqmodel.")]


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
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    for m in turned_linears:
        w = linear_weight(m)
        x = x.to(w.dtype)
        parts = cpu_kernels.q4_parts(w)
        if parts is None or m.in_features != 64:
            continue
        n, k = w.shape
        codes = parts.codes().view(n, k // parts.group, parts.group).double()
        values = ((codes - 8) * parts.scales[..., None].double() + parts.shifts[..., None].double()).view(n, k).float()
        rows = torch.cat([cpu_kernels.linear(x[i : i + 1], w, None) for i in range(x.shape[0])])
        for r in ROWS:
            got = cpu_kernels.linear(x[:r], w, None)
            assert torch.equal(got, rows[:r])
            assert torch.equal(got, cpu_kernels.linear(x[:r].float(), values, None).to(w.dtype))
        outs = at_every_simd_level(lambda: [cpu_kernels.linear(x[:r], w, None) for r in ROWS])
        assert all(torch.equal(a, b) for got in outs.values() for a, b in zip(got, outs[0]))


@pytest.fixture(scope="module")
def fp32_model():
    return _model(torch.float32)  # (its first forward, in float32: the linears dequantize from then on)


def test_fp32_linears_dequantize_and_are_read_as_gptq_dequantizes(fp32_model):
    """In float32 gptqmodel dequantizes the whole weight on every call: the view's values are its
    dequantized weight (the module's output for each unit vector), `F.linear` of the view is the
    module's forward, and the C linear is the float linear of those values, each row as alone, at
    every SIMD level."""
    linears = [m for layer in fp32_model.model.layers for m in layer.modules()
               if type(m).__module__.startswith("gptqmodel.")]
    assert linears
    x = torch.randn(40, max(m.in_features for m in linears), generator=torch.Generator().manual_seed(4))
    for m in linears:
        assert gptq.is_gptq_linear(m) and linear_module(m) and not m._cpu_transformed
        w = linear_weight(m)
        assert type(w) is gptq.GptqDequantWeight and w.dtype == torch.float32 and linear_weight(m) is w
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
    """Wrapped in float32, its decode steps run in the C layers over GPTQ's own layout, and greedy
    with drafts at batch 1 and 2 equals HF's greedy of the same model."""
    import hf_plookup
    from tests.conftest import left_padded

    refs = {}
    for batch in (1, 2):
        ids, mask = left_padded(batch, seed=5)
        refs[batch] = (ids, mask, fp32_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16))
    w = hf_plookup.wrap(fp32_model, max_cache_tokens=512, tree_min_score=0.0)
    try:
        assert w._engine.c_layers is not None
        for ids, mask, ref in refs.values():
            for k in (None, 4):
                out = w.generate(ids, attention_mask=mask, max_new_tokens=16, prompt_lookup_num_tokens=k)
                assert torch.equal(out, ref), (k, ids.shape[0])
        assert w._engine.c_layers.on  # the first decode step ran both ways and the C path gave HF's bits
    finally:
        hf_plookup.unwrap(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_gptq_model_decodes_in_the_c_layers_losslessly(dtype):
    """Wrapped in bf16 or fp16 (transformers' dtype "auto" loads most published GPTQ checkpoints in
    fp16), its linears turned into torch's int4 form, its decode steps run in the C layers (where
    every GPTQ linear is read: whole int4pack blocks of columns on this CPU), and greedy with drafts
    at batch 1 and 2 equals its own greedy."""
    import hf_plookup
    from tests.conftest import left_padded

    model = _model(dtype)
    gptqs = [m for m in model.modules() if gptq.is_gptq_linear(m)]
    read = all(cpu_kernels.q4_parts(linear_weight(m)) is not None for m in gptqs)
    assert gptqs and linear_weight(gptqs[0]).dtype == dtype
    w = hf_plookup.wrap(model, max_cache_tokens=512, tree_min_score=0.0)
    layers = w._engine.c_layers
    assert (layers is not None) == read
    for batch in (1, 2):
        ids, mask = left_padded(batch, seed=5)
        kw = dict(attention_mask=mask, max_new_tokens=16)
        greedy = w.generate(ids, **kw)
        assert torch.equal(w.generate(ids, prompt_lookup_num_tokens=4, **kw), greedy)
        assert w.last_stats.invariant
    if read:
        assert layers.on  # the first decode step ran both ways and the C path gave the modules' bits
