"""The C linears over int8 weights (cpu.kernels, weight kind W_Q8): torchao's int8 weight-only and
optimum-quanto's qint8 weights, read in the packed int8 layout with one scale per output column.
Checked against a float64 reference and the libraries' own linears, row by row against 1-row calls,
and at every SIMD level against the portable C, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from tests.conftest import at_every_simd_level

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

DTYPES = [torch.float32, torch.bfloat16]


def _torchao_linear(k: int, n: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torchao = pytest.importorskip("torchao.quantization")
    torch.manual_seed(seed)
    seq = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias)).to(dtype)
    torchao.quantize_(seq, torchao.Int8WeightOnlyConfig())
    return seq[0]


def _quanto_linear(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    quanto = pytest.importorskip("optimum.quanto")
    torch.manual_seed(seed)
    seq = torch.nn.Sequential(torch.nn.Linear(k, n)).to(dtype)
    quanto.quantize(seq, weights=quanto.qint8)
    quanto.freeze(seq)
    return seq[0]


def test_pack_q8_literal():
    values = torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)
    out = cpu_kernels.pack_q8(values, torch.tensor([0.5, 2.0]), torch.float32)
    assert out.dtype == torch.uint8 and out.numel() == 64 + 8 * 4
    assert out[:16].view(torch.int8).tolist() == [1, 3, 0, 0, 0, 0, 0, 0, 2, 4, 0, 0, 0, 0, 0, 0]
    assert out[16:64].tolist() == [0] * 48
    assert out[64:].view(torch.float32).tolist() == [0.5, 2.0, 0, 0, 0, 0, 0, 0]
    # bfloat16 calls: K rounded up to even, scales rounded to bfloat16 first
    odd = cpu_kernels.pack_q8(torch.tensor([[5]], dtype=torch.int8), torch.tensor([1 / 3]), torch.bfloat16)
    assert odd[:16].view(torch.int8).tolist() == [5] + [0] * 15
    assert odd[64:68].view(torch.float32).item() == torch.tensor(1 / 3).to(torch.bfloat16).float().item()


def test_linear_q8_literal():
    """2 inputs, 2 outputs: out = (x @ values^T) * scale + bias."""
    torchao = pytest.importorskip("torchao.quantization")
    lin = torch.nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
        lin.bias.copy_(torch.tensor([1.0, 0.0]))
    seq = torch.nn.Sequential(lin)
    torchao.quantize_(seq, torchao.Int8WeightOnlyConfig())
    w = seq[0].weight
    values, scales = cpu_kernels.int8_parts(w)[:2]
    # torchao's symmetric int8: scale = max |w| / 127.5 a row, values rounded and clamped to [-127, 127]
    assert values.tolist() == [[64, -127], [127, 64]]
    assert torch.allclose(scales, torch.tensor([2 / 127.5, 0.5 / 127.5]))
    # [2, 1] . [64, -127] = 1, times 2 / 127.5, plus 1; [2, 1] . [127, 64] = 318, times 0.5 / 127.5
    got = cpu_kernels.linear(torch.tensor([[2.0, 1.0]]), w, seq[0].bias)
    assert torch.allclose(got, torch.tensor([[1 + 2 / 127.5, 318 * 0.5 / 127.5]]), rtol=1e-6)


def test_what_int8_parts_takes():
    assert cpu_kernels.int8_parts(torch.randn(4, 4)) is None
    assert cpu_kernels.weight_kind(torch.nn.Parameter(torch.randn(4, 4))) == cpu_kernels.W_FLOAT
    w = _torchao_linear(16, 8, torch.float32).weight
    values, scales = cpu_kernels.int8_parts(w)[:2]
    assert values.dtype == torch.int8 and values.shape == (8, 16) and scales.shape == (8,)
    assert cpu_kernels.supported(w) and cpu_kernels.weight_kind(w) == cpu_kernels.W_Q8
    q = _quanto_linear(16, 8, torch.float32).weight
    assert cpu_kernels.supported(q) and cpu_kernels.weight_kind(q) == cpu_kernels.W_Q8
    # activations quantized over the whole call: a row depends on the call's other rows (per-token
    # ones are read: tests/cpu/test_torchao_int8_tokens.py)
    torchao = pytest.importorskip("torchao.quantization")
    seq = torch.nn.Sequential(torch.nn.Linear(16, 8))
    torchao.quantize_(seq, torchao.Int8DynamicActivationInt8WeightConfig(granularity=torchao.PerTensor()))
    assert cpu_kernels.int8_parts(seq[0].weight) is None and not cpu_kernels.supported(seq[0].weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("k, n", [(576, 1536), (64, 20), (63, 17), (128, 8)])
def test_linear_q8_matches_reference_and_rows_alone(dtype, k, n):
    lin = _torchao_linear(k, n, dtype, bias=n != 8)
    w, b = lin.weight, None if lin.bias is None else lin.bias.detach()
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = cpu_kernels.linear(x, w, b)
    values, scales = cpu_kernels.int8_parts(w)[:2]
    want = (x.double() @ values.double().T) * scales.to(dtype).double() + (0 if b is None else b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    # torchao's own linear: the same arithmetic but for the order of the sum
    assert torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol * float(want.abs().max()))
    rows = torch.cat([cpu_kernels.linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for m in range(1, x.shape[0] + 1):
        assert torch.equal(cpu_kernels.linear(x[:m], w, b), rows[:m])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_linear_q8_simd_levels_agree_bitwise(dtype):
    lin = _torchao_linear(200, 45, dtype)
    x = torch.randn(70, 200, generator=torch.Generator().manual_seed(2)).to(dtype)
    outs = at_every_simd_level(lambda: [cpu_kernels.linear(x[:m], lin.weight, lin.bias) for m in (1, 5, 9, 10, 70)])
    for level, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0])), f"level {level} differs from the portable C"


def test_linear_q8_bf16_rounds_as_torchao():
    """bfloat16: the product rounded, times the scale rounded, plus the bias rounded (torchao's
    order), so where the sum is exact (small integers) the output is torchao's bit for bit."""
    lin = _torchao_linear(32, 24, torch.bfloat16)
    x = torch.randint(-3, 4, (6, 32)).to(torch.bfloat16)
    assert torch.equal(cpu_kernels.linear(x, lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_linear_q8_quanto(dtype):
    lin = _quanto_linear(96, 40, dtype)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = cpu_kernels.linear(x, lin.weight, lin.bias)
    want = lin(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
    assert torch.equal(cpu_kernels.linear(x[3:4], lin.weight, lin.bias), got[3:4])


def test_packed_q8_follows_the_weight():
    """The packed copy is made once and made again when the integers change in place."""
    lin = _torchao_linear(32, 16, torch.float32)
    w = lin.weight
    first = cpu_kernels.packed(w)
    assert cpu_kernels.packed(w) is first
    values = cpu_kernels.int8_parts(w).values
    with torch.no_grad():
        values.neg_()
    again = cpu_kernels.packed(w)
    assert again is not first
    x = torch.randn(3, 32)
    assert torch.allclose(cpu_kernels.linear(x, w, lin.bias), F.linear(x, w, lin.bias), rtol=1e-5, atol=1e-4)
