"""One copy of each linear weight: a CPU parameter held only in the C kernels' packed layout.

The C linears (`cpu.kernels`) read a weight packed in panels of 8 output columns, a layout that is
no strided view of the `[N, K]` weight (docs/results.md, "Packed linears: weights packed by output
column", says why the kernels want it; "One copy of the weights" says why no strided layout serves
both). Keeping the packed copy beside the model's own would hold every linear weight twice, so
`pack_linears(model)` packs each weight into one mapping on 2 MB pages and puts a `PackedWeight` in
its parameter's place, releasing the original: what the kernels read is then the weight itself.

A `PackedWeight` is a tensor of the weight's shape, dtype and device whose values live packed:

- every torch op on it (HF's `nn.Linear.forward` outside the engine, `state_dict`, `.to()`,
  printing, `torch.equal`, ...) sees the true weight, unpacked on demand for that op;
- an in-place op on it (`copy_` from `load_state_dict`, `+=` from merging a PEFT adapter, `.data`
  writes of a whole weight) is done on the unpacked values and packed back into the same memory,
  so the kernels see it at once;
- `aten.embedding` (an LM head tied to the input embedding) gathers the rows from the panels;
- `state_dict()` of a module that holds one gives the plain unpacked tensor (a hook registered
  by `pack_linears`), so `save_pretrained` writes ordinary tensors; deepcopy and pickle keep it
  packed.

Not covered: writes through a view of a packed weight (`weight[0] = ...`, `weight.data[:, :8].zero_()`)
change an unpacked copy, not the weight; `unpack_linears(model)` (what `hf_plookup.unwrap` calls)
gives the model plain parameters back first.

Example (float32): a 20 x 16 weight packs to 3 panels [3, 16, 8] (zeros past row 20); the parameter
then reads as before::

    >>> lin = torch.nn.Linear(16, 20, bias=False); w = lin.weight.detach().clone()
    >>> pack_linears(lin)
    1
    >>> type(lin.weight).__name__, torch.equal(lin.weight, w), lin.weight.packed.shape
    ('PackedWeight', True, torch.Size([3, 16, 8]))
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch.utils._pytree import tree_map

from . import kernels as cpu_kernels
from .huge_pages import held_elsewhere

log = logging.getLogger("hf_plookup")
aten = torch.ops.aten

__all__ = ["PackedWeight", "dense", "on_plain", "pack_linears", "packing_bytes", "unpack_linears"]

_local = threading.local()  # .scratch: the thread's reused buffer for `dense`


class PackedWeight(torch.Tensor):
    """A linear weight `[N, K]` whose values are `packed` (cpu.kernels.pack's layout); see the module
    text for what each kind of op does with it."""

    packed: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # ops go straight to __torch_dispatch__

    @staticmethod
    def __new__(cls, packed: torch.Tensor, shape):
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=packed.dtype, device=packed.device,
                                                   requires_grad=False)

    def __init__(self, packed: torch.Tensor, shape):
        self.packed = packed

    def unpacked(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as a plain contiguous tensor (written into `out`'s memory where given)."""
        n, k = self.shape
        return cpu_kernels.unpack(self.packed, n, k, out)

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor):
        """`weight.data = t` (nn.Module's `.to()` / `.float()`, PEFT's safe merge): a plain `t` makes this
        object a plain tensor (a parameter if it was one) holding `t`, in place, so the modules that
        hold it see the change; it is packed again on its next C call (cpu.kernels.packed)."""
        if isinstance(value, PackedWeight):
            torch._C.TensorBase.data.__set__(self, value)
            return
        plain = value.detach()
        if getattr(self, "_is_param", False):
            plain = torch.nn.Parameter(plain, requires_grad=False)
        torch.utils.swap_tensors(self, plain)

    def data_ptr(self) -> int:
        """The packed values' address: what the C kernels read, and what changes when they move."""
        return self.packed.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The packed values' storage (tied weights share it, as they share this tensor)."""
        return self.packed.untyped_storage()

    def __repr__(self) -> str:
        return f"PackedWeight({self.unpacked()!r})"

    def __reduce_ex__(self, protocol):
        return _rebuild, (self.packed, tuple(self.shape), bool(getattr(self, "_is_param", False)))

    def __deepcopy__(self, memo):
        new = _rebuild(self.packed.clone(), tuple(self.shape), bool(getattr(self, "_is_param", False)))
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):  # (nn.Parameter, `.data`): the same weight
            return PackedWeight(args[0].packed, args[0].shape)
        if func is aten.embedding.default and isinstance(args[0], PackedWeight):
            return cpu_kernels.packed_rows(args[0].packed, args[0].shape[1], args[1])
        return on_plain(func, args, kwargs, PackedWeight, PackedWeight.unpacked,
                        lambda t, values: cpu_kernels.pack(values, out=t.packed))


def on_plain(func, args: tuple, kwargs: dict, kind: type, plain_of, write_back):
    """`func(*args, **kwargs)` for a `__torch_dispatch__` of a tensor subclass `kind` that holds its
    values in another form: each argument of that kind given as `plain_of(t)` (a plain tensor, made
    once per argument), and each one the op wrote to (self of an in-place op, `out=`) given back by
    `write_back(t, its new plain values)`. An in-place op returns its own `self`."""
    plain = {}  # id of an argument of `kind` -> its plain values

    def unpack(t):
        if isinstance(t, kind):
            if id(t) not in plain:
                # a normal tensor even under inference mode: a view op's result becomes a view of
                # the subclass tensor, and autograd gives it that tensor's version counter
                with torch.inference_mode(False):
                    plain[id(t)] = plain_of(t)
            return plain[id(t)]
        return t

    out = func(*tree_map(unpack, args), **tree_map(unpack, kwargs))
    named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    written = [named.get(a.name) for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    written = [t for t in written if isinstance(t, kind)]
    for t in written:
        write_back(t, plain[id(t)])
    if written and isinstance(out, torch.Tensor) and any(out is plain[id(t)] for t in written):
        return next(t for t in written if out is plain[id(t)])
    return out


def _rebuild(packed: torch.Tensor, shape, is_param: bool) -> PackedWeight:
    t = PackedWeight(packed, shape)
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=False)
    return t


def dense(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as a plain tensor for one call (a prompt chunk's GEMM): a PackedWeight is unpacked into
    a buffer of the calling thread, reused by its next call (so a prefill of many layers holds one
    scratch the size of the largest weight, not a second copy of them all); a plain weight as it is.
    The result is valid until this thread's next `dense` call."""
    if not isinstance(weight, PackedWeight):
        return weight
    n, k = weight.shape
    need = n * k
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.dtype != weight.dtype or buf.numel() < need:
        _local.scratch = buf = torch.empty(need, dtype=weight.dtype)
    return weight.unpacked(buf[:need].view(n, k))


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    """`module.state_dict()` gives plain tensors: save_pretrained and safetensors know no PackedWeight."""
    for name, p in module._parameters.items():
        key = prefix + name
        if isinstance(p, PackedWeight) and isinstance(state_dict.get(key), PackedWeight):
            state_dict[key] = p.unpacked()


def _owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id of each parameter -> every (module, name) that holds it (a tied head and embedding share one)."""
    owners: dict[int, list] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    return owners


def _to_pack(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights `pack_linears` packs: of plain `nn.Linear` layers, plain parameters the C kernels
    take, each once; not those another library holds (cpu.huge_pages.held_elsewhere)."""
    weights, seen = [], held_elsewhere(model)
    for m in model.modules():
        w = m._parameters.get("weight") if type(m) is torch.nn.Linear else None
        if w is not None and type(w) is torch.nn.Parameter and cpu_kernels.supported(w) and id(w) not in seen:
            seen.add(id(w))
            weights.append(w)
    return weights


def packing_bytes(model: torch.nn.Module) -> int:
    """Memory `pack_linears` holds beyond the weights for a while: the largest weight's packed copy,
    made before its original is let go."""
    return max((cpu_kernels.packed_numel(w) * w.element_size() for w in _to_pack(model)), default=0)


def pack_linears(model: torch.nn.Module) -> int:
    """Put a PackedWeight in the place of every weight of `model`'s plain `nn.Linear` layers that the C
    kernels take (cpu.kernels.supported: float32, bfloat16 or float16 CPU), packed into one mapping on 2 MB pages
    where Linux offers them (cpu.huge_pages: the kernels stream them faster from there). Each weight
    is packed and its parameter replaced before the next is read, so the original of each is released
    as its packed copy is made: the process never holds a second copy of the weights. Returns how
    many weights it packed; weights packed already stay as they are."""
    from .huge_pages import aligned, huge_buffer

    t0 = time.perf_counter()
    owners = _owners(model)
    weights = _to_pack(model)
    packed = len(weights)
    if not weights:
        return 0
    sizes = [aligned(cpu_kernels.packed_numel(w) * w.element_size()) for w in weights]
    buf = huge_buffer(sum(sizes))  # None: no 2 MB pages here; each weight then gets memory of its own
    off, nbytes = 0, 0
    with torch.no_grad():
        while weights:
            w, size = weights.pop(0), sizes.pop(0)
            shape = cpu_kernels.packed_shape(w)
            count = cpu_kernels.packed_numel(w)
            out = (torch.frombuffer(buf, dtype=w.dtype, count=count, offset=off) if buf is not None
                   else torch.empty(count, dtype=w.dtype)).view(shape)
            cpu_kernels.pack(w, out=out)
            param = torch.nn.Parameter(PackedWeight(out, w.shape), requires_grad=False)
            for m, name in owners[id(w)]:
                m._parameters[name] = param
                if _state_dict_hook not in m._state_dict_hooks.values():
                    m._register_state_dict_hook(_state_dict_hook)
            off += size
            nbytes += count * w.element_size()
            del w  # (the last reference here: its memory goes back unless the caller holds it)
    log.debug("pack_linears: %d weights, %.1f MB packed in %.2f s", packed, nbytes / 1e6, time.perf_counter() - t0)
    return packed


def unpack_linears(model: torch.nn.Module) -> int:
    """Plain parameters again in the place of every PackedWeight of `model` (their values unpacked);
    returns how many it replaced."""
    owners = _owners(model)
    done = 0
    with torch.no_grad():
        for m in list(model.modules()):
            for name, p in list(m._parameters.items()):
                if isinstance(p, PackedWeight):
                    plain = torch.nn.Parameter(p.unpacked(), requires_grad=False)
                    for owner, key in owners[id(p)]:
                        owner._parameters[key] = plain
                    owners[id(p)] = []
                    done += 1
    return done
