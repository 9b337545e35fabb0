"""gptqmodel's 4-bit linears on CPU seen as plain linears, in the two forms such a module takes at
its first forward: GPTQ's (`TorchAtenLinear`: transformers' `GPTQConfig`) and AWQ's
(`TorchAtenAwqLinear`: an AWQ checkpoint, which transformers loads through gptqmodel).

A GPTQ 4-bit linear keeps int32 `qweight` [K / 8, N] (eight codes a word, code k of a column in
bits 4 (k % 8) of word k / 8), `qzeros` [K / G, N / 8] (the groups' zero points, packed the same
way along N), fp16 `scales` [K / G, N] and `g_idx`. Its first forward in eval mode fixes its form:

- **Turned** (bf16 or fp16 activations): it turns itself into the form of torch's CPU int4 kernel:
  the codes repacked by `torch._convert_weight_to_int4pack_for_cpu` (its `qweight` from then on),
  and `scales_and_zeros` [K / G, N, 2] holding each group's scale and zero offset `(8 - zero) *
  scale`. Its forward is then `torch._weight_int4pack_mm_for_cpu` (each weight `(code - 8) * scale
  + offset` in float32, products summed in float32 along K, each row alone), plus the bias. That is
  the form optimum-quanto's tinygemm weights have, which the C linears read ("fma", offset 8:
  `cpu.kernels.q4_parts`); `linear_weight` gives the module as a `GptqWeight` over it.
- **Dequantizing** (float32 activations; `linear_mode` "train" from then on, whatever comes later):
  on every call it dequantizes the whole weight, `fp16(scale * (code - zero))` (the product of the
  fp16 scale and a small integer, rounded once to fp16), widens it to the activations' dtype and
  multiplies (`torch.matmul`), plus the bias. The C linears read it as the "sub_mul_f16" form
  (the zeros as shifts, offset 0); `linear_weight` gives it as a float32 `GptqDequantWeight`, which
  the C layers take in a float32 model.

Example: a GPTQ `q_proj` of SmolLM2 (576 -> 576, groups of 64) run once in bf16 gives
`linear_weight(module)` of shape [576, 576], bfloat16, whose `q4_parts` has codes [576, 576],
scales and shifts [576, 9], group 64, form "fma", offset 8.0; run once in float32, a float32 view
of the same shape whose parts are the same codes, the fp16 scales and the zero points [576, 9],
form "sub_mul_f16", offset 0.0.

A turned weight in fp16 (transformers' dtype "auto" loads most published GPTQ checkpoints so) is
read the same way: the C kernels take fp16 calls.

An AWQ linear takes the same two forms with the same arithmetic: turned, the same int4 kernel over
codes it repacks the same way (a `GptqWeight`); dequantizing, `fp16(scale * (code - zero))` widened
and `torch.matmul`, from AWQ's own layout, `qweight` [K, N / 8] and `qzeros` [K / G, N / 8] packed
along N out of order (`cpu.kernels.awq_codes`), fp16 `scales` [K / G, N]: an `AwqDequantWeight`.

Not seen as a linear (the module's own forward runs): a module not run yet, one with act-order
(`desc_act`: its inputs permuted), an adapter, other than 4 bits, or an AWQ linear of another of
gptqmodel's kernels.
"""

from __future__ import annotations

import torch

from ..cpu import kernels
from .module_weight import ModuleWeight, Views


def is_gptq_linear(module: torch.nn.Module) -> bool:
    """A gptqmodel GPTQ or AWQ linear in one of the two forms of the module text (turned or
    dequantizing), 4 bits, its inputs in order, no adapter, no forward set on the instance."""
    return _turned(module) or _dequantizing(module)


def _gptq(module: torch.nn.Module) -> bool:
    return ("forward" not in vars(module) and type(module).__module__.startswith("gptqmodel.")
            and getattr(module, "bits", None) == 4 and getattr(module, "adapter", None) is None
            and not module.training)


def _awq(module: torch.nn.Module) -> bool:
    """Of gptqmodel's AWQ class of the module text (an AWQ checkpoint loaded on CPU); by its class
    alone, as `linear_weight` asks it of a module whose forward invariant mode has set."""
    return getattr(type(module), "QUANT_TYPE", None) == "awq_torch_aten_kernel"


def _turned(module: torch.nn.Module) -> bool:
    """Turned into torch's CPU int4 form. (AWQ has no act-order, and adds its bias after the kernel.)"""
    return (_gptq(module) and getattr(module, "_cpu_transformed", False)
            and getattr(module, "linear_mode", None) == "inference"
            and isinstance(getattr(module, "scales_and_zeros", None), torch.Tensor)
            and (_awq(module) or (not getattr(module, "_fused_op_handles_bias", True)
                                  and module._ret_idx_is_identity())))


def _dequantizing(module: torch.nn.Module) -> bool:
    """Dequantizing on every call, in its own layout: int32 words, fp16 scales, groups in order
    (GPTQ's codes packed along K, AWQ's along N)."""
    if not (_gptq(module) and not getattr(module, "_cpu_transformed", False)
            and getattr(module, "linear_mode", None) == "train" and not getattr(module, "planar", False)):
        return False
    awq = _awq(module)
    names = ("qweight", "qzeros", "scales") + (() if awq else ("g_idx",))
    tensors = [getattr(module, a, None) for a in names]
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors):
        return False
    qweight, qzeros, scales = tensors[:3]
    n, k, group = module.out_features, module.in_features, int(getattr(module, "group_size", 0) or 0)
    if group <= 0 or k % 8 or n % 8 or k % group:
        return False
    if not (qweight.dtype == torch.int32 and tuple(qweight.shape) == ((k, n // 8) if awq else (k // 8, n))
            and qweight.is_contiguous() and qzeros.dtype == torch.int32 and tuple(qzeros.shape) == (k // group, n // 8)
            and scales.dtype == torch.float16 and tuple(scales.shape) == (k // group, n)):
        return False
    return awq or (tensors[3].numel() == k and torch.equal(tensors[3].long(), torch.arange(k) // group))


class GptqWeight(ModuleWeight):
    """A turned GPTQ linear's weight as the [N, K] weight of its activation dtype (see the module
    text). `F.linear` runs the module's own int4 kernel; it holds no values."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.scales_and_zeros = module.scales_and_zeros
        self.group = int(module.group_size)

    @staticmethod
    def dtype_of(module: torch.nn.Module) -> torch.dtype:
        return module.scales_and_zeros.dtype

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
        n, k = self.shape
        sz, block, param = self.scales_and_zeros, kernels.int4pack_block(), self.param
        if (block is None or n % block or k % self.group or self.group % 2 or tuple(sz.shape) != (k // self.group, n, 2)
                or param.dtype != torch.uint8 or tuple(param.shape) != (n, k // 2)):
            return None
        return kernels.Q4Parts(lambda: kernels.int4pack_codes(param, n, k, block), sz[:, :, 0].t(), sz[:, :, 1].t(),
                               self.group, "fma", 8.0, param)


class GptqDequantWeight(ModuleWeight):
    """A dequantizing GPTQ linear's weight (see the module text) as a float32 [N, K] weight. Its
    `F.linear` is the module's forward: the fp16 weight dequantized, widened to the input's dtype,
    `torch.matmul`, plus the bias. It holds no values."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.scales, self.qzeros, self.group = module.scales, module.qzeros, int(module.group_size)

    @staticmethod
    def dtype_of(module: torch.nn.Module) -> torch.dtype:
        return torch.float32

    @staticmethod
    def codes_of(module: torch.nn.Module) -> torch.Tensor:
        return module.qweight

    @staticmethod
    def unpack(qweight: torch.Tensor) -> torch.Tensor:
        """The codes [K, N] (uint8) of `qweight`: GPTQ's eight a word along K."""
        return kernels.words_codes(qweight)

    def zeros(self) -> torch.Tensor:
        """The groups' zero points [K / group, N] (int8, 0..15): GPTQ's eight a word along N."""
        return kernels.words_codes(self.qzeros.t().contiguous()).t().to(torch.int8)

    def dequantized(self) -> torch.Tensor:
        """[K, N] fp16: scale * (code - zero), as the module computes it (an integer difference
        times the fp16 scale, rounded to fp16)."""
        codes = self.unpack(self.param).to(torch.int8)  # [K, N]
        rows = torch.arange(codes.shape[0]) // self.group
        return self.scales[rows] * (codes - self.zeros()[rows])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = self.shape
        out = torch.matmul(x.reshape(-1, k), self.dequantized().to(x.dtype))
        if bias is not None:
            out.add_(bias)
        return out.reshape(*x.shape[:-1], n)

    def q4_fields(self):
        """The `cpu.kernels.Q4Parts` of this weight in the "sub_mul_f16" form: codes [N, K], the fp16
        scales and the zero points [N, K / group] (both as float32, exactly), offset 0."""
        param, unpack = self.param, self.unpack
        return kernels.Q4Parts(lambda: unpack(param).t().contiguous(), self.scales.t().float(),
                               self.zeros().t().float(), self.group, "sub_mul_f16", 0.0, param)


class AwqDequantWeight(GptqDequantWeight):
    """A dequantizing AWQ linear's weight: `GptqDequantWeight`'s arithmetic over AWQ's layout, codes
    and zero points packed along N (`cpu.kernels.awq_codes`)."""

    @staticmethod
    def unpack(qweight: torch.Tensor) -> torch.Tensor:
        """The codes [K, N] (uint8) of AWQ's `qweight` [K, N / 8]."""
        return kernels.awq_codes(qweight)

    def zeros(self) -> torch.Tensor:
        """The groups' zero points [K / group, N] (int8, 0..15)."""
        return kernels.awq_codes(self.qzeros).to(torch.int8)


_VIEWS = Views(GptqWeight)
_DEQUANT_VIEWS = {False: Views(GptqDequantWeight), True: Views(AwqDequantWeight)}  # by AWQ or not


def linear_weight(module: torch.nn.Module) -> GptqWeight | GptqDequantWeight | AwqDequantWeight:
    """The view of `module` (an `is_gptq_linear` one) in its form, made once and kept while the
    module lives and holds the same codes and scales. (Asked during steps too, when invariant mode
    has set a forward on the instance, so the form is told by the module's state and class alone.)"""
    if getattr(module, "_cpu_transformed", False):
        return _VIEWS.get(module, module.qweight, (id(module.scales_and_zeros),))
    return _DEQUANT_VIEWS[_awq(module)].get(module, module.qweight, (id(module.scales), id(module.qzeros)))
