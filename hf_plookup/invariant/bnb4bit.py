"""bitsandbytes' 4-bit linears (`Linear4bit`: nf4 and fp4, QLoRA's format) seen as plain linears.

A `Linear4bit` holds its weight as a flat `Params4bit` of packed codes ([N * K / 2, 1] bytes, two
codes a byte, the first in the high nibble) with a quant state: one absmax per block of `blocksize`
consecutive values of the [N, K] weight (float32, or 8-bit itself with a second state where
`compress_statistics` nests them), the 16-value codebook of nf4 or fp4, and the shape. Its forward,
with no gradient, is

    F.linear(x.to(cd), W, bias.to(cd)).to(x.dtype),  W[n, k] = (codebook[q[n, k]] * absmax[block]).to(cd)

cd being the module's compute dtype (bitsandbytes' `gemm_4bit` on a CPU without AVX-512 BF16: the
weight dequantized to cd, then torch's `F.linear`, for any row count). So the module is a plain
linear of a [N, K] weight of dtype cd, and `linear_weight` gives it as one: a `Bnb4bitWeight`, a
tensor of that shape and dtype whose `F.linear` is the module's own arithmetic and whose codes,
absmax and codebook `cpu.kernels.q4_parts` reads (the C linears' "lut" form computes W's values
exactly; invariant.module_weight). Invariant mode then routes it as any linear
(`invariant.linears`), casting to the compute dtype and back around it.

Example: a `Linear4bit(576, 1536)` quantized in nf4 with blocks of 64, compute dtype float32, gives
`linear_weight(module)` of shape [1536, 576], float32; its `q4_parts` has codes [1536, 576],
scales (the absmax) [1536, 9], group 64, form "lut".

On a CPU with AVX-512 BF16, bitsandbytes repacks a module's codes into a layout of its own at the
module's first forward without gradients (`_convert_weight_packed_for_cpu`: the absmax rounded to
bfloat16), and from then on computes in bfloat16 with its own kernel, whatever the compute dtype,
rounding a row differently with another row count. `wrap` keeps the flat layout instead
(`hold_flat`, before the probe's first forward): each module's `support_avx512bf16_for_cpu`, the flag
bitsandbytes reads, is turned off, so its forward is the dequantize-then-`F.linear` above on every
CPU, and the C linears read its codes. `unwrap` turns the flag back on (`release`).

A module bitsandbytes has repacked already (the model ran a forward before `wrap`) is put back in
the flat layout by `hold_flat` too, with the absmax the repacking rounded to bf16 (`_flatten`): the
repacked model's own values, which the C linears then read.

Not read (the module's own kernel runs, and the wrap-time probe says what that means): weights whose
K is not a multiple of the block (a block would span two rows), codes stored in another dtype than
uint8 (`bnb_4bit_quant_storage`), an absmax that is not a finite number.
"""

from __future__ import annotations

import torch

from .module_weight import ModuleWeight, Views


def is_linear4bit(module: torch.nn.Module) -> bool:
    """A bitsandbytes `Linear4bit` (or a subclass: `LinearNF4`, `LinearFP4`) holding a quantized
    2-D weight, with no forward set on the instance."""
    cls = type(module)
    if "forward" in vars(module) or not any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes")
                                            for c in cls.__mro__):
        return False
    state = _state(module)
    return state is not None and len(state.shape) == 2


def _state(module: torch.nn.Module):
    weight = getattr(module, "weight", None)
    return getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)


class Bnb4bitWeight(ModuleWeight):
    """A `Linear4bit`'s weight as the [N, K] weight of its compute dtype (see the module text). Its
    only op is `F.linear`, which runs the module's own `bnb.matmul_4bit`; it holds no values."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self.quant_state = _state(module)

    @staticmethod
    def shape_of(module: torch.nn.Module) -> tuple[int, int]:
        return tuple(_state(module).shape)

    @staticmethod
    def dtype_of(module: torch.nn.Module) -> torch.dtype:
        return compute_dtype(module)

    @staticmethod
    def codes_of(module: torch.nn.Module) -> torch.Tensor:
        return module.weight

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, self.param, quant_state=self.quant_state, bias=bias)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(the codes' tensor, N K / 2 bytes in the flat layout, the absmax [N, K / blocksize]
        float32 with a nested one undone, the codebook [16] float32) where a kernel of the flat
        layout can read this weight, else None: codes repacked or not uint8, a block spanning two
        rows, an odd block, no 16-value codebook, or an absmax that is not a finite number (the C
        linears' bf16 rounding of its products assumes numbers). The absmax is resolved once per
        version of the quant state's."""
        state, param = self.quant_state, self.param
        n, k = state.shape
        group = int(state.blocksize)
        if (_repacked(state) or param.dtype != torch.uint8 or param.numel() * 2 != n * k or k % group or group % 2
                or state.code is None or state.code.numel() != 16):
            return None
        key = (state.absmax.data_ptr(), state.absmax._version)
        if getattr(self, "_flat", (None,))[0] != key:
            absmax = state.absmax
            if state.nested:  # the absmax quantized again, as bitsandbytes' gemm_4bit undoes it
                import bitsandbytes.functional as bnb_f

                absmax = bnb_f.dequantize_blockwise(state.absmax, state.state2) + state.offset
            absmax = absmax.float().reshape(n, k // group)
            parts = (param, absmax, state.code.float()) if bool(torch.isfinite(absmax).all()) else None
            self._flat = (key, parts)
        return self._flat[1]

    def q4_fields(self):
        """The `cpu.kernels.Q4Parts` of this weight in the "lut" form (codes [N, K], absmax [N, K /
        blocksize] float32 as the scales, the codebook) where the C linears can read it (`flat`),
        else None (`cpu.kernels.q4_parts` checked the device and the dtype)."""
        from ..cpu.kernels import Q4Parts, nibble_codes

        flat = self.flat()
        if flat is None:
            return None
        param, absmax, code = flat
        n, k = self.quant_state.shape
        return Q4Parts(lambda: nibble_codes(param.data, n, k), absmax, torch.zeros_like(absmax),
                       int(self.quant_state.blocksize), "lut", 0.0, param, code)


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype a `Linear4bit` computes in: its `compute_dtype`, or (unset until its first forward,
    which takes the input's) the dtype its weight was quantized from."""
    return module.compute_dtype or _state(module).dtype


def linear_weight(module: torch.nn.Module) -> Bnb4bitWeight:
    """The `Bnb4bitWeight` of `module` (an `is_linear4bit` one), made once and kept while the module
    lives and holds the same `Params4bit` in the same layout with the same compute dtype (a weight put
    in its place, or repacked by bitsandbytes, gets a new one)."""
    return _VIEWS.get(module, module.weight, (compute_dtype(module), _repacked(_state(module))))


_VIEWS = Views(Bnb4bitWeight)


def _repacked(state) -> bool:
    """Whether bitsandbytes has repacked the codes of this quant state into its own CPU layout."""
    return bool(getattr(state, "packing_format_for_cpu", False))


_REPACKS = "_hf_plookup_repacks"  # (on a module whose repacking `hold_flat` turned off)


def _flatten(module: torch.nn.Module) -> bool:
    """Put a module bitsandbytes has repacked (a forward before `wrap`) back in the flat layout, each
    weight the value its repacked form holds: bitsandbytes' own inverse of the layout
    (`_convert_weight_packed_for_cpu_inverse`, what it saves a state dict with), the absmax kept as
    the repacking rounded it (bf16 values in float32, one a block, not nested: bitsandbytes' inverse
    would quantize a once-nested absmax again, and leaves another transposed). False, and the module
    as it was, where the repacked state is not the one this reads."""
    import bitsandbytes.functional as bnb_f

    state = _state(module)
    n, k = state.shape
    inverse = getattr(bnb_f, "_convert_weight_packed_for_cpu_inverse", None)
    blocks = k // int(state.blocksize) if k % int(state.blocksize) == 0 else 0
    if (inverse is None or not blocks or state.absmax.dtype != torch.bfloat16
            or tuple(state.absmax.shape) != (blocks, n) or getattr(state, "original_qshape", None) is None
            or module.weight.dtype != torch.uint8 or tuple(module.weight.shape) != (n, k // 2)):
        return False
    absmax = state.absmax.T.reshape(-1).float()
    state.original_nested = False
    module.weight.data, state = inverse(module.weight.data, state)
    state.absmax = absmax
    module.weight.quant_state = state
    return True


def hold_flat(model: torch.nn.Module) -> int:
    """Keep `model`'s `Linear4bit`s on the CPU in the flat layout (see the module text): those that
    bitsandbytes would repack at their next forward get its flag turned off, and those it has
    repacked already are put back (`_flatten`). Idempotent; returns how many are held."""
    count = 0
    for m in model.modules():
        if m.__dict__.get(_REPACKS):
            count += 1
        elif (is_linear4bit(m) and getattr(m, "support_avx512bf16_for_cpu", False) and m.weight.device.type == "cpu"
              and (not _repacked(_state(m)) or _flatten(m))):
            m.support_avx512bf16_for_cpu = False
            m.__dict__[_REPACKS] = True
            count += 1
    return count


def held(model: torch.nn.Module) -> bool:
    """Whether `hold_flat` holds any of `model`'s linears."""
    return any(m.__dict__.get(_REPACKS) for m in model.modules())


def release(model: torch.nn.Module) -> None:
    """Undo `hold_flat`: bitsandbytes repacks the modules at their next forward again."""
    for m in model.modules():
        if m.__dict__.pop(_REPACKS, None):
            m.support_avx512bf16_for_cpu = True
