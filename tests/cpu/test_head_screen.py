"""The LM head's int8 screen (steps.head_screen, csrc/head_screen.c): its codes against a plain torch
quantization, its bound against the worst input, and its tokens against the argmax of the full head's
logits (`cpu.kernels.linear`), ties included, at every SIMD level."""

from __future__ import annotations

import pytest
import torch

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.steps.head_screen import CAP, HeadScreen
from tests.conftest import at_every_simd_level

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _head(n: int, k: int, dtype: torch.dtype, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias).to(dtype)


def _screen(head: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] int8, scales [N], D [N]) of `head`'s screen."""
    n, k = head.weight.shape
    codes, bound = cpu_kernels.screen_pack(cpu_kernels.packed(head.weight), n, k)
    p = -(-n // 8)
    scales = codes[cpu_kernels.q8_scale_bytes(p, k):].view(torch.float32)[:n]
    return cpu_kernels.q8_values(codes, n, k, torch.float32), scales, bound


def _full_argmax(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.linear(x, head.weight, head.bias).float().argmax(dim=-1)


def test_screen_pack_literal():
    head = _head(2, 2, torch.float32)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
    codes, scales, bound = _screen(head)
    assert codes.tolist() == [[127, -64], [0, 0]]  # -0.5 * 127 = -63.5, to even
    assert scales.tolist() == [torch.tensor(1 / 127).item(), 0.0]
    assert bound[1].item() == 0.0  # a zero row is its own screen
    # |e|_2: the second value's error is 0.5 - 64 / 127 (the first is exact up to the scale's rounding)
    assert abs(0.5 - 64 / 127) <= bound[0].item() <= abs(0.5 - 64 / 127) * 1.001 + 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(1003, 65), (64, 256)])
def test_screen_pack_is_a_plain_quantization(dtype, n, k):
    head = _head(n, k, dtype)
    codes, scales, bound = _screen(head)
    w = head.weight.detach().float()
    amax = w.abs().amax(dim=1)
    want_scales = amax / 127
    assert torch.equal(scales, want_scales)
    inv = torch.full_like(amax, 127) / amax  # a division (a scalar's `127 / amax` is torch's reciprocal times 127)
    assert torch.equal(codes.float(), torch.round(w * inv[:, None]).clamp(-127, 127))
    # D against its definition in float64: no smaller, and not much larger
    w64, q64, s64 = w.double(), codes.double(), want_scales.double()
    k2 = k + (k & 1) if dtype == torch.bfloat16 else k
    g = (k2 + 2) * 2.0**-24
    g = g / (1 - g)
    want = (w64 - s64[:, None] * q64).norm(dim=1) + g * (w64.norm(dim=1) + s64 * q64.norm(dim=1))
    assert (bound.double() >= want).all()
    assert (bound.double() <= want * (1 + 1e-4) + 1e-30).all()


def test_screen_pack_refuses_a_head_that_is_not_finite():
    head = _head(16, 8, torch.float32)
    with torch.no_grad():
        head.weight[9, 3] = float("inf")
    assert cpu_kernels.screen_pack(cpu_kernels.packed(head.weight), 16, 8) is None
    screen = HeadScreen.of(head, None)
    assert screen.argmax(torch.randn(2, 8)) is None


def test_bound_holds_for_the_worst_input():
    """x along an output's quantization error makes that error's product as large as Cauchy-Schwarz
    allows: the exact logit (fp32: the chain itself) stays within the screen's bound of its value."""
    n, k = 40, 96
    head = _head(n, k, torch.float32, bias=True)
    codes, scales, bound = _screen(head)
    w = head.weight.detach()
    err = w.double() - scales.double()[:, None] * codes.double()
    for j in range(n):
        for sign in (1.0, -1.0):
            x = (sign * 3.0 * err[j] / err[j].norm()).float()[None]
            exact = cpu_kernels.linear(x, w, head.bias)[0].double()
            a = cpu_kernels._linear_call(x, cpu_kernels.screen_pack(cpu_kernels.packed(w), n, k)[0],
                                         cpu_kernels.W_Q8, None, n)[0].double()
            mid = a + head.bias.detach().double()
            d = x.double().norm() * bound.double()
            b = d + 4 * 2.0**-24 * (a.abs() + mid.abs() + d)
            assert ((exact - mid).abs() <= b).all()
            # the error's product is the bound's main term: the bound is near tight for output j
            assert (exact[j] - mid[j]).abs() >= 0.5 * d[j]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_tokens_are_the_full_heads_argmax(dtype, bias):
    n, k = 1003, 65
    head = _head(n, k, dtype, bias=bias)
    with torch.no_grad():
        head.weight[700] = head.weight[300]  # an exact tie: the first index wins
        head.weight[299] = head.weight[300] * (1 - 2.0**-12)  # below 300, but a tie once rounded to bf16
        if bias:
            head.bias[[299, 700]] = head.bias[300].item()
    screen = HeadScreen.of(head, None)
    torch.manual_seed(1)
    x = torch.randn(30, k).to(dtype)
    x[::3] = (head.weight[300].detach().float() * 40).to(dtype)  # rows whose largest is a tie
    want = _full_argmax(head, x)
    assert set(want[::3].tolist()) <= {299, 300}
    if dtype == torch.float32:
        assert (want[::3] == 300).all()
    outs = at_every_simd_level(lambda: screen.argmax(x))
    for level, got in outs.items():
        assert got is not None and torch.equal(got, want), level
    assert screen.fallbacks == 0


def test_rows_past_one_screen_call_and_none():
    head = _head(500, 64, torch.bfloat16)
    screen = HeadScreen.of(head, None)
    x = torch.randn(23, 64).to(torch.bfloat16)  # 9 + 9 + 5 rows a screen call
    assert torch.equal(screen.argmax(x), _full_argmax(head, x))
    assert screen.argmax(x[:0]).shape == (0,)


def test_too_many_candidates_fall_back():
    """Every output the same: all can be the largest, more than CAP of them, so the screen passes
    the step on (None) rather than computing them all; a NaN input does too."""
    head = _head(CAP + 8, 16, torch.float32)
    with torch.no_grad():
        head.weight.copy_(head.weight[:1].expand_as(head.weight))
    screen = HeadScreen.of(head, None)
    assert screen.argmax(torch.randn(2, 16)) is None
    nan = torch.randn(1, 16)
    nan[0, 3] = float("nan")
    assert screen.argmax(nan) is None
    assert screen.fallbacks == 2 and screen.steps == 0
    few = _head(CAP - 8, 16, torch.float32)  # as many equal outputs as the cap allows: decided, the first
    with torch.no_grad():
        few.weight.copy_(few.weight[:1].expand_as(few.weight))
    assert HeadScreen.of(few, None).argmax(torch.randn(2, 16)).tolist() == [0, 0]


def test_screen_follows_the_weight():
    head = _head(300, 32, torch.float32)
    screen = HeadScreen.of(head, None)
    x = torch.randn(4, 32)
    assert torch.equal(screen.argmax(x), _full_argmax(head, x))
    with torch.no_grad():
        head.weight.copy_(torch.flip(head.weight, [0]))  # in place: a new version
    assert torch.equal(screen.argmax(x), _full_argmax(head, x))
    head.weight = torch.nn.Parameter(torch.randn(300, 32))  # a new tensor
    assert torch.equal(screen.argmax(x), _full_argmax(head, x))


def test_what_the_screen_takes():
    assert HeadScreen.of(_head(8, 8, torch.float32), softcap=30.0) is None  # tanh makes ties
    assert HeadScreen.of(torch.nn.Embedding(8, 8), None) is None
    assert HeadScreen.of(_head(8, 8, torch.float64), None) is None
