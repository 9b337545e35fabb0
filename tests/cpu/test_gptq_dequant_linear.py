"""The C linears' "sub_mul_f16" form: GPTQ's weights as gptqmodel dequantizes them for float32 calls,
fp16(scale * (code - zero)), read from GPTQ's own layout (int32 words of eight codes, fp16 scales,
zero points packed along N) by `invariant.gptq.GptqDequantWeight`, and AWQ's (codes and zero points
packed along N, out of order) by `AwqDequantWeight`. gptqmodel does not install in CI,
so the layout is made here by hand from known codes; tests/cpu/test_gptq_linear.py checks the view
against gptqmodel's own modules where it is installed. A W_Q4 linear is bitwise the float linear of
its dequantized weight, each row as alone, and every SIMD level gives the portable C's bits (fp16's
subnormals and overflow included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant.gptq import AwqDequantWeight, GptqDequantWeight
from tests.conftest import assert_float_linear, at_every_simd_level, rows_alone_and_float_linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

ROWS = (1, 2, 5, 9, 10, 13, 40)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """int32 words [R / 8, C] of codes [R, C] (0..15), code 8r + j in bits 4j of word r."""
    c = codes.long().view(codes.shape[0] // 8, 8, codes.shape[1])
    words = sum(c[:, j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# AWQ's packing (gptqmodel's `AWQ_REVERSE_ORDER`): column j of a word's eight in nibble AWQ_NIBBLE[j]
AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]


def _awq_words(codes: torch.Tensor) -> torch.Tensor:
    """int32 words [R, C / 8] of codes [R, C] (0..15), packed along C as AWQ packs them."""
    c = codes.long().view(codes.shape[0], codes.shape[1] // 8, 8)
    words = sum(c[:, :, j] << (4 * AWQ_NIBBLE[j]) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class HandMade(torch.nn.Module):
    """A GPTQ linear's tensors, as gptqmodel keeps them (the view reads only these); with `awq`,
    an AWQ linear's."""

    def __init__(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, awq: bool = False):
        super().__init__()
        n, k = codes.shape
        self.out_features, self.in_features, self.group_size = n, k, group
        if awq:  # both packed along N: [K, N / 8] and [K / G, N / 8]
            self.qweight, self.qzeros = _awq_words(codes.t().contiguous()), _awq_words(zeros.t().contiguous())
        else:
            self.qweight = _words(codes.t().contiguous())  # [K / 8, N]
            self.qzeros = _words(zeros.contiguous()).t().contiguous()  # [K / G, N / 8]: packed along N
        self.scales = scales.t().contiguous().to(torch.float16)  # [K / G, N]


def _layer(n: int, k: int, group: int, scale: float = 0.01, seed: int = 0,
           awq: bool = False) -> tuple[HandMade, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 16, (n, k // group), generator=g)
    scales = (torch.rand(n, k // group, generator=g) + 0.5) * scale
    return HandMade(codes, zeros, scales, group, awq), codes


def test_words_codes_literal():
    assert cpu_kernels.words_codes(torch.tensor([[0x76543210]], dtype=torch.int32)).flatten().tolist() == list(range(8))
    top = torch.tensor([[-0x10000000 + 0x0FEDCBA9]], dtype=torch.int32)  # 0xFFEDCBA9: the sign bit set
    assert cpu_kernels.words_codes(top).flatten().tolist() == [9, 10, 11, 12, 13, 14, 15, 15]


def test_awq_codes_literal():
    assert cpu_kernels.awq_codes(torch.tensor([[0x76543210]], dtype=torch.int32)).flatten().tolist() == [
        0, 4, 1, 5, 2, 6, 3, 7]
    two = torch.tensor([[0x76543210, -0x10000000 + 0x0FEDCBA9]], dtype=torch.int32)  # the second: 0xFFEDCBA9
    assert cpu_kernels.awq_codes(two).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 9, 13, 10, 14, 11, 15, 12, 15]


@pytest.mark.parametrize("view", [GptqDequantWeight, AwqDequantWeight], ids=["gptq", "awq"])
def test_view_reads_the_codes_zeros_and_scales_it_was_made_of(view):
    module, codes = _layer(16, 128, 32, awq=view is AwqDequantWeight)
    w = view(module)
    assert tuple(w.shape) == (16, 128) and w.dtype == torch.float32
    parts = cpu_kernels.q4_parts(w)
    assert (parts.form, parts.offset, parts.group) == ("sub_mul_f16", 0.0, 32)
    assert torch.equal(parts.codes(), codes.to(torch.uint8))
    assert torch.equal(parts.scales, module.scales.t().float())
    # the dequantized weight: the fp16 product of each scale and code - zero, rounded once
    zeros = parts.shifts.repeat_interleave(32, dim=1)
    exact = (codes.double() - zeros.double()) * parts.scales.repeat_interleave(32, dim=1).double()
    assert torch.equal(w.dequantized().t(), exact.to(torch.float16))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    assert torch.equal(F.linear(x, w), x @ w.dequantized().float())


@pytest.mark.parametrize("n, k, group", [(16, 128, 32), (24, 256, 128), (40, 64, 64)])
def test_linear_is_the_float_linear_of_its_values_row_by_row(n, k, group):
    module, _ = _layer(n, k, group, seed=n)
    w = GptqDequantWeight(module)
    values = w.dequantized().t().float()  # [N, K]
    b = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3))
    rows = rows_alone_and_float_linear(w, b, values, x, ROWS)
    ref = x.double() @ values.double().T + b.double()
    assert torch.allclose(rows.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("scale", [0.01, 1e-6, 6000.0], ids=["normal", "subnormal", "overflow"])
def test_simd_levels_agree_bitwise(scale):
    """fp16's rounding at each level: products in its normal range, below its least normal 2^-14
    (subnormals, quantum 2^-24) and past 65504 (infinity). Compared as bits: infinite weights make
    infinite or NaN sums."""
    module, _ = _layer(24, 256, 64, scale=scale, seed=4)
    w = GptqDequantWeight(module)
    values = w.dequantized()
    if scale == 1e-6:
        assert ((values != 0) & (values.abs() < 2**-14)).any()
    if scale == 6000.0:
        assert values.isinf().any() and values.isfinite().any()
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(5))
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    outs = at_every_simd_level(lambda: [cpu_kernels.linear(x[:m], w, None) for m in ROWS + (70,)])
    for m, got in zip(ROWS + (70,), outs[0]):
        if values.isfinite().all():
            assert_float_linear(got, w, values.t().float(), x[:m], None, m)
        else:  # (infinite weights: infinite or NaN sums where the float linear's are)
            want = cpu_kernels.linear(x[:m], values.t().float().contiguous(), None)
            assert all(torch.equal(f(got), f(want)) for f in (torch.isnan, torch.isposinf, torch.isneginf))
    for level, got in outs.items():
        assert all(torch.equal(bits(a), bits(c)) for a, c in zip(got, outs[0])), f"level {level} differs from the portable C"
