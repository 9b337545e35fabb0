"""bitsandbytes' 8-bit linears (LLM.int8) under `wrap` (invariant.bnb8bit): each row as bitsandbytes
computes it alone, whatever the call's other rows, where bitsandbytes' own call takes outlier columns
over all its rows. The models are quantized at load by transformers' own `BitsAndBytesConfig`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant import bnb8bit
from hf_plookup.invariant.linears import linear_module, linear_weight, row_strategy
from tests.conftest import assert_c_layers_are_the_modules, left_pad, repeat_prompts, tiny_model, wrap_copy

pytest.importorskip("bitsandbytes")


def _model(tmp_path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                                device_map="cpu", dtype=dtype).eval()


def _inputs(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows with outliers (magnitude 6 and more) in some columns of some rows, as real activations."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    x[1, :2] = 9.0
    x[3, 5] = -7.0
    x[4, 5] = 6.5
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_as_alone(tmp_path, dtype):
    """The held module's view computes each row bitwise as alone, at any row count (a prompt chunk's
    too); a row without outliers is bitwise bitsandbytes' own 1-row call, one with outliers its value
    up to the order of the outlier sums."""
    model = _model(tmp_path, dtype)
    assert bnb8bit.hold(model) == 7 * 2 and bnb8bit.held(model)
    module = model.model.layers[0].mlp.up_proj
    view = linear_weight(module)
    assert linear_module(module) and type(view).__name__ == "Bnb8bitWeight" and view.dtype == dtype
    x = _inputs(6, view.shape[1], dtype)
    with torch.no_grad():
        alone = torch.cat([F.linear(x[i : i + 1], view, module.bias) for i in range(6)])
        for m in range(2, 7):
            assert torch.equal(F.linear(x[:m], view, module.bias), alone[:m]), m
        long = x[torch.arange(70) % 6]
        assert torch.equal(F.linear(long, view, module.bias), alone[torch.arange(len(long)) % 6])
        own = torch.cat([module(x[i : i + 1]) for i in range(6)])
    plain = [0, 2, 5]  # (rows without an outlier)
    assert torch.equal(alone[plain], own[plain])
    # (bitsandbytes adds the outlier columns by one addmm, rounded once; the view column by column)
    tol = dict(rtol=2**-7, atol=2**-4) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, own, **tol)
    assert row_strategy(view, module.bias) != "rows"  # (its rows alone already: one call for a step's rows)
    bnb8bit.release(model)
    assert not bnb8bit.held(model) and not linear_module(module)


def test_greedy_with_drafts_is_lossless(tmp_path):
    """Wrapped, a batch with drafts gives every prompt hf_plookup's own greedy of it alone (where
    bitsandbytes' call of the step's rows would change them), with the probe's note, its decode steps
    in the C decoder layers; `unwrap` releases the modules."""
    import hf_plookup
    from hf_plookup.api import _state

    model = _model(tmp_path)
    rows = repeat_prompts(3)
    wrapped = wrap_copy(model, invariant=True)  # (its default with the C kernels; without them, fp32's is off)
    ids, mask = left_pad(rows)
    got = wrapped.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=4)
    assert wrapped.last_stats.exactness_note
    c_layers = _state(wrapped).engine.c_layers
    assert (c_layers is not None and c_layers.on) == cpu_kernels.available()
    for i, row in enumerate(rows):
        alone = wrapped.generate(row[None], max_new_tokens=24, do_sample=False)
        assert torch.equal(got[i, ids.shape[1]:], alone[0, len(row):]), i
    assert bnb8bit.held(model)
    hf_plookup.unwrap(wrapped)
    assert not bnb8bit.held(model)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_c_layers_are_the_modules(tmp_path, dtype):
    """The C decoder layers' steps are bitwise the engine's steps through the held modules: the same
    logits at every step."""
    model = _model(tmp_path, dtype)
    assert_c_layers_are_the_modules(model)
