"""gptqmodel's GPTQ linears on CPU (`TorchAtenLinear`: transformers' `GPTQConfig`) seen as plain
linears.

A GPTQ 4-bit linear keeps int32 `qweight` [K / 8, N] (eight codes a word), `qzeros` [K / G, N / 8],
`scales` [K / G, N] and `g_idx`. On CPU, gptqmodel's `TorchAtenLinear` turns itself, at its first
forward with bf16 or fp16 activations in eval mode, into the form of torch's CPU int4 kernel: the
codes repacked by `torch._convert_weight_to_int4pack_for_cpu` (its `qweight` from then on), and
`scales_and_zeros` [K / G, N, 2] holding each group's scale and zero offset `(8 - zero) * scale`.
Its forward is then `torch._weight_int4pack_mm_for_cpu` (each weight `(code - 8) * scale +
offset` in float32, products summed in float32 along K, each row alone), plus the bias. That is the
form optimum-quanto's tinygemm weights have, which the C linears read ("fma", offset 8:
`cpu.kernels.q4_parts`); `linear_weight` gives the module as a `GptqWeight` over it (`ModuleWeight`).

Example: a GPTQ `q_proj` of SmolLM2 (576 -> 576, groups of 64) run once in bf16 gives
`linear_weight(module)` of shape [576, 576], bfloat16, whose `q4_parts` has codes [576, 576],
scales and shifts [576, 9], group 64, form "fma", offset 8.0.

Not seen as a linear (the module's own forward runs): a module not yet turned (run in fp32, where
gptqmodel dequantizes the whole weight and calls a matmul on every call, or not run at all), one
with act-order (`desc_act`: its inputs permuted), an adapter, or other than 4 bits; and a weight
in fp16, which the C linears do not take (`q4_parts` None: the module's kernel runs).
"""

from __future__ import annotations

import torch

from .module_weight import ModuleWeight, Views


def is_gptq_linear(module: torch.nn.Module) -> bool:
    """A gptqmodel GPTQ linear turned into torch's CPU int4 form (see the module text), 4 bits, its
    inputs in order, no adapter, no forward set on the instance."""
    if "forward" in vars(module) or not type(module).__module__.startswith("gptqmodel."):
        return False
    return (getattr(module, "bits", None) == 4 and getattr(module, "_cpu_transformed", False)
            and getattr(module, "linear_mode", None) == "inference" and getattr(module, "adapter", None) is None
            and isinstance(getattr(module, "scales_and_zeros", None), torch.Tensor)
            and not getattr(module, "_fused_op_handles_bias", True) and module._ret_idx_is_identity())


class GptqWeight(ModuleWeight):
    """A turned GPTQ linear's weight as the [N, K] weight of its activation dtype (see the module
    text). `F.linear` runs the module's own int4 kernel; it holds no values."""

    @staticmethod
    def __new__(cls, module: torch.nn.Module):
        return ModuleWeight.__new__(cls, module, (module.out_features, module.in_features),
                                    module.scales_and_zeros.dtype)

    def __init__(self, module: torch.nn.Module):
        super().__init__(module, (module.out_features, module.in_features), module.scales_and_zeros.dtype)
        self.scales_and_zeros = module.scales_and_zeros
        self.group = int(module.group_size)

    @staticmethod
    def codes_of(module: torch.nn.Module) -> torch.Tensor:
        return module.qweight

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What the module's forward computes: torch's int4 kernel on the rows, then the bias added."""
        n, k = self.shape
        rows = x.reshape(-1, k).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.param, self.group, self.scales_and_zeros)
        if bias is not None:
            out.add_(bias)
        return out.reshape(*x.shape[:-1], n)

    def q4_fields(self):
        """The `cpu.kernels.Q4Parts` of this weight in the tinygemm form ("fma", offset 8: codes [N, K],
        each group's scale and zero offset [N, K / group]) where the C linears can read it, else None
        (`cpu.kernels.q4_parts` checked the device and the dtype)."""
        from ..cpu import kernels

        n, k = self.shape
        sz, block, param = self.scales_and_zeros, kernels.int4pack_block(), self.param
        if (block is None or n % block or k % self.group or self.group % 2 or tuple(sz.shape) != (k // self.group, n, 2)
                or param.dtype != torch.uint8 or tuple(param.shape) != (n, k // 2)):
            return None
        return kernels.Q4Parts(lambda: kernels.int4pack_codes(param, n, k, block), sz[:, :, 0].t(), sz[:, :, 1].t(),
                               self.group, "fma", 8.0, param)


_VIEWS = Views(GptqWeight)


def linear_weight(module: torch.nn.Module) -> GptqWeight:
    """The `GptqWeight` of `module` (an `is_gptq_linear` one), made once and kept while the module
    lives and holds the same codes and scales."""
    return _VIEWS.get(module, module.qweight, (id(module.scales_and_zeros),))
