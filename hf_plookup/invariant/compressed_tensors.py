"""compressed-tensors' 4-bit and 8-bit linears (llm-compressor's "pack-quantized" W4A16 and W8A16
checkpoints) kept compressed, their codes read by the C linears.

transformers loads such a checkpoint on CPU with each quantized linear a plain `nn.Linear` that
holds, in place of its weight (b: the bits, 4 or 8):

- `weight_packed` int32 [N, K b / 32]: 32 / b codes a word along K from its low bits up, each the
  signed value q (-8..7, or -128..127) plus 8 (or 128);
- `weight_scale` [N, K / G] (G: the group; K for one scale a row), in the model's dtype;
- for an asymmetric scheme `weight_zero_point` int32 [ceil(N b / 32), K / G]: the signed zero points
  plus 8 (128), packed the same way along N;

and compressed-tensors sets its own forward on each instance and a pre-hook on the model. At the
model's first forward that hook decompresses every such linear into a float `weight`, `(q - zero) *
scale` in the scale's dtype (the difference exact, the product rounded once), drops the codes, and
from then on the model is a float model at its float size, its linears `F.linear` of those weights.

`hold_compressed(model)` (wrap, before its first forward) keeps the codes instead: each such linear
becomes a `CompressedLinear` (an `nn.Linear` whose `weight` is `CompressedTensorsWeight`, a view of
its codes and scales), compressed-tensors' forward on the instance and its pre-hook are taken off,
and nothing is decompressed. The view's `F.linear` is the decompressed linear's, bitwise: the same
weight, made for the call, then `F.linear`; the C linears read its codes as the "sub_mul" form
(`cpu.kernels.q4_parts`: offset 8, the zero points as shifts, zeros where symmetric), each weight
the value compressed-tensors would have decompressed (8-bit codes: the weight kind W_Q8G, offset
128). `release(model)` (unwrap, a wrap that
fails, or an engine that runs without invariant mode) puts the instances' forwards and the hook
back: the model is as it was loaded.

Held only when every quantized linear of the model is such a linear: 4 or 8 bits, integer, group or
channel strategy, no activation quantization, no act-order, K a multiple of 32 / b, on the CPU, not yet
decompressed (else compressed-tensors' hook would still decompress the others, and the model is
left to it).

Example: a W4A16 checkpoint of a model whose `q_proj` is 576 -> 576 in groups of 128, loaded in
bfloat16, gives after `hold_compressed` a `CompressedLinear` whose `weight` is a [576, 576]
bfloat16 `CompressedTensorsWeight`; its `q4_parts` are codes [576, 576], scales and shifts
[576, 4], group 128, form "sub_mul", offset 8.0. A W8A16 one in one scale a row gives codes [576,
576] of 8 bits (0..255), scales and shifts [576, 1], group 576, offset 128.0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cpu import kernels
from .module_weight import ModuleWeight, Views

_HOOK = "_hf_plookup_ct_hook"  # the model's attribute keeping compressed-tensors' pre-hook while held


def _ct_forward(module: torch.nn.Module) -> bool:
    """Whether the forward set on `module`'s instance is compressed-tensors' quantized forward (it
    wraps `nn.Linear.forward`, so its name and module are copied from there; its code is its own)."""
    f = getattr(vars(module).get("forward"), "__func__", None)
    code = getattr(f, "__code__", None)
    return (code is not None and code.co_name == "quantized_forward" and "compressed_tensors" in code.co_filename
            and getattr(f, "__wrapped__", None) is torch.nn.Linear.forward)


def _name(value) -> str:
    """An enum's value (compressed-tensors' formats, strategies and statuses), or the value itself, as text."""
    return str(getattr(value, "value", value))


def _holdable(module: torch.nn.Module) -> bool:
    """A compressed-tensors linear of the module text, compressed, in its loaded state."""
    scheme = getattr(module, "quantization_scheme", None)
    w = getattr(scheme, "weights", None)
    if type(module) is not torch.nn.Linear or not _ct_forward(module) or w is None or type(module._parameters) is not dict:
        return False
    if (_name(getattr(module, "quantization_status", None)) != "compressed" or _name(scheme.format) != "pack-quantized"
            or w.num_bits not in (4, 8) or _name(w.type) != "int" or _name(w.strategy) not in ("group", "channel") or w.dynamic
            or w.actorder is not None or scheme.input_activations is not None or scheme.output_activations is not None):
        return False
    params = module._parameters
    packed, scale, zero = params.get("weight_packed"), params.get("weight_scale"), params.get("weight_zero_point")
    n, k, per = module.out_features, module.in_features, 32 // w.num_bits  # (codes a word)
    group = k if _name(w.strategy) == "channel" else int(w.group_size or 0)
    if "weight" in params or "weight_g_idx" in params or group <= 0 or k % per or k % group or group % 2:
        return False
    if not (isinstance(packed, torch.Tensor) and packed.device.type == "cpu" and packed.dtype == torch.int32
            and tuple(packed.shape) == (n, k // per) and packed.is_contiguous()
            and isinstance(scale, torch.Tensor) and scale.device.type == "cpu" and scale.dtype in kernels.DTYPES
            and tuple(scale.shape) == (n, k // group)):
        return False
    if w.symmetric:
        return zero is None
    return (isinstance(zero, torch.Tensor) and zero.dtype == torch.int32 and zero.device.type == "cpu"
            and tuple(zero.shape) == (-(-n // per), k // group))


class CompressedLinear(torch.nn.Linear):
    """A held compressed-tensors linear (the module text): `nn.Linear`'s forward over `weight`, the
    view of its codes (or, should compressed-tensors decompress it after all, its float weight)."""

    @property
    def weight(self) -> torch.Tensor:
        float_weight = self._parameters.get("weight")
        return float_weight if float_weight is not None else linear_weight(self)


def is_held(module: torch.nn.Module) -> bool:
    """A held linear whose codes are still its own (not decompressed since)."""
    return type(module) is CompressedLinear and "weight_packed" in module._parameters


def held(model: torch.nn.Module) -> bool:
    """Whether `hold_compressed` holds `model`'s linears."""
    return _HOOK in vars(model)


def _decompress_hook(model: torch.nn.Module):
    """(key, function) of compressed-tensors' decompressing pre-hook on `model`, else None. Found by
    its function (a copy of the model holds a handle to the original's hooks)."""
    for key, fn in model._forward_pre_hooks.items():
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_name == "ct_decompress_hook" and "compressed_tensors" in code.co_filename:
            return key, fn
    return None


def hold_compressed(model: torch.nn.Module) -> int:
    """Hold `model`'s compressed-tensors linears compressed where the module text says (idempotent);
    returns how many are held."""
    if held(model):
        return sum(is_held(m) for m in model.modules())
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    hook = _decompress_hook(model)
    if not quantized or hook is None or not all(_holdable(m) for m in quantized):
        return 0
    for m in quantized:
        m.__dict__["_hf_plookup_ct_forward"] = m.__dict__.pop("forward")
        m.__class__ = CompressedLinear
    del model._forward_pre_hooks[hook[0]]
    model._forward_pre_hooks_with_kwargs.pop(hook[0], None)
    model.__dict__.pop("ct_decompress_hook", None)  # (its handle)
    model.__dict__[_HOOK] = hook[1]
    return len(quantized)


def release(model: torch.nn.Module) -> None:
    """Undo `hold_compressed`: compressed-tensors' forwards and pre-hook back, its linears plain
    `nn.Linear`s again. A model not held is left as it is."""
    hook = model.__dict__.pop(_HOOK, None)
    if hook is None:
        return
    compressed = False
    for m in model.modules():
        if type(m) is CompressedLinear:
            m.__class__ = torch.nn.Linear
            m.__dict__["forward"] = m.__dict__.pop("_hf_plookup_ct_forward")
            compressed |= "weight_packed" in m._parameters
    if compressed:
        model.ct_decompress_hook = model.register_forward_pre_hook(hook)


def _group(module: torch.nn.Module) -> int:
    return module.in_features // module.weight_scale.shape[1]


def _bits(module: torch.nn.Module) -> int:
    """The bits of a held linear's codes (4 or 8), from the packed words' width."""
    return module.weight_packed.shape[1] * 32 // module.in_features


class CompressedTensorsWeight(ModuleWeight):
    """A held linear's weight (see the module text) as the [N, K] weight of its scale's dtype. Its
    `F.linear` is the decompressed linear's; it holds no values."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.scales, self.group, self.bits = module.weight_scale, _group(module), _bits(module)
        self.offset = 1 << (self.bits - 1)  # (a code is the signed value plus this)
        self.zero_words = module._parameters.get("weight_zero_point")

    @staticmethod
    def dtype_of(module: torch.nn.Module) -> torch.dtype:
        return module.weight_scale.dtype

    @staticmethod
    def codes_of(module: torch.nn.Module) -> torch.Tensor:
        return module.weight_packed

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """The codes [N, K] (uint8: q + 8, or q + 128) of `weight_packed` [N, K b / 32]."""
        return kernels.row_words_codes(words, self.bits)

    def zeros(self) -> torch.Tensor:
        """The groups' signed zero points [N, K / group] (int16), zeros where symmetric."""
        n = self.shape[0]
        if self.zero_words is None:
            return torch.zeros(self.scales.shape, dtype=torch.int16)
        return kernels.words_codes(self.zero_words, self.bits)[:n].to(torch.int16) - self.offset

    def dequantized(self) -> torch.Tensor:
        """[N, K] in the scale's dtype: (q - zero) * scale, as compressed-tensors decompresses it (the
        difference exact, the product rounded once)."""
        n, k = self.shape
        q = self.unpack(self.param).view(n, k // self.group, self.group).to(self.dtype) - self.offset
        if self.zero_words is not None:
            q -= self.zeros().unsqueeze(-1).to(self.dtype)
        return (q * self.scales.unsqueeze(-1)).view(n, k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantized(), bias)

    def q4_fields(self):
        """The `cpu.kernels.Q4Parts` of this weight in the "sub_mul" form: codes [N, K], the scales
        and the signed zero points [N, K / group] (as float32, exactly), offset 8 (8-bit codes: 128,
        bits 8); None where a scale is not finite (the bf16 tiles round values that cannot be NaN)."""
        if not bool(torch.isfinite(self.scales).all()):
            return None
        param, bits = self.param, self.bits  # (not the view itself: kernels keep the parts while it lives)
        return kernels.Q4Parts(lambda: kernels.row_words_codes(param, bits), self.scales, self.zeros().float(),
                               self.group, "sub_mul", float(self.offset), param, bits=bits)


_VIEWS = Views(CompressedTensorsWeight)


def linear_weight(module: torch.nn.Module) -> CompressedTensorsWeight:
    """The view of a held linear, made once and kept while it holds the same codes and scales."""
    p = module._parameters  # (read once: the C layers ask for every held linear's view each step)
    return _VIEWS.get(module, p["weight_packed"], (id(p["weight_scale"]), id(p.get("weight_zero_point"))))
