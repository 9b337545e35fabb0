"""One copy of a quantized weight: its codes held only in the C kernels' packed layout.

The C linears read an int8 or 4-bit weight from a packed copy of its codes (cpu.kernels: W_Q8
panels of 8 output columns, W_Q4 panels of 8 columns two codes a byte, or W_Q4K's along k, each with
its scales).
The quantizing library keeps its own tensor of the same codes, in its own layout, which HF's
forward, a prompt chunk's GEMM, `state_dict` and the library's ops read. Both at once would hold
every code twice, so `pack_quantized(model)` puts a `PackedCodes` in the place of the library's
code tensor: a tensor of the same shape and dtype whose values live inside the kernels' packed
bytes. The kernels read those bytes as they are (`cpu.kernels.packed`), and any other op on it
sees the library's tensor, rebuilt from the bytes for that op:

- int8 values [N, K] (torchao's `Int8Tensor.qdata`, optimum-quanto's `WeightQBytesTensor._data`):
  the values themselves; torchao's grouped values (`IntxUnpackedToInt8Tensor.qdata`, int4 or int8
  values one a byte, and a grouped `Int8Tensor`'s) as codes, the values plus 8 or 128;
- optimum-quanto's 4-bit codes (`WeightQBitsTensor._data._data`): quanto's own packing of them
  (`pack_weights`, two codes a byte along the first dimension);
- torch's CPU int4pack layout (quanto's tinygemm weights, gptqmodel's turned GPTQ and AWQ
  linears' `qweight`): blocks of columns, two codes a byte (`cpu.kernels.int4pack_codes` and its
  inverse);
- bitsandbytes' flat codes (a `Params4bit`, two codes a byte, the first in the high nibble);
- compressed-tensors' `weight_packed` (a parameter: int32 words of eight 4-bit codes, or four 8-bit
  ones, along K: `cpu.kernels.row_words_codes`), a `PackedParameter` in its place.

A GPTQ or AWQ linear that dequantizes on every call (float32: invariant.gptq) keeps both copies:
GPTQ's `qweight` goes into a function gptqmodel compiles with torch.compile, which a tensor of this
kind would trace into; AWQ's is left as it is too.

Each layout's round trip is checked before a tensor is replaced (the library's bytes rebuilt from
the packed ones must equal them) on the first weight of each library class and shape in a model (a
layout is the same for every weight of one; checking them all would add seconds to a large model's
`wrap`), so a layout read wrongly keeps its two copies rather than changing a value.

- An in-place op on a `PackedCodes` (`load_state_dict`'s `copy_`) is done on the rebuilt tensor,
  whose codes are then written back into the packed bytes; the kernels' next read of the weight
  packs it again whole (`cpu.kernels.packed`), since such a write usually comes with new scales.
- `detach` and `alias` give another `PackedCodes` of the same bytes (`nn.Parameter`, `.data`).
- `state_dict` sees the library's plain tensor (put back for the time it runs: libraries serialize
  their inner tensors themselves, and safetensors reads raw memory); pickling gives it too.
- `unpack_quantized(model)` (what `hf_plookup.unwrap` calls) puts the plain tensors back.

Example: a torchao int8 linear [20, 16] in float32 packs its 320 values into panels [3, 16, 8]
and 24 scales; `weight.qdata` is then a `PackedCodes` of shape [20, 16], int8, and `F.linear(x,
weight)` runs torchao's own linear on the values rebuilt for that call::

    >>> pack_quantized(model, invariant.linears.linear_of)   # doctest: +SKIP
    1
    >>> type(model.weight.qdata).__name__        # doctest: +SKIP
    'PackedCodes'
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from . import kernels as cpu_kernels
from .packed_weight import on_plain

log = logging.getLogger("hf_plookup")
aten = torch.ops.aten

__all__ = ["PackedCodes", "pack_quantized", "unpack_quantized"]


@dataclass(frozen=True)
class Layout:
    """How a library's code tensor (of `shape` and `dtype`) maps to the weight's codes [N, K]: `kind`
    (cpu.kernels W_Q8, W_Q8T, W_Q4, W_Q4K or W_Q8G), the weight's `n`, `k` and `weight_dtype` (the dtype of the calls
    its bytes are laid out for, cpu.kernels.packed_dtype: a W_Q8 panel's width depends on it), `to_codes(tensor)` and its inverse `from_codes(codes)`."""

    kind: int
    n: int
    k: int
    weight_dtype: torch.dtype
    shape: tuple[int, ...]
    dtype: torch.dtype
    to_codes: Callable[[torch.Tensor], torch.Tensor]
    from_codes: Callable[[torch.Tensor], torch.Tensor]

    def read(self, packed: torch.Tensor) -> torch.Tensor:
        """The codes [N, K] the packed bytes hold."""
        if self.kind in (cpu_kernels.W_Q8, cpu_kernels.W_Q8T):
            return cpu_kernels.q8_values(packed, self.n, self.k, self.weight_dtype)
        return cpu_kernels.q4_codes(packed, self.n, self.k, self.kind)

    def write(self, packed: torch.Tensor, codes: torch.Tensor) -> None:
        """Write codes [N, K] into the packed bytes (their scales stay)."""
        if self.kind in (cpu_kernels.W_Q8, cpu_kernels.W_Q8T):
            cpu_kernels.write_q8_values(packed, codes, self.weight_dtype)
        else:
            cpu_kernels.write_q4_codes(packed, codes, self.kind)


class _Packed:
    """What a tensor whose codes live in the packed bytes does (`PackedCodes`, and bitsandbytes'
    parameter made so: `_params4bit_class`); see the module text for what each kind of op does."""

    packed: torch.Tensor
    codes_layout: Layout
    __torch_function__ = torch._C._disabled_torch_function_impl  # ops go straight to __torch_dispatch__

    def plain(self) -> torch.Tensor:
        """The library's tensor, rebuilt from the packed bytes (a new plain tensor)."""
        with torch.inference_mode(False):  # a normal tensor, whatever mode the caller runs in
            return self.codes_layout.from_codes(self.codes_layout.read(self.packed))

    def data_ptr(self) -> int:
        """The packed bytes' address: what changes when they move (the C layers' plans key on it)."""
        return self.packed.data_ptr()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.plain()!r})"

    def __reduce_ex__(self, protocol):
        return _same, (self.plain(),)  # pickled as the library's plain tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):  # (nn.Parameter, `.data`, views' aliases)
            return PackedCodes(args[0].packed, args[0].codes_layout)
        return on_plain(func, args, kwargs, _Packed, _Packed.plain, _write_back)


def _write_back(t: _Packed, plain: torch.Tensor) -> None:
    """An op wrote to `t`'s rebuilt tensor: its codes go into the packed bytes, and the kernels' next
    read packs the whole weight again (cpu.kernels.packed), since new codes come with new scales."""
    t.codes_layout.write(t.packed, t.codes_layout.to_codes(plain))
    t.packed.packed_at = None


class PackedCodes(_Packed, torch.Tensor):
    """A library's code tensor whose values live in the C kernels' packed bytes (`packed`)."""

    @staticmethod
    def __new__(cls, packed: torch.Tensor, layout: Layout):
        return torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=layout.dtype, device=packed.device,
                                                   requires_grad=False)

    def __init__(self, packed: torch.Tensor, layout: Layout):
        self.packed = packed
        self.codes_layout = layout

    def __deepcopy__(self, memo):
        new = type(self)(self.packed.clone(), self.codes_layout)
        memo[id(self)] = new
        return new


# bitsandbytes' parameter attributes a Params4bit carries (its quant state among them)
_PARAMS4BIT_FIELDS = ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage",
                      "bnb_quantized", "module")


@functools.cache
def _params4bit_class() -> type:
    """bitsandbytes' `Params4bit` whose codes live in the packed bytes: a `Linear4bit`'s weight must
    be a `Params4bit` (a parameter carrying its quant state), and its codes are that tensor's own
    memory, so the parameter itself is replaced."""
    from bitsandbytes.nn import Params4bit

    class PackedParams4bit(_Packed, Params4bit):
        @staticmethod
        def __new__(cls, packed: torch.Tensor, layout: Layout, like: torch.Tensor):
            return torch.Tensor._make_wrapper_subclass(cls, layout.shape, dtype=layout.dtype, device=packed.device,
                                                       requires_grad=False)

        def __init__(self, packed: torch.Tensor, layout: Layout, like: torch.Tensor):
            self.packed = packed
            self.codes_layout = layout
            for name in _PARAMS4BIT_FIELDS:
                setattr(self, name, getattr(like, name, None))

        def restored(self) -> torch.Tensor:
            """A plain `Params4bit` of the rebuilt codes, with this one's quant state."""
            return Params4bit(self.plain(), requires_grad=False, **{n: getattr(self, n) for n in _PARAMS4BIT_FIELDS})

        def __deepcopy__(self, memo):
            new = PackedParams4bit(self.packed.clone(), self.codes_layout, self)
            memo[id(self)] = new
            return new

    return PackedParams4bit


class PackedParameter(PackedCodes, torch.nn.Parameter):
    """A library's code tensor that is a module's parameter (compressed-tensors' `weight_packed`),
    its values in the packed bytes: a module's parameter must be an `nn.Parameter`."""

    def restored(self) -> torch.Tensor:
        """A plain parameter of the rebuilt codes."""
        return torch.nn.Parameter(self.plain(), requires_grad=False)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


# ---- where each library keeps its codes, and in what layout

def _quanto_layout(n: int, k: int, data) -> tuple[Callable, Callable] | None:
    """optimum-quanto's 4-bit `PackedTensor` `data` (logical shape S, uint8 codes packed two a byte
    along the first dimension by its `pack_weights`)."""
    try:
        from optimum.quanto.tensor.packed import pack_weights
    except ImportError:
        return None
    size = tuple(data.shape)
    return (lambda t: torch.ops.quanto.unpack(t, 4)[: size[0]].reshape(n, k),
            lambda codes: pack_weights(codes.reshape(size), 4))


def _int4pack_layout(n: int, k: int) -> tuple[Callable, Callable] | None:
    """torch's CPU int4pack layout [N, K / 2] (cpu.kernels.int4pack_codes, blocks of `block` columns:
    the low nibble of byte i is column i of the block, the high one column block / 2 + i)."""
    block = cpu_kernels.int4pack_block()
    if block is None or n % block:
        return None

    def from_codes(codes: torch.Tensor) -> torch.Tensor:
        c = codes.reshape(n // block, block, k).permute(0, 2, 1)  # [N / block, K, block]
        half = block // 2
        return (c[..., :half] | (c[..., half:] << 4)).contiguous().reshape(n, k // 2)

    return lambda t: cpu_kernels.int4pack_codes(t, n, k, block), from_codes


def _bnb_layout(n: int, k: int, shape: tuple[int, ...]) -> tuple[Callable, Callable]:
    """bitsandbytes' flat codes (`shape`, N * K / 2 bytes in all: cpu.kernels.nibble_codes) and their
    inverse."""
    def from_codes(codes: torch.Tensor) -> torch.Tensor:
        c = codes.reshape(-1, 2)
        return ((c[:, 0] << 4) | c[:, 1]).reshape(shape)

    return lambda t: cpu_kernels.nibble_codes(t, n, k), from_codes


@dataclass(frozen=True)
class Home:
    """Where a weight's codes live: `owner.attr`, a tensor whose layout `to_codes` reads and
    `from_codes` writes; `holder(packed, layout, source)` makes what takes its place (a
    `PackedCodes`, or for bitsandbytes a packed `Params4bit`)."""

    owner: object
    attr: str
    to_codes: Callable[[torch.Tensor], torch.Tensor]
    from_codes: Callable[[torch.Tensor], torch.Tensor]
    holder: Callable = lambda packed, layout, source: PackedCodes(packed, layout)


def _home(module: torch.nn.Module, weight: torch.Tensor) -> Home | None:
    """Where `weight`'s codes live, for the weights `pack_quantized` takes (see the module text),
    else None."""
    name = type(weight).__name__
    n, k = weight.shape
    same = (lambda t: t, lambda t: t)
    kind = cpu_kernels.weight_kind(weight)
    if name in ("Int8Tensor", "IntxUnpackedToInt8Tensor") and kind in cpu_kernels.Q4_KINDS:
        # torchao's grouped values, one a byte: the codes are the values plus the offset
        offset = 1 << (cpu_kernels.code_bits(kind) - 1)
        return Home(weight, "qdata", lambda t: (t.to(torch.int16) + offset).to(torch.uint8),
                    lambda codes: (codes.to(torch.int16) - offset).to(torch.int8))
    if name == "Int8Tensor":  # torchao
        return Home(weight, "qdata", *same)
    if name == "WeightQBytesTensor":  # optimum-quanto's int8
        return Home(weight, "_data", *same)
    if name == "Bnb4bitWeight":  # (the parameter is the codes: invariant.bnb4bit)
        return Home(module, "weight", *_bnb_layout(n, k, tuple(module.weight.shape)),
                    holder=lambda packed, layout, source: _params4bit_class()(packed, layout, source))
    if name == "CompressedTensorsWeight":  # (a parameter of its own: invariant.compressed_tensors)
        bits = weight.bits
        return Home(module, "weight_packed", lambda t: cpu_kernels.row_words_codes(t, bits),
                    lambda codes: cpu_kernels.row_words(codes, bits),
                    holder=lambda packed, layout, source: PackedParameter(packed, layout))
    got = None
    if name == "WeightQBitsTensor":
        got = _quanto_layout(n, k, weight._data)
    elif name in ("TinyGemmWeightQBitsTensor", "GptqWeight"):
        got = _int4pack_layout(n, k)
    if got is None:
        return None
    return Home(module, "qweight", *got) if name == "GptqWeight" else Home(weight._data, "_data", *got)


# a module -> the weight its linear reads as a plain linear's, None for a module that is no such
# linear (invariant.linears.linear_of: the views of quantized modules live in that layer, above this one)
WeightOf = Callable[[torch.nn.Module], "torch.Tensor | None"]


def _pack_one(module: torch.nn.Module, weight: torch.Tensor, checked: dict, weight_of: WeightOf) -> int:
    """Put the packed bytes in the place of `weight`'s codes; returns the bytes of codes let go
    (0: left as it is). `checked`: (class, shapes) -> whether its layout's round trip held."""
    kind = cpu_kernels.weight_kind(weight)
    home = None if kind == cpu_kernels.W_FLOAT else _home(module, weight)
    source = None if home is None else getattr(home.owner, home.attr, None)
    if (not isinstance(source, torch.Tensor) or isinstance(source, _Packed) or not source.is_contiguous()
            or source.data_ptr() != cpu_kernels.values_of(weight).data_ptr()):
        return 0  # (packed already, or codes the readers did not take from here)
    n, k = weight.shape
    layout = Layout(kind, n, k, cpu_kernels.packed_dtype(weight), tuple(source.shape), source.dtype, home.to_codes,
                    home.from_codes)
    packed = cpu_kernels.packed(weight)
    if packed.is_inference():  # (packed under inference mode: no version counter, no in-place writes after)
        with torch.inference_mode(False):
            packed = packed.clone()
    packed.packed_at = packed._version  # (cpu.kernels.packed packs again where this changed)
    key = (type(weight), type(source), tuple(weight.shape), layout.shape, weight.dtype)
    if key not in checked:
        with torch.no_grad():
            checked[key] = torch.equal(layout.from_codes(layout.read(packed)), source)
        if not checked[key]:
            log.debug("pack_quantized: %s codes %s do not round-trip; both copies kept", type(weight).__name__,
                      layout.shape)
    if not checked[key]:
        return 0
    setattr(home.owner, home.attr, home.holder(packed, layout, source))
    cpu_kernels.forget(weight)
    if not module.__dict__.get("_packed_codes_hooks"):
        module.register_state_dict_pre_hook(functools.partial(_plain_state_dict, weight_of=weight_of))
        module._register_state_dict_hook(_packed_again)
        module.__dict__["_packed_codes_hooks"] = True
    return source.numel() * source.element_size()


def _plain(codes: _Packed) -> torch.Tensor:
    """What the library held before: the rebuilt tensor (for bitsandbytes, a `Params4bit` of it)."""
    return codes.restored() if hasattr(codes, "restored") else codes.plain()


# id(module) -> [(object, attribute, its packed codes)] while the module's state_dict is being made
_SAVING: dict[int, list] = {}


def _plain_state_dict(module: torch.nn.Module, prefix: str, keep_vars: bool, weight_of: WeightOf) -> None:
    """Before `module.state_dict()`: the library's plain code tensor in the place of the packed one
    (libraries serialize their inner tensors themselves, and safetensors reads raw memory), so the
    state dict holds ordinary tensors; `_packed_again` puts the packed one back after."""
    weight = weight_of(module)
    home = None if weight is None else _home(module, weight)
    codes = None if home is None else getattr(home.owner, home.attr, None)
    if isinstance(codes, _Packed):
        _SAVING.setdefault(id(module), []).append((home.owner, home.attr, codes))
        setattr(home.owner, home.attr, _plain(codes))


def _packed_again(module: torch.nn.Module, state_dict, prefix: str, local_metadata) -> None:
    for owner, attr, codes in _SAVING.pop(id(module), []):
        setattr(owner, attr, codes)


def pack_quantized(model: torch.nn.Module, weight_of: WeightOf) -> int:
    """Put a PackedCodes in the place of the code tensor of every quantized linear weight of `model`
    (`weight_of` each module: invariant.linears.linear_of) that the C kernels read and whose library
    layout is known (see the module text): from then on the packed bytes are the codes' only copy.
    Returns how many it packed; codes packed already stay."""
    t0 = time.perf_counter()
    done, freed, checked = 0, 0, {}
    for module in list(model.modules()):
        weight = weight_of(module)
        got = 0 if weight is None else _pack_one(module, weight, checked, weight_of)
        del weight
        if got:
            # a module seen as a linear (invariant.module_weight) gets its view of the packed codes
            # now: its old view held the library's, which go before the next weight is packed
            weight_of(module)
        done += got > 0
        freed += got
    if done:
        log.debug("pack_quantized: %d weights, %.1f MB of codes let go in %.2f s", done, freed / 1e6,
                  time.perf_counter() - t0)
    return done


def unpack_quantized(model: torch.nn.Module, weight_of: WeightOf) -> int:
    """The libraries' plain code tensors again in the place of every PackedCodes of `model`'s linears
    (`weight_of`, as for `pack_quantized`); returns how many it replaced."""
    done = 0
    for module in list(model.modules()):
        weight = weight_of(module)
        home = None if weight is None else _home(module, weight)
        codes = None if home is None else getattr(home.owner, home.attr, None)
        if isinstance(codes, _Packed):
            setattr(home.owner, home.attr, _plain(codes))
            cpu_kernels.forget(weight)
            weight_of(module)  # (a new view, of the plain codes)
            done += 1
    return done
