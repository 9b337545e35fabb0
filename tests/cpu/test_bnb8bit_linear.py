"""The C linears over bitsandbytes' LLM.int8 (`Linear8bitLt`, weight kind W_Q8B: cpu_kernels.h): each
row quantized with its own outliers and summed as bitsandbytes' call of that row alone, the codes read
where bitsandbytes keeps them. Checked against a plain torch reference of that arithmetic (its
integer sums in float64, exact), at every row count and SIMD level; the modules are bitsandbytes' own,
held by invariant.bnb8bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant import bnb8bit
from hf_plookup.invariant.linears import linear_weight
from tests.conftest import at_every_simd_level

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _held(weight: torch.Tensor, dtype: torch.dtype, bias: bool = True, threshold: float = 6.0):
    """A `Linear8bitLt` of `weight` [N, K] quantized by bitsandbytes (eval mode, its bias in `dtype`),
    held for a model of `dtype`: (module, its Bnb8bitWeight)."""
    n, k = weight.shape
    module = bnb.nn.Linear8bitLt(k, n, bias=bias, has_fp16_weights=False, threshold=threshold)
    module.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
    if bias:
        module.bias = torch.nn.Parameter(torch.linspace(-1, 1, n).to(dtype), requires_grad=False)
    module = module.to("cpu").eval()
    holder = torch.nn.Sequential(module)
    if not bias:  # (hold takes the model's dtype from its floating-point parameters)
        holder.dtype_of = torch.nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)
    assert bnb8bit.hold(holder) == 1
    return module, linear_weight(module)


def _reference(x: torch.Tensor, codes: torch.Tensor, scb: torch.Tensor, threshold: float,
               bias: torch.Tensor | None) -> torch.Tensor:
    """LLM.int8 of each row of x alone in torch ops: bitsandbytes' quantizing (fp16 values, outliers
    at or above the threshold, the rest scaled by 127 over their largest magnitude), its exact integer
    sums and int8_mm_dequant, then the row's outlier columns one by one in the input's dtype."""
    rows = []
    for i in range(x.shape[0]):
        a = x[i : i + 1].to(torch.float16)
        outliers = a.abs() >= threshold if threshold > 0 else torch.zeros_like(a, dtype=torch.bool)
        a = a.masked_fill(outliers, 0)
        stat = a.abs().amax(dim=1).float()
        q = torch.nan_to_num(torch.round(a * (127.0 / stat[:, None])), nan=0.0)
        sums = (q.double() @ codes.double().t()).float()
        y = sums * (stat[:, None] * scb[None]) * 6.200124e-05
        if bias is not None:
            y = y + bias
        y = y.to(x.dtype)
        for j in outliers[0].nonzero().flatten().tolist():
            y = y + x[i : i + 1, j : j + 1] * (codes[:, j] * scb * 7.874015718698502e-3).to(x.dtype)
        rows.append(y)
    return torch.cat(rows)


def test_literal_row():
    """One row of 4 values over 2 outputs whose codes are their weights (each output's largest 127):
    8.0 is an outlier (its code 0); the rest, largest 1.0, give codes [127, -64 (-63.5 to even), 0, 32];
    sums 127 + 128 + 32 * 127 = 4319 and -16129 + 64 = -16065; then the outlier column added."""
    w = torch.tensor([[1.0, -2.0, 3.0, 127.0], [-127.0, 0.0, 5.0, 2.0]])
    module, view = _held(w, torch.float32, bias=False)
    assert torch.equal(module.state.CB, w.to(torch.int8)) and module.state.SCB.tolist() == [127.0, 127.0]
    x = torch.tensor([[1.0, -0.5, 8.0, 0.25]])
    f = np.float32
    want = [f(f(f(s) * f(127.0)) * f(6.200124e-05)) + f(8.0) * f(f(f(c) * f(127.0)) * f(7.874015718698502e-3))
            for s, c in ((4319, 3), (-16065, 5))]
    assert cpu_kernels.linear(x, view, None)[0].tolist() == [float(v) for v in want]
    record = cpu_kernels.packed(view)
    assert record.parts[2].tolist() == [129, -120]  # (each output's sum of codes)
    assert record[:3].tolist() == [module.state.CB.data_ptr(), module.state.SCB.data_ptr(), record.parts[2].data_ptr()]
    assert record.view(torch.float32)[6].item() == 6.0


def _inputs(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows as real activations, with outliers in some columns of some rows, an all-zero row, a row
    of outliers alone and (float32) a value past fp16's range."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) * 1.5
    x[1, :2] = 9.0
    x[3, 5] = -7.0
    x[4, 5] = 6.5
    x[2] = 0.0
    x[6] = 8.0
    x[7, 3] = 5.998  # (below 6 in fp32, 6 in fp16: an outlier)
    if dtype == torch.float32:
        x[8, 1] = 1e6
    return x.to(dtype)


@pytest.mark.parametrize("k", [100, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_is_the_reference(dtype, k):
    """Bitwise the reference at 1-13 rows and a 70-row prompt chunk, each row as alone, at every SIMD
    level; 37 outputs (a partial tile), K past the vector blocks (100) and at them (576)."""
    w = torch.randn(37, k, generator=torch.Generator().manual_seed(1))
    module, view = _held(w, dtype)
    assert cpu_kernels.weight_kind(view) == cpu_kernels.W_Q8B
    x = _inputs(70, k, dtype)
    want = _reference(x, module.state.CB, module.state.SCB, module.state.threshold, module.bias)
    for m in (1, 2, 3, 4, 5, 9, 13, 70):
        assert torch.equal(cpu_kernels.linear(x[:m], view, module.bias), want[:m]), m
    assert torch.equal(torch.cat([cpu_kernels.linear(x[i : i + 1], view, module.bias) for i in range(13)]), want[:13])
    outs = at_every_simd_level(lambda: [cpu_kernels.linear(x[:m], view, None) for m in (1, 5, 13, 70)])
    for level, got in outs.items():
        assert all(torch.equal(a, c) for a, c in zip(got, outs[0])), f"level {level} differs from the portable C"


def test_no_threshold_and_bitsandbytes_own_rows():
    """Threshold 0 takes no outliers (a value of 9 is quantized with the rest; fp16's infinity makes
    its row NaN, as bitsandbytes' arithmetic does); a row without outliers is bitwise bitsandbytes'
    own call of it."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))
    x = _inputs(9, 64, torch.float32)
    plain = [i for i in range(9) if x[i].abs().max() < 5.9]  # (rows without an outlier)
    assert plain == [0, 2, 5]
    for threshold in (0.0, 6.0):
        module, view = _held(w, torch.float32, threshold=threshold)
        got = cpu_kernels.linear(x, view, module.bias)
        want = _reference(x, module.state.CB, module.state.SCB, threshold, module.bias)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # (1e6 is fp16's inf: NaN rows)
        with torch.no_grad():
            assert all(torch.equal(got[i], module(x[i : i + 1])[0]) for i in plain), threshold


def test_codes_held_once():
    """The kernels read bitsandbytes' codes in place: the weight's values are its state's codes, the
    module's own weight, and its packed record names them (no second copy)."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    module, view = _held(w, torch.float32)
    values = cpu_kernels.values_of(view)
    assert values.data_ptr() == module.state.CB.data_ptr() == module.weight.data_ptr()
    assert cpu_kernels.packed(view).numel() == 4  # (32 bytes: where the codes lie, not the codes)
