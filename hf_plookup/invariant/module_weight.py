"""A quantized linear module seen as the [N, K] weight of a plain linear: `ModuleWeight`.

Some quantizers' linears are modules of their own that keep packed codes and scales, not an
`nn.Linear` with a weight tensor (bitsandbytes' `Linear4bit`: invariant.bnb4bit; gptqmodel's GPTQ
linears: invariant.gptq). Invariant mode and the C layers route linears by their weight
(`invariant.linears.linear_weight`). For such a module that weight is a `ModuleWeight`: a tensor of
the logical shape and the dtype the module computes in, holding no values, whose one op,
`F.linear`, runs the module's own arithmetic (`linear`), and whose packed codes
`cpu.kernels.q4_parts` reads (`q4_fields`). A view holds a plain alias of the module's code tensor
(same storage and version counter: `data_ptr` and `_version` say when the codes move or change),
never the module itself, so a cached view does not keep a dropped model alive.

Example: `Bnb4bitWeight(module)` of a `Linear4bit(576, 1536)` in float32 is a [1536, 576] float32
tensor; `F.linear(x, view)` equals `module(x)`; `view.data_ptr()` is its codes' address.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F


class ModuleWeight(torch.Tensor):
    """The base of a module's weight seen as a linear's. A subclass sets `codes_of(module)` (the
    tensor of its packed codes, aliased here), `dtype_of(module)` (and `shape_of` where the module has
    no `out_features` and `in_features`) and `linear(x, bias)`, and keeps what `linear` needs in
    `__init__` (never the module)."""

    @staticmethod
    def __new__(cls, module: torch.nn.Module):
        return torch.Tensor._make_wrapper_subclass(cls, cls.shape_of(module), dtype=cls.dtype_of(module),
                                                   device=cls.codes_of(module).device, requires_grad=False)

    def __init__(self, module: torch.nn.Module):
        with torch._C.DisableTorchFunctionSubclass():  # (a plain alias: the code tensor may hold its module)
            self.param = torch.Tensor.detach(self.codes_of(module))

    @staticmethod
    def codes_of(module: torch.nn.Module) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def dtype_of(module: torch.nn.Module) -> torch.dtype:
        raise NotImplementedError

    @staticmethod
    def shape_of(module: torch.nn.Module) -> tuple[int, int]:
        """The logical [N, K] of the linear."""
        return module.out_features, module.in_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return args[1].linear(args[0], bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def data_ptr(self) -> int:
        """The packed codes' address (what changes when they move)."""
        return self.param.data_ptr()

    @property
    def _version(self) -> int:
        """The packed codes' version counter (what an in-place change bumps)."""
        return self.param._version

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a quantized module's weight seen as a linear's takes F.linear only, not {func}")


class Views:
    """Each module's view, made once and kept while the module lives and its code tensor and `key`
    (what else the view depends on) stay the same; nothing here holds the module or its codes."""

    def __init__(self, make):
        self.make = make  # module -> its ModuleWeight
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, module: torch.nn.Module, codes: torch.Tensor, key: tuple) -> ModuleWeight:
        entry = self._views.get(module)
        if entry is not None and entry[0]() is codes and entry[1] == key:
            return entry[2]
        view = self.make(module)
        self._views[module] = (weakref.ref(codes), key, view)
        return view
