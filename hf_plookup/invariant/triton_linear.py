"""A linear layer whose rows do not depend on how many rows share the call (CUDA, Triton).

cuBLAS picks its kernel by the matrix shapes: a 1-row decode and a 5-row verify step run
different kernels (a GEMV, a GEMM tile, split-K), so a token's projections round differently in
the two. `row_linear(x, weight, bias)` computes `x @ weight.T (+ bias)` with one kernel whose
tiles are fixed (`BLOCK_M` rows, `BLOCK_N` outputs, `BLOCK_K` of the reduction, chosen from
nothing the batch decides) and no split-K: every output element is the same sequence of
`tl.dot` accumulations over K in order, in fp32, whatever M is and wherever the row sits in its
tile, then one rounding to the input dtype. Invariant mode (invariant.linears) uses it for the
decode rows of every `nn.Linear` on CUDA when cuBLAS's own rows fail the row check.

bitsandbytes' 4-bit weights (nf4 and fp4 in their flat layout, invariant.bnb4bit) are read from
their codes by a kernel of the same tiles (`_bnb4_row_linear_kernel`): bitsandbytes' own linear
takes a GEMV for one row and dequantizes the whole weight before a GEMM for more, so a verify step
of a few rows would cost a full dequantization per linear and round apart from a 1-row step; this
kernel makes each tile's values from the codes as it streams them, once for up to 16 rows.

The weights are read in their `nn.Linear` layout (`[N, K]`, no copy); each program streams a
`[BLOCK_N, K]` slab once for its `BLOCK_M` rows, so a verify step of up to 16 rows reads every
weight once, as a 1-token step does. Under the Triton interpreter (TRITON_INTERPRET=1, the CPU
test suite) products are taken as elementwise multiplies and per-element sums: the interpreter's
`tl.dot` is numpy's BLAS matmul, whose rows round by their place in the block (see
attention.triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..base.device import INTERPRETED

BLOCK_M = 16  # rows per program (tl.dot needs 16); a decode or verify step of up to 16 rows is one row block
BLOCK_N = 32  # output features per program
BLOCK_K = 64  # reduction step
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _bnb4_tile(codes_ptr, absmax_ptr, code_ptr, offs_n, offs_k, w_ok, K, BLOCKSIZE: tl.constexpr,
               ROUND_BF16: tl.constexpr, dtype: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of bitsandbytes' flat 4-bit weight (byte i holds the codes of
    elements 2i, high nibble, and 2i + 1): codebook[code] * absmax[element / BLOCKSIZE] in float32,
    rounded to `dtype`, bitsandbytes' own dequantized value."""
    at = offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]  # the element's place in the flat weight
    byte = tl.load(codes_ptr + at // 2, mask=w_ok, other=0).to(tl.int32)
    q = tl.where(at % 2 == 0, byte >> 4, byte & 15)
    v = tl.load(code_ptr + q, mask=w_ok, other=0.0) * tl.load(absmax_ptr + at // BLOCKSIZE, mask=w_ok, other=0.0)
    if ROUND_BF16:  # to nearest even in integer steps (the interpreter's cast truncates); v is a number
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _row_linear_kernel(
    x_ptr, w_ptr, absmax_ptr, code_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr, SUM_DOT: tl.constexpr, BNB4_BLOCKSIZE: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """x @ w.T (+ bias) by fixed tiles; w a plain [N, K] weight, or (BNB4_BLOCKSIZE > 0) bitsandbytes'
    flat 4-bit codes with their absmax and codebook, made into tiles by `_bnb4_tile`."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if BNB4_BLOCKSIZE:
            w = _bnb4_tile(w_ptr, absmax_ptr, code_ptr, offs_n, offs_k, n_ok[:, None] & k_ok[None, :], K,
                           BNB4_BLOCKSIZE, ROUND_BF16, x_ptr.dtype.element_ty)
        else:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
        if SUM_DOT:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif FP32_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _bnb4(weight: torch.Tensor):
    """A bitsandbytes 4-bit weight's flat parts (invariant.bnb4bit.Bnb4bitWeight.flat), else None."""
    if type(weight).__name__ != "Bnb4bitWeight":
        return None
    return weight.flat()


def supported(weight: torch.Tensor) -> bool:
    """Whether invariant mode's strategy check tries this kernel on the weight: a plain 2-D float
    CUDA tensor, or a bitsandbytes 4-bit one in its flat layout (tests call `row_linear` under the
    interpreter directly)."""
    if weight.device.type != "cuda" or weight.dtype not in DTYPES or weight.dim() != 2:
        return False
    return type(weight) in (torch.Tensor, torch.nn.Parameter) or _bnb4(weight) is not None


def row_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d [M, K] -> [M, N] in x's dtype, each row computed as it would be alone. A bitsandbytes
    4-bit weight (`supported`) is read from its codes: a verify step of a few rows streams them
    once, where bitsandbytes' own many-row path dequantizes the whole weight first; its rows are
    bitwise those of this kernel over the dequantized weight.

    Example: for a `Linear4bit` `module` in float32, `row_linear(x, linear_weight(module), None)`
    equals `row_linear(x, dequantize_4bit(module.weight, module.weight.quant_state), None)`."""
    x = x2d.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    bnb4 = _bnb4(weight)
    if bnb4 is not None:
        codes, absmax, code = bnb4
        w, absmax, code, blocksize = codes.reshape(-1), absmax.reshape(-1), code, (n * k) // absmax.numel()
    else:
        w = weight if weight.stride(1) == 1 else weight.contiguous()
        absmax = code = w
        blocksize = 0
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _row_linear_kernel[grid](
        x, w, absmax, code, bias if bias is not None else x, out, m, n, k, x.stride(0), k if bnb4 is not None else w.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        FP32_DOT=x.dtype == torch.float32, SUM_DOT=INTERPRETED, BNB4_BLOCKSIZE=blocksize,
        ROUND_BF16=bnb4 is not None and x.dtype == torch.bfloat16,
    )
    return out
