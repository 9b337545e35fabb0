"""bitsandbytes' 8-bit linears (`Linear8bitLt`: LLM.int8) seen as plain linears, each row as alone.

LLM.int8 casts a call's inputs to fp16 and quantizes them to int8 row by row (a row's scale its
largest magnitude over 127), but takes every column in which any row of the call holds a value of
magnitude at least its threshold (6 by default) out of the int8 product, for all rows, and
multiplies those columns in floating point: a row's result depends on the call's other rows. `wrap`
marks each such module with the dtype the model computes in (`hold`); invariant mode then sees it
as a linear whose weight is a `Bnb8bitWeight`, whose one op, `F.linear`, is LLM.int8 with the
outliers taken row by row: a row's result is what bitsandbytes' arithmetic gives that row alone
(its int8 part exactly; its outlier columns summed in column order), whatever the step's other
rows, so greedy with drafts and batching is lossless against hf_plookup's own greedy. The C kernels
compute it (weight kind W_Q8B, cpu_kernels.h), reading bitsandbytes' codes where it keeps them, so
they are held once, and the C decoder layers run such a model. HF's prompt is one call over all its
rows, so HF's greedy may still part from it (the probe's note says so).

Example: a `Linear8bitLt(576, 1536)` of a float32 model, held, gives `linear_weight(module)` a
[1536, 576] float32 `Bnb8bitWeight`; `F.linear(x, view, module.bias)` of one row equals
`module(x)` for a row without outliers, bit for bit.
"""

from __future__ import annotations

import torch

from ..cpu import kernels as cpu_kernels
from .module_weight import ModuleWeight, Views

_DTYPE = "_hf_plookup_dtype"  # a held module's compute dtype, in its instance dict


def _is_8bit_class(module: torch.nn.Module) -> bool:
    return any(c.__name__ == "Linear8bitLt" and c.__module__.startswith("bitsandbytes") for c in type(module).__mro__)


def is_linear8bit(module: torch.nn.Module) -> bool:
    """A held bitsandbytes `Linear8bitLt` (int8 weights for inference, no forward set on the instance)."""
    return (_DTYPE in module.__dict__ and "forward" not in vars(module) and _is_8bit_class(module)
            and getattr(module.weight, "dtype", None) == torch.int8)


class Bnb8bitWeight(ModuleWeight):
    """A `Linear8bitLt`'s weight as the [N, K] weight of the dtype its model computes in (see the
    module text). Its only op is `F.linear` (`linear`); it holds no values: its codes are an alias
    of bitsandbytes' own (`param`)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.state = module.state  # (bitsandbytes' MatmulLtState: the codes, scales and threshold)

    @staticmethod
    def dtype_of(module: torch.nn.Module) -> torch.dtype:
        return module.__dict__[_DTYPE]

    @staticmethod
    def codes_of(module: torch.nn.Module) -> torch.Tensor:
        return module.weight if module.state.CB is None else module.state.CB

    def int8_fields(self) -> cpu_kernels.Int8Parts | None:
        """What the C kernels read (cpu.kernels.int8_parts): the codes, bitsandbytes' SCB and its
        threshold rounded to fp16 (torch compares the fp16 inputs with it so); None before
        bitsandbytes made its state's codes."""
        state = self.state
        if state.CB is None or state.SCB is None:
            return None
        threshold = float(torch.tensor(max(state.threshold, 0.0), dtype=torch.float16))
        return cpu_kernels.Int8Parts(self.param, state.SCB.reshape(-1), llm_int8=threshold)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """LLM.int8 of x [..., K], each row as bitsandbytes computes it alone: its fp16 values of
        magnitude at least the threshold are its outliers; the others are quantized to int8 with the
        row's largest magnitude among them (`round(x * (127 / max))`), their products with the codes
        summed exactly and scaled as bitsandbytes' `int8_mm_dequant` does, plus the bias, in the
        input's dtype; then each outlier column in order adds its input times the column's
        dequantized weight (cpu_kernels.h, W_Q8B). Without the C kernels, one bitsandbytes call per
        row."""
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if x.device.type == "cpu" and x.dtype == self.dtype and cpu_kernels.supported(self):
            return cpu_kernels.linear(x2d, self, bias).reshape(*shape[:-1], -1)
        import bitsandbytes as bnb

        self.state.is_training = False  # (as the module's own forward in eval mode: else CPUs take another kernel)
        return torch.cat([bnb.matmul(x2d[i : i + 1], self.param, bias=bias, state=self.state)
                          for i in range(x2d.shape[0])]).reshape(*shape[:-1], -1)


_VIEWS = Views(Bnb8bitWeight)


def linear_weight(module: torch.nn.Module) -> Bnb8bitWeight:
    """The module's `Bnb8bitWeight`, made once while its codes and state stay the same."""
    return _VIEWS.get(module, Bnb8bitWeight.codes_of(module), (id(module.state), module.__dict__[_DTYPE]))


def hold(model: torch.nn.Module) -> int:
    """Mark `model`'s 8-bit linears for inference with the dtype of its floating-point parameters
    (what their forward returns), moving their codes into their state first as their own forward
    would. Idempotent; returns how many are held."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    count = 0
    for m in model.modules():
        if dtype is None or not _is_8bit_class(m) or getattr(m.state, "has_fp16_weights", True):
            continue
        if getattr(m.weight, "CB", None) is not None:
            m.init_8bit_state()
        m.__dict__[_DTYPE] = dtype
        count += 1
    return count


def held(model: torch.nn.Module) -> bool:
    """Whether `hold` holds any of `model`'s linears."""
    return any(_DTYPE in m.__dict__ for m in model.modules())


def release(model: torch.nn.Module) -> None:
    """Undo `hold`: the modules are bitsandbytes' own again."""
    for m in model.modules():
        m.__dict__.pop(_DTYPE, None)
