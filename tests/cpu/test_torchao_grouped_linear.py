"""The C linears over torchao's weight-only tensors that dequantize before `F.linear`
(`IntxWeightOnlyConfig`'s `IntxUnpackedToInt8Tensor`, int4 or int8 values one a byte, and
`Int8WeightOnlyConfig` in groups): read as the "sub_mul" form, int4 values as 4-bit codes (W_Q4)
and int8 ones as 8-bit codes (W_Q8G), each weight the value torchao's `dequantize` gives. A linear
over them is bitwise the float linear of those values, each row as alone, at every SIMD level. The
weights are made here by torchao's own `quantize_`."""

from __future__ import annotations

import pytest
import torch

from hf_plookup.cpu import kernels as cpu_kernels
from tests.conftest import assert_float_linear, at_every_simd_level, rows_alone_and_float_linear, torchao_linear

tq = pytest.importorskip("torchao.quantization")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = (1, 2, 5, 9, 10, 13, 40)
# name -> (config, weight kind, bits)
CONFIGS = {
    "intx-int4-group": (lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(32)),
                        cpu_kernels.q4_kind(128, 32), 4),
    "intx-int4-group-asym": (lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(32),
                                                             mapping_type=tq.MappingType.ASYMMETRIC),
                             cpu_kernels.q4_kind(128, 32), 4),
    "intx-int8-row": (lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=tq.PerAxis(0)),
                      cpu_kernels.W_Q8G, 8),
    "int8-group": (lambda: tq.Int8WeightOnlyConfig(granularity=tq.PerGroup(32)), cpu_kernels.W_Q8G, 8),
}


def _quantized(name: str, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Linear:
    return torchao_linear(CONFIGS[name][0](), n, k, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_linear_is_the_float_linear_of_torchaos_values(name, dtype):
    linear = _quantized(name, 40, 128, dtype, seed=1)
    w, kind, bits = linear.weight, *CONFIGS[name][1:]
    parts = cpu_kernels.q4_parts(w)
    assert cpu_kernels.weight_kind(w) == kind and (parts.form, parts.bits, parts.offset) == ("sub_mul", bits, 1 << (bits - 1))
    assert torch.equal(parts.codes().to(torch.int16) - (1 << (bits - 1)), w.qdata.to(torch.int16))
    values = w.dequantize()
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows_alone_and_float_linear(w, linear.bias, values.contiguous(), x, ROWS)
    bits_of = lambda t: t.view(torch.int16 if t.dtype != torch.float32 else torch.int32)  # noqa: E731
    outs = at_every_simd_level(lambda: [bits_of(cpu_kernels.linear(x[:m], w, linear.bias)) for m in ROWS])
    for level, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0])), f"level {level} differs from the portable C"


def test_bfloat16_weights_keep_float32_scales():
    """A grouped `Int8Tensor` of a bf16 weight keeps float32 scales; its value is the product in
    float32 rounded once to bf16 (torchao's `dequantize_affine`), which rounding the scale to bf16
    first would change: the packed scales are the float32 ones (moved here off bf16's grid, where
    torchao's own happen to lie for these weights)."""
    linear = _quantized("int8-group", 16, 64, torch.bfloat16, seed=3)
    w = linear.weight
    with torch.no_grad():
        w.scale.mul_(1 + 2**-12)
    assert w.scale.dtype == torch.float32 and not torch.equal(w.scale.to(torch.bfloat16).float(), w.scale)
    assert torch.equal(cpu_kernels.q4_parts(w).scales, w.scale.reshape(16, 2))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(cpu_kernels.linear(x, w, None), cpu_kernels.linear(x, w.dequantize().contiguous(), None))


def test_per_token_activations_are_quantized_first():
    """`Int8DynamicActivationIntxWeightConfig`: torchao quantizes and dequantizes a linear's inputs
    token by token (asymmetric int8) before its int4 weight's `F.linear`. The C linear does the same
    with torchao's own function (`Q4Parts.inputs`), so it is the float linear of those inputs and the
    weight's values, each row as alone; the C decoder layers, which would not, refuse the model."""
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        _apply_int8_act_asym_per_token_quant_dequant as quant_dequant)

    from hf_plookup.steps.c_layers import llama_form
    from tests.conftest import tiny_model

    model = torch.nn.Sequential(torch.nn.Linear(96, 40))
    tq.quantize_(model, tq.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                                 weight_granularity=tq.PerGroup(32)))
    w, b = model[0].weight, model[0].bias
    parts = cpu_kernels.q4_parts(w)
    assert cpu_kernels.weight_kind(w) == cpu_kernels.q4_kind(96, 32) and parts.inputs is not None
    assert not cpu_kernels.takes_inputs_as_they_are(w)
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(5))
    got = cpu_kernels.linear(x, w, b)
    assert_float_linear(got, w, w.dequantize(), quant_dequant(x), b)
    assert torch.equal(got, torch.cat([cpu_kernels.linear(x[i : i + 1], w, b) for i in range(13)]))
    llama = tiny_model("llama")
    tq.quantize_(llama, tq.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=tq.PerGroup(32)),
                 filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    assert "quantizes its inputs first" in llama_form(llama)
    from hf_plookup.invariant.linears import row_strategy
    from tests.conftest import left_pad, repeat_prompts, wrap_copy

    ids, mask = left_pad(repeat_prompts(2))
    want = llama.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    wrapped = wrap_copy(llama)
    got = wrapped.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want) and row_strategy(llama.model.layers[0].mlp.up_proj.weight, None) == "cpu"


def test_per_row_int8_is_w_q8():
    """A per-row `Int8Tensor` is W_Q8 (the scale after the sum, as torchao's own int8 path), not read
    as codes."""
    row = torch.nn.Sequential(torch.nn.Linear(64, 16))
    tq.quantize_(row, tq.Int8WeightOnlyConfig())
    assert cpu_kernels.weight_kind(row[0].weight) == cpu_kernels.W_Q8 and cpu_kernels.q4_parts(row[0].weight) is None


def test_int8_groups_give_hfs_greedy():
    """A tiny Llama in torchao's grouped int8 (its linears W_Q8G), wrapped: the decoder layers run
    in C, and greedy with drafts in fp32 is HF's greedy of the same quantized model."""
    from hf_plookup.api import _state
    from tests.conftest import left_pad, repeat_prompts, tiny_model, wrap_copy

    model = tiny_model("llama")
    tq.quantize_(model, tq.Int8WeightOnlyConfig(granularity=tq.PerGroup(32)),
                 filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    ids, mask = left_pad(repeat_prompts(2))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    wrapped = wrap_copy(model)
    got = wrapped.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want) and _state(wrapped).engine.c_layers.on
    assert cpu_kernels.weight_kind(model.model.layers[0].mlp.up_proj.weight) == cpu_kernels.W_Q8G
