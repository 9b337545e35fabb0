"""steps.regional without a compiler: which modules are the decoder layers, and that a step's
switch of their `forward` always leaves the model as it was. (Compiled runs: tests/test_compile.py.)"""

from __future__ import annotations

import pytest
import torch

from hf_plookup.engine.kv_cache import PagedKVCache, layer_specs
from hf_plookup.steps.regional import RegionalLayers, decoder_layers
from tests.conftest import tiny_model


def _recording(calls):
    """A stand-in for torch.compile whose function records each call (layer, pages) and hands the
    hidden states back unchanged: what is checked is the routing, not the layer's arithmetic."""

    def compile_fn(fn):
        def run(layer, k_cache, v_cache, args, kwargs):
            calls.append((layer, k_cache, v_cache))
            return args[0]

        return run

    return compile_fn


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_layers_and_their_pages(arch):
    model = tiny_model(arch)
    found = decoder_layers(model)
    assert [layer for layer, _ in found] == list(model.model.layers)
    assert [i for _, i in found] == list(range(model.config.num_hidden_layers))


def test_no_layer_class_means_no_regions():
    model = tiny_model("llama")
    model._no_split_modules = None  # an instance attribute: the class keeps its list
    assert decoder_layers(model) == []
    with pytest.raises(ValueError, match="names no decoder layer class"):
        RegionalLayers(model, None, lambda fn: fn)


def test_switch_routes_every_layer_and_always_restores():
    model = tiny_model("llama")
    cache = PagedKVCache(layer_specs(model), 4, 16)
    calls = []
    regions = RegionalLayers(model, cache, _recording(calls))
    layers = [layer for layer, _ in regions.layers]
    hooked = layers[1].forward  # an instance forward already there (as accelerate's hooks leave)
    layers[1].forward = hooked
    hidden = torch.randn(1, 3, model.config.hidden_size)
    with pytest.raises(RuntimeError, match="boom"), regions.active():
        assert all(layer(hidden, position_ids=None) is hidden for layer in layers)
        raise RuntimeError("boom")
    assert [c[0] for c in calls] == layers  # each layer went through the compiled function ...
    assert all(k is cache.layer(i)[0] and v is cache.layer(i)[1] for i, (_, k, v) in enumerate(calls))  # its pages
    assert "forward" not in layers[0].__dict__ and layers[1].forward is hooked
