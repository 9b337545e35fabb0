"""The C linears over torchao's `Int8DynamicActivationInt8WeightConfig` (its default: each token's
inputs quantized to int8 with a scale of their own, symmetric; int8 weights, one scale a column),
weight kind W_Q8T: `quantize_rows_i8` quantizes each row as torchao does, the W_Q8 tiles multiply
the codes (their float32 sums of integers are torchao's int32 sums), and torchao's elementwise steps
scale them in its order. So a C linear is bitwise torchao's `F.linear`, each row as alone, at every
SIMD level, and the C decoder layers run such a model. The weights are made here by torchao's own
`quantize_`."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hf_plookup.cpu import kernels as cpu_kernels
from tests.conftest import assert_c_layers_are_the_modules, at_every_simd_level, torchao_linear

tq = pytest.importorskip("torchao.quantization")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = (1, 2, 5, 9, 10, 13)


def _quantized(n: int, k: int, dtype: torch.dtype, seed: int = 0, **config) -> torch.nn.Linear:
    return torchao_linear(tq.Int8DynamicActivationInt8WeightConfig(**config), n, k, dtype, seed)


def _quantize_rows(x: torch.Tensor, qmin: int = -128, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K] float32, scales [M] float32) of `quantize_rows_i8`."""
    m, k = x.shape
    q, s = torch.empty(m, k), torch.empty(m)
    cpu_kernels._LIB.quantize_rows_i8(x.data_ptr(), m, k, cpu_kernels.dtype_code(x.dtype), qmin, qmax,
                                      q.data_ptr(), s.data_ptr())
    return q, s


def test_quantize_rows_literal():
    """A row whose largest magnitude is 127.5 / 8: scale 1/8, so codes x * 8 rounded half to even
    (127.5 to 128, clamped to 127; -8.5 to -8; 0.5 to 0; 1.5 to 2); an all-zero row gets fp32's epsilon."""
    x = torch.tensor([[15.9375, -1.0625, 0.0625, 0.1875], [0.0, 0.0, 0.0, 0.0]])
    q, s = _quantize_rows(x)
    assert q.tolist() == [[127.0, -8.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]]
    assert s.tolist() == [0.125, 2.0**-23]
    q, s = _quantize_rows(x[:1], -64, 63)  # torchao's reduced range: half the range 63.5
    assert s.tolist() == [ctypes.c_float(15.9375 / 63.5).value] and q[0, 0].item() == 63.0


@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_rows_is_torchaos(dtype, reduce_range):
    """Codes and scales equal torchao's own per-token quantization (`Int8Tensor.from_hp`, PerRow,
    symmetric) on rows of many magnitudes, ties, zeros and one-element rows."""
    from torchao.quantization.quantize_.workflows import Int8Tensor

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 96, generator=g) * torch.logspace(-6, 4, 24)[:, None]
    x[3] = 0.0
    x[4] = torch.arange(96) * 0.5 - 24  # halves: ties where the scale allows
    x[5, 1:] = 0.0
    x = x.to(dtype)
    want = Int8Tensor.from_hp(x, tq.PerRow(), mapping_type=tq.MappingType.SYMMETRIC, reduce_range=reduce_range)
    q, s = _quantize_rows(x, *((-64, 63) if reduce_range else (-128, 127)))
    assert torch.equal(q, want.qdata.float()) and torch.equal(s, want.scale.reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_is_torchaos(dtype):
    """The C linear is bitwise torchao's `F.linear` of the weight, at every row count, each row as
    alone, at every SIMD level; its weight is W_Q8T, laid out for float32 calls."""
    linear = _quantized(40, 576, dtype, seed=1)
    w, b = linear.weight, linear.bias
    parts = cpu_kernels.int8_parts(w)
    assert cpu_kernels.weight_kind(w) == cpu_kernels.W_Q8T and parts.tokens == (-128, 127)
    assert torch.equal(parts.scales, w.scale.reshape(-1)) and cpu_kernels.packed_dtype(w) == torch.float32
    x = (torch.randn(13, 576, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    alone = torch.cat([cpu_kernels.linear(x[i : i + 1], w, b) for i in range(13)])
    bits_of = lambda t: t.view(torch.int16 if t.dtype != torch.float32 else torch.int32)  # noqa: E731
    assert cpu_kernels.linear(x[:0], w, b).shape == (0, 40)  # (torchao's own fails on no rows)
    for m in ROWS:
        want = torch.nn.functional.linear(x[:m], w, b)
        assert torch.equal(bits_of(cpu_kernels.linear(x[:m], w, b)), bits_of(want)), m
        assert torch.equal(cpu_kernels.linear(x[:m], w, b), alone[:m]), m
    outs = at_every_simd_level(lambda: [bits_of(cpu_kernels.linear(x[:m], w, None)) for m in ROWS])
    for level, got in outs.items():
        assert all(torch.equal(a, c) for a, c in zip(got, outs[0])), f"level {level} differs from the portable C"


def test_other_activation_quantizations_are_not_read():
    """Activations quantized over the whole call (one scale for all rows) or asymmetrically are left
    to torchao's own linear."""
    per_tensor = _quantized(16, 64, torch.float32, granularity=tq.PerTensor())
    asym = _quantized(16, 64, torch.float32, act_mapping_type=tq.MappingType.ASYMMETRIC)
    for w in (per_tensor.weight, asym.weight):
        assert cpu_kernels.int8_parts(w) is None and cpu_kernels.weight_kind(w) == cpu_kernels.W_FLOAT


def test_pack_q8t_literal():
    """The W_Q8T bytes of the docstring's example: W_Q8's for float32 calls with unit scales, then the
    column scales and the codes' range."""
    got = cpu_kernels.pack_q8t(torch.tensor([[1, 2], [3, 4]], dtype=torch.int8), torch.tensor([0.5, 2.0]),
                               cpu_kernels.Int8Tokens(-128, 127))
    assert got[:16].tolist() == [1, 3, 0, 0, 0, 0, 0, 0, 2, 4, 0, 0, 0, 0, 0, 0]
    assert got[64:96].view(torch.float32).tolist() == [1.0, 1.0] + [0.0] * 6
    assert got[96:128].view(torch.float32).tolist() == [0.5, 2.0] + [0.0] * 6
    assert got[128:].view(torch.int32).tolist() == [-128, 127]


def _model(dtype: torch.dtype = torch.float32):
    from tests.conftest import tiny_model

    model = tiny_model("llama").to(dtype)
    tq.quantize_(model, tq.Int8DynamicActivationInt8WeightConfig(),
                 filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    return model


def test_model_runs_in_the_c_layers():
    """A tiny Llama in this config, wrapped: its decode steps run in the C decoder layers, its codes
    held once. Its int8 activations magnify one-ulp differences (the engine's attention rounding
    against HF's), so it runs with the note, and greedy with drafts in a batch is lossless against
    hf_plookup's own greedy of each prompt alone."""
    from hf_plookup.api import _state
    from hf_plookup.invariant.linears import row_strategy
    from tests.conftest import left_pad, repeat_prompts, wrap_copy

    model = _model()
    rows = repeat_prompts(3)
    wrapped = wrap_copy(model)
    ids, mask = left_pad(rows)
    got = wrapped.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=4)
    assert "magnify" in wrapped.last_stats.exactness_note and _state(wrapped).engine.c_layers.on
    for i, row in enumerate(rows):
        alone = wrapped.generate(row[None], max_new_tokens=16, do_sample=False)
        assert torch.equal(got[i, ids.shape[1]:], alone[0, len(row):]), i
    w = model.model.layers[0].mlp.up_proj.weight
    assert row_strategy(w, None) == "cpu" and type(w.qdata).__name__ == "PackedCodes"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_c_layers_are_the_modules(dtype):
    """The C decoder layers' steps are bitwise the engine's steps through the model's modules (each
    linear torchao's own arithmetic): the same logits at every step."""
    model = _model(dtype)
    assert_c_layers_are_the_modules(model)
