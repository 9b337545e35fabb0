"""The LM head of multi-row CPU steps, in whichever matmul layout is faster on this CPU.

On CPU a verify step's k+1 rows cost far more than one row in the LM head: MKL's sgemm for a
`[m, H] x [H, V]` product with a handful of rows m and a large vocabulary V streams the weight
poorly, while the same product written as `(W @ x^T)^T` (`[V, H] x [H, m]`) runs close to the
1-row cost (docs/results.md, "Why the CPU kernels"). Which layout wins depends on the CPU and
its BLAS, so the first multi-row step times both once on the real head and keeps the faster for
every row count from 2 to `max_rows` (timing each row count apart cost more than it saved on a
262k-token vocabulary). The swap holds only inside engine forwards (`fast_head`), and only for
an `nn.Linear` head; other layers keep `F.linear` (the transposed layout is slower for them).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from ..cpu.packed_weight import PackedWeight


def _transposed(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # row-major result: what follows (soft-capping, argmax, sampling) reads logits row by row,
    # and a column-major [m, V] view made that several times slower
    y = torch.mm(weight, x2d.t()).t().contiguous()
    return y if bias is None else y + bias


def _time(fn, reps: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class HeadChooser:
    """Whether the transposed layout is faster for `head` at 2..max_rows rows (timed once)."""

    def __init__(self, head: torch.nn.Linear, max_rows: int = 32):
        self.head = head
        self.max_rows = max_rows
        self.transposed: bool | None = None  # None until the first multi-row step

    def use_transposed(self, x2d: torch.Tensor) -> bool:
        if not 1 < x2d.shape[0] <= self.max_rows:
            return False
        if self.transposed is None:
            w, b = self.head.weight, self.head.bias
            plain = _time(lambda: F.linear(x2d, w, b))
            trans = _time(lambda: _transposed(x2d, w, b))
            self.transposed = trans < 0.9 * plain
        return self.transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        if self.use_transposed(x2d):
            return _transposed(x2d, self.head.weight, self.head.bias).reshape(*x.shape[:-1], -1)
        return F.linear(x, self.head.weight, self.head.bias)


def head_chooser(model: torch.nn.Module) -> HeadChooser | None:
    """A chooser for a CPU model whose output embeddings are a plain `nn.Linear` with a plain
    floating weight, else None (a quantized weight, a tensor subclass, has no plain matmul layout)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.device.type != "cpu" or "forward" in vars(head):
        return None  # not a plain CPU linear, or its forward is already replaced (accelerate hooks)
    plain = isinstance(head.weight, PackedWeight) or type(head.weight.data) is torch.Tensor
    if not plain or not head.weight.dtype.is_floating_point:
        return None
    return HeadChooser(head)


@contextlib.contextmanager
def fast_head(chooser: HeadChooser | None):
    """Route the head through `chooser` for one engine forward; restore it after."""
    if chooser is None:
        yield
        return
    head = chooser.head
    head.forward = chooser.forward
    try:
        yield
    finally:
        if vars(head).get("forward") == chooser.forward:
            del head.forward
