"""The C linears over bitsandbytes' 4-bit weights (nf4 and fp4; cpu.kernels, weight kind W_Q4 in its
"lut" form), which invariant.bnb4bit shows as plain linears: each weight is `codebook[code] *
absmax` in float32, rounded to the module's compute dtype, as bitsandbytes' own dequantization
gives it; a linear is bitwise the float linear of those values, row by row as alone, and the same
at every SIMD level as the portable C.

The modules are made as bitsandbytes makes them (`Linear4bit`, quantized when moved to the CPU), and
kept in bitsandbytes' flat layout: on CPUs with AVX-512 BF16 bitsandbytes repacks a module's codes
into a layout of its own at its first forward, which the C linears do not read (the module's own
kernel then runs); `_linear4bit` turns that off for these tests, so that every machine tests the
same layout."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant import bnb4bit
from hf_plookup.invariant.linears import linear_module, linear_weight, row_strategy
from tests.conftest import at_every_simd_level, rows_alone_and_float_linear

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

ROWS = (1, 2, 5, 9, 10, 13, 40)  # the one-pass tiles (up to 9 rows) and the row blocks past them


def _linear4bit(k: int, n: int, dtype: torch.dtype, kind: str = "nf4", nested: bool = False, bias: bool = True,
                blocksize: int | None = None, seed: int = 0) -> torch.nn.Module:
    """A `Linear4bit` quantized from a random [n, k] linear of `dtype`, computing in `dtype`."""
    torch.manual_seed(seed)
    src = torch.nn.Linear(k, n, bias=bias).to(dtype)
    lin = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=dtype, quant_type=kind, compress_statistics=nested)
    lin.load_state_dict(src.state_dict())
    if blocksize is not None:
        lin.weight.blocksize = blocksize
    lin = lin.to("cpu")  # (bitsandbytes quantizes a weight when it is moved to a device)
    lin.support_avx512bf16_for_cpu = False  # (the flat layout on every CPU: the module text)
    return lin


def _their_values(lin: torch.nn.Module) -> torch.Tensor:
    """The weight bitsandbytes' own linear multiplies by: its dequantization (a nested absmax undone)
    in float32, rounded to the compute dtype."""
    return bnb.functional.dequantize_4bit(lin.weight, lin.weight.quant_state).to(lin.compute_dtype)


def test_pack_q4_lut_literal():
    """One column, one group of 4 codes over the codebook 0, 0.5, 1, ...: weights lut[q] * 2 = [1, 2, 3, 15]
    (codes 1, 2, 3, 15), so x = [1, 2, 3, 4] gives 1 + 4 + 9 + 60 = 74, plus the bias 0.5."""
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    lut = torch.arange(16) * 0.5
    packed = cpu_kernels.pack_q4(codes, torch.tensor([[2.0]]), torch.zeros(1, 1), 4, "lut", 0.0, torch.bfloat16, lut)
    at = 64  # the panels' 8 bytes, then the header from the next 64-byte boundary
    assert packed[[0, 8]].tolist() == [0x21, 0xF3]  # pair j of column 0 at byte 8 j
    head = packed[at : at + cpu_kernels.Q4_META_BYTES]
    assert head[:8].view(torch.int32).tolist() == [4, cpu_kernels.Q4_FORMS["lut"]]
    assert torch.equal(head[64:].view(torch.float32), lut)
    # the absmax stays float32 (not rounded to the call's dtype, as the affine forms' scales are)
    third = cpu_kernels.pack_q4(codes, torch.full((1, 1), 1 / 3), torch.zeros(1, 1), 4, "lut", 0.0, torch.bfloat16, lut)
    assert third[at + 128 : at + 132].view(torch.float32).item() == torch.tensor(1 / 3).item()
    out = torch.empty(1, 1)
    x, b = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([0.5])
    assert cpu_kernels._LIB.linear(x.data_ptr(), 1, packed.data_ptr(), cpu_kernels.W_Q4, 4, b.data_ptr(), 1,
                                   out.data_ptr(), 0, 1) == 0
    assert out.item() == 74.5
    with pytest.raises(ValueError, match="codebook"):
        cpu_kernels.pack_q4(codes, torch.ones(1, 1), torch.zeros(1, 1), 4, "lut", 0.0, torch.float32)


def test_linear4bit_is_seen_as_a_linear():
    lin = _linear4bit(256, 24, torch.float32, nested=True)
    assert linear_module(lin)
    w = linear_weight(lin)
    assert isinstance(w, bnb4bit.Bnb4bitWeight) and w.shape == (24, 256) and w.dtype == torch.float32
    assert linear_weight(lin) is w  # kept while the module holds the same weight
    x = torch.randn(5, 256)
    with torch.no_grad():
        assert torch.equal(F.linear(x, w, lin.bias), lin(x))  # its F.linear is the module's own arithmetic
    parts = cpu_kernels.q4_parts(w)
    assert (parts.form, parts.group, parts.offset) == ("lut", 64, 0.0)
    assert parts.codes().shape == (24, 256) and parts.scales.shape == (24, 4) and parts.scales.dtype == torch.float32
    assert torch.equal(parts.lut, lin.weight.quant_state.code)
    assert cpu_kernels.weight_kind(w) == cpu_kernels.q4_kind(w.shape[1], parts.group)
    codes = cpu_kernels.values_of(w)  # the Params4bit's codes as a plain tensor: its storage and version counter
    assert type(codes) is torch.Tensor and codes.data_ptr() == lin.weight.data_ptr()
    with torch.no_grad():
        lin.weight.add_(0)
    assert codes._version == lin.weight._version
    assert row_strategy(w, lin.bias) == "cpu"
    with pytest.raises(TypeError, match="F.linear only"):
        w.sum()
    # another weight in its place: another view
    lin.weight = _linear4bit(256, 24, torch.float32, seed=1).weight
    assert linear_weight(lin) is not w
    # a block spanning two rows (K not a multiple of it), an absmax not a number: bitsandbytes' own kernel
    odd = _linear4bit(96, 8, torch.float32)
    assert cpu_kernels.q4_parts(linear_weight(odd)) is None and not cpu_kernels.supported(linear_weight(odd))
    assert row_strategy(linear_weight(odd), odd.bias) != "cpu"
    nan = _linear4bit(128, 8, torch.float32)
    nan.weight.quant_state.absmax[0] = float("nan")
    assert cpu_kernels.q4_parts(linear_weight(nan)) is None


def test_a_dropped_module_is_freed():
    """The views and packed copies kept for a module hold nothing that keeps the module alive (a
    Params4bit holds its module)."""
    lin = _linear4bit(128, 16, torch.float32)
    w = linear_weight(lin)
    cpu_kernels.linear(torch.randn(2, 128), w, lin.bias)
    gone = weakref.ref(lin)
    del lin, w
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
def test_lut_linear_is_the_float_linear_of_bitsandbytes_values(kind, dtype, nested):
    """The values are bitsandbytes' own dequantization, bit for bit; the linear is bitwise the W_FLOAT
    linear of them, each row as alone, and near float64 and the module's own output."""
    k, n = 384, 37
    lin = _linear4bit(k, n, dtype, kind, nested)
    w, b = linear_weight(lin), lin.bias.detach()
    parts = cpu_kernels.q4_parts(w)
    values = (parts.lut[parts.codes().long()] * parts.scales.repeat_interleave(parts.group, 1)).to(dtype)
    assert torch.equal(values, _their_values(lin))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    rows = rows_alone_and_float_linear(w, b, values, x, ROWS)
    ref = x.double() @ values.double().T + b.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(rows.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    with torch.no_grad():
        assert torch.allclose(rows.float(), lin(x).float(), rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lut_simd_levels_agree_bitwise(dtype):
    lin = _linear4bit(256, 45, dtype, "nf4", blocksize=128)
    w = linear_weight(lin)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    outs = at_every_simd_level(lambda: [cpu_kernels.linear(x[:m], w, lin.bias) for m in ROWS + (70,)])
    for level, got in outs.items():
        assert all(torch.equal(a, c) for a, c in zip(got, outs[0])), f"level {level} differs from the portable C"


def test_a_compute_dtype_apart_from_the_inputs():
    """A float32 model computing in bfloat16 (`bnb_4bit_compute_dtype=torch.bfloat16`): the view is
    bfloat16, and invariant mode's forward casts around it as the module's own forward does."""
    from hf_plookup.invariant.linears import InvariantLinears, _invariant_linear

    lin = _linear4bit(128, 16, torch.float32)
    lin.compute_dtype = torch.bfloat16
    w = linear_weight(lin)
    assert w.dtype == torch.bfloat16
    x = torch.randn(3, 128)
    forward = InvariantLinears._bind(lin)
    with torch.no_grad():
        got = forward(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, _invariant_linear(x.to(torch.bfloat16), w, lin.bias.to(torch.bfloat16)).float())
        assert torch.allclose(got, lin(x), rtol=2e-2, atol=2e-2)
