"""The C linears over 4-bit weights (cpu.kernels, weight kind W_Q4): optimum-quanto's qint4 weights in
their two forms (the plain `WeightQBitsTensor`, `scale * code - shift` in the dtype; the tinygemm one
of bfloat16 models with groups of 128, `(code - 8) * scale + zero` in float32), read in the packed
4-bit layout with a scale and a shift per column and group. A W_Q4 linear is bitwise the float
linear of its dequantized weight; checked against the library's own dequantization and torch's
int4pack kernel, float64, row by row against 1-row calls, and at every SIMD level against the
portable C, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from tests.conftest import assert_float_linear, at_every_simd_level

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

DTYPES = [torch.float32, torch.bfloat16]
ROWS = (1, 2, 5, 9, 10, 13, 40)  # the one-pass tiles (up to 9 rows) and the row blocks past them


def _quanto_int4(k: int, n: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> torch.nn.Module:
    quanto = pytest.importorskip("optimum.quanto")
    torch.manual_seed(seed)
    seq = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias)).to(dtype)
    quanto.quantize(seq, weights=quanto.qint4)
    quanto.freeze(seq)
    return seq[0]


def _dequantized(parts: cpu_kernels.Q4Parts, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight as `Q4Parts` defines it, in torch ops: float64 for the fma form (exact, then rounded
    once to float32), the dtype's own ops for mul_sub."""
    codes = parts.codes().view(n, k // parts.group, parts.group)
    s, z = parts.scales[..., None], parts.shifts[..., None]
    if parts.form == "fma":
        return ((codes.double() - parts.offset) * s.double() + z.double()).float().view(n, k)
    return (codes.to(dtype) * s - z).view(n, k).float()


def test_pack_q4_literal():
    codes = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8)
    out = cpu_kernels.pack_q4(codes, torch.tensor([[0.5], [2.0]]), torch.tensor([[0.0], [1.0]]), 2, "fma", 8.0,
                              torch.float32)
    assert out.dtype == torch.uint8 and out.numel() == 64 + 128 + 16 * 4
    assert out[:8].tolist() == [0x21, 0x43, 0, 0, 0, 0, 0, 0] and out[8:64].tolist() == [0] * 56
    head = out[64:192]
    assert head[:8].view(torch.int32).tolist() == [2, cpu_kernels.Q4_FORMS["fma"]]
    assert head[8:12].view(torch.float32).item() == 8.0 and head[12:].tolist() == [0] * 116
    assert out[192:].view(torch.float32).tolist() == [0.5, 2.0] + [0] * 6 + [0.0, 1.0] + [0] * 6
    # scales and shifts rounded to the call's dtype first
    third = cpu_kernels.pack_q4(codes, torch.full((2, 1), 1 / 3), torch.zeros(2, 1), 2, "mul_sub", 0.0, torch.bfloat16)
    assert third[192:196].view(torch.float32).item() == torch.tensor(1 / 3).to(torch.bfloat16).float().item()
    with pytest.raises(ValueError, match="W_Q4"):
        cpu_kernels.pack_q4(torch.zeros(2, 3, dtype=torch.uint8), torch.zeros(2, 1), torch.zeros(2, 1), 3, "fma", 8.0,
                            torch.float32)


def test_linear_q4_literal():
    """One column, two groups of 2: weights (q - 8) * s + z = [-1, 0.5 | 3, 3.5] (fma form), so
    x = [1, 2, 3, 4] gives -1 + 1 + 9 + 14 = 23, plus the bias 0.5."""
    codes = torch.tensor([[7, 9, 10, 11]], dtype=torch.uint8)
    scales, shifts = torch.tensor([[0.75, 0.5]]), torch.tensor([[-0.25, 2.0]])
    packed = cpu_kernels.pack_q4(codes, scales, shifts, 2, "fma", 8.0, torch.float32)
    out = torch.empty(1, 1)
    x, bias = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([0.5])
    assert cpu_kernels._LIB.linear(x.data_ptr(), 1, packed.data_ptr(), cpu_kernels.W_Q4, 4, bias.data_ptr(), 1,
                                   out.data_ptr(), 0, 1) == 0
    assert out.item() == 23.5


def test_what_q4_parts_takes():
    assert cpu_kernels.q4_parts(torch.randn(4, 4)) is None
    w = _quanto_int4(256, 16, torch.float32).weight
    parts = cpu_kernels.q4_parts(w)
    assert (parts.form, parts.offset, parts.group) == ("mul_sub", 0.0, 128)
    assert parts.codes().shape == (16, 256) and parts.scales.shape == parts.shifts.shape == (16, 2)
    assert cpu_kernels.supported(w) and cpu_kernels.weight_kind(w) == cpu_kernels.q4_kind(256, 128)
    assert cpu_kernels.values_of(w) is parts.source and parts.source.dtype == torch.uint8
    tiny = cpu_kernels.q4_parts(_quanto_int4(64, 8, torch.float32).weight)  # under 128 values: one group a column
    assert tiny.group == 64 and tiny.scales.shape == (8, 1)
    tinygemm = _quanto_int4(256, 64, torch.bfloat16).weight
    tg = cpu_kernels.q4_parts(tinygemm)
    assert (tg.form, tg.offset, tg.group) == ("fma", 8.0, 128) and tg.scales.shape == (64, 2)
    # torch's int4pack layout read in place of quanto's unpacking (a product with an identity)
    assert torch.equal(tg.codes(), tinygemm._data.unpack())
    # int8 stays W_Q8
    quanto = pytest.importorskip("optimum.quanto")
    seq = torch.nn.Sequential(torch.nn.Linear(32, 8))
    quanto.quantize(seq, weights=quanto.qint8)
    quanto.freeze(seq)
    assert cpu_kernels.q4_parts(seq[0].weight) is None and cpu_kernels.weight_kind(seq[0].weight) == cpu_kernels.W_Q8


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_mul_sub_values_are_quantos(dtype):
    """The plain form's values are quanto's own `dequantize()`, bit for bit."""
    k = 576  # groups of 96 (576 is not a multiple of 128): the plain form in bfloat16 too
    lin = _quanto_int4(k, 24, dtype)
    parts = cpu_kernels.q4_parts(lin.weight)
    assert parts.form == "mul_sub"
    assert torch.equal(_dequantized(parts, 24, k, dtype), lin.weight.dequantize().float())


def test_fma_values_are_torchs_int4pack():
    """The tinygemm form: a 1-row call of torch's int4pack kernel on each unit vector returns a
    column of the weight rounded to bfloat16; the float32 values here round to the same. (64
    columns: whole blocks of torch's layout, 32 columns with AVX2 and 64 with AVX-512.)"""
    lin = _quanto_int4(256, 64, torch.bfloat16, bias=False)
    w = lin.weight
    parts = cpu_kernels.q4_parts(w)
    eye = torch.eye(256, dtype=torch.bfloat16)
    theirs = torch._weight_int4pack_mm_for_cpu(eye, w._data._data, w._group_size, w._scale_shift).t()
    assert torch.equal(_dequantized(parts, 64, 256, torch.bfloat16).to(torch.bfloat16), theirs)


@pytest.mark.parametrize("dtype, k, n, group", [(torch.float32, 384, 37, 128), (torch.float32, 576, 64, 96),
                                                (torch.bfloat16, 256, 128, 128), (torch.bfloat16, 576, 20, 96),
                                                (torch.float32, 64, 9, 64)])
def test_linear_q4_is_the_float_linear_of_its_values(dtype, k, n, group):
    """The W_FLOAT linear of the dequantized weight (tests/conftest.assert_float_linear; its values are
    float32 for the fma form, so its bfloat16 calls are a float32 call rounded once), near float64,
    and each row as alone."""
    lin = _quanto_int4(k, n, dtype)
    w, b = lin.weight, lin.bias.detach()
    parts = cpu_kernels.q4_parts(w)
    assert parts.group == group
    values = _dequantized(parts, n, k, dtype)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    rows = torch.cat([cpu_kernels.linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for m in ROWS:
        got = cpu_kernels.linear(x[:m], w, b)
        assert torch.equal(got, rows[:m])
        assert_float_linear(got, w, values if parts.form == "fma" else values.to(dtype), x[:m], b, m)
    ref = x.double() @ values.double().T + b.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(rows.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    # quanto's own linear: the same values, summed in another order
    assert torch.allclose(rows.float(), lin(x).float(), rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_linear_q4_simd_levels_agree_bitwise(dtype):
    lin = _quanto_int4(256, 45 if dtype == torch.float32 else 64, dtype)  # (tinygemm: whole blocks of columns)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    outs = at_every_simd_level(lambda: [cpu_kernels.linear(x[:m], lin.weight, lin.bias) for m in ROWS + (70,)])
    for level, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0])), f"level {level} differs from the portable C"


def test_packed_q4_follows_the_weight():
    """The packed copy is made once and made again when the codes change in place."""
    lin = _quanto_int4(128, 16, torch.float32)
    w = lin.weight
    first = cpu_kernels.packed(w)
    assert cpu_kernels.packed(w) is first
    with torch.no_grad():
        cpu_kernels.q4_parts(w).source.bitwise_xor_(0x11)
    again = cpu_kernels.packed(w)
    assert again is not first
    x = torch.randn(3, 128)
    assert torch.allclose(cpu_kernels.linear(x, w, lin.bias), F.linear(x, w.dequantize(), lin.bias), rtol=1e-5, atol=1e-4)
