"""A linear layer whose rows do not depend on how many rows share the call (fp32, CPU, numba).

`row_linear(x, weight, bias)` computes `x @ weight.T (+ bias)` with each output element one dot
product over K, compiled once into one loop: every row runs the same instructions whatever M is,
whichever other rows share the call and whichever thread takes it, so row i of an M-row call is
bitwise the same as that row alone. MKL's `F.linear` gives no such thing on CPU: it picks its
kernel by M and splits rows between threads, so a row rounds differently in a 1-row call, a
5-row call and at another position of the same call.

The dot product is vectorized by LLVM (`fastmath` reassociation, so the order of the sum is the
compiled loop's, fixed per K, not left to right), weights are read once per call in their
`nn.Linear` layout (`[N, K]`, no copy), output rows split between numba's threads by blocks of N.
For the handful of rows of a decode or verify step this beats MKL, because it streams each
weight row once for all M rows (docs/results.md, "Why the CPU kernels"). Used by invariant mode
(invariant.linears) for float32 where the C kernels of cpu.kernels were not built; numba
has no bfloat16 arithmetic.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch

_BLOCK_N = 16  # output features per parallel work item
# numba's "workqueue" threading layer (where no OpenMP or TBB is found) aborts the process when two
# Python threads enter a parallel kernel at once; two models generating in two threads would
_LOCK = threading.Lock()
_started = False


@numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True, boundscheck=False)
def _rows_linear(x, w, out):  # pragma: no cover - numba-compiled
    """out[m, n] = dot(w[n], x[m]) for x [M, K], w [N, K] (float32, C-contiguous)."""
    m_rows, k_dim = x.shape
    n_out = w.shape[0]
    for blk in numba.prange((n_out + _BLOCK_N - 1) // _BLOCK_N):
        for n in range(blk * _BLOCK_N, min(n_out, blk * _BLOCK_N + _BLOCK_N)):
            wr = w[n]
            for m in range(m_rows):
                xr = x[m]
                s = np.float32(0.0)
                for k in range(k_dim):
                    s += wr[k] * xr[k]
                out[m, n] = s


def supported(weight: torch.Tensor) -> bool:
    """Whether `row_linear` can take this weight: a plain float32 CPU tensor (not a tensor
    subclass such as a sharded DTensor)."""
    plain = type(weight) in (torch.Tensor, torch.nn.Parameter)
    return plain and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def row_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d [M, K] -> [M, N] float32, each row computed as it would be alone."""
    x = x2d.detach().contiguous()
    w = weight.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    global _started
    threads = torch.get_num_threads()
    with _LOCK:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # follow torch's count
        _rows_linear(x.numpy(), w.numpy(), out.numpy())
        if not _started:
            _started = True
            torch.set_num_threads(threads)  # numba's threading layer start-up resets OpenMP's count
    return out if bias is None else out + bias
