"""Regional compilation: one compiled decoder layer serves every layer of the model.

Compiling the whole forward traces and lowers every decoder layer again for each step bucket,
although the layers are one piece of code on different weights (30 of them in SmolLM2). Here
only the decoder layers are compiled, through one function that takes the layer and its pages
as inputs: the compiler traces it once per step width and batch bucket (and per kind of layer, where a model mixes
sliding-window and global layers), and every other layer of that kind runs the same compiled
code, as the guards hold for a layer of the same class and shapes. The embedding, the rotary
tables, the final norm and the LM head run eagerly around them (once per step; on CUDA a
captured graph holds them with the rest).

The layers are found through HF's own `_no_split_modules` (the blocks accelerate never splits:
the decoder layer classes), each with exactly one attention module carrying `layer_idx`, whose
pages it gets. While a compiled step runs, each such layer's `forward` is an instance attribute
calling the compiled function (the way accelerate's hooks replace a forward); it is removed
afterwards, so the model is unchanged outside engine steps. Inside the compiled layer the pages
reach the attention function through `metadata.set_compiled_layer_kv`, not through the layer's
index, so no guard depends on which layer runs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch

from ..attention.metadata import set_compiled_layer_kv

if TYPE_CHECKING:
    from ..engine.kv_cache import PagedKVCache


def decoder_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(layer, index of its pages) for every decoder layer, in model order; [] when the model
    names no block class or a block holds more than one attention module. Blocks with none
    (BERT's embeddings) are not layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = []
    for module in model.modules():
        if type(module).__name__ not in names:
            continue
        idx = [m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and m is not module]
        if not idx:
            continue
        if len(idx) > 1:
            return []
        found.append((module, idx[0]))
    return found


def _layer_step(layer: torch.nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor, args: tuple, kwargs: dict):
    """What is compiled: the layer's own forward, its pages made visible to its attention."""
    set_compiled_layer_kv(k_cache, v_cache)
    return type(layer).forward(layer, *args, **kwargs)


class RegionalLayers:
    """The model's decoder layers run through one `compile(_layer_step)`, inside `active()`."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, compile_fn):
        self.layers = decoder_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} names no decoder layer class with one attention module")
        self.cache = cache
        self.step = compile_fn(_layer_step)

    def _call(self, layer: torch.nn.Module, idx: int, *args, **kwargs):
        k_cache, v_cache = self.cache.layer(idx)
        return self.step(layer, k_cache, v_cache, args, kwargs)

    @contextlib.contextmanager
    def active(self):
        saved = [layer.__dict__.get("forward") for layer, _ in self.layers]
        for layer, idx in self.layers:
            layer.forward = functools.partial(self._call, layer, idx)
        try:
            yield
        finally:
            for (layer, _), old in zip(self.layers, saved):
                if old is None:
                    del layer.forward
                else:
                    layer.forward = old
