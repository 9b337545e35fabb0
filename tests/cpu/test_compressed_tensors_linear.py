"""The C linears' "sub_mul" form: compressed-tensors' 4-bit and 8-bit linears (llm-compressor's
pack-quantized W4A16 and W8A16) held compressed by `invariant.compressed_tensors`, each weight (q -
zero) * scale rounded once to the scale's dtype. The linears are made and compressed here by
compressed-tensors itself, and the view is checked against its own decompression; a W_Q4 (W_Q8G)
linear is bitwise the float linear of its dequantized weight, each row as alone, and every SIMD
level gives the portable C's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant import compressed_tensors as ct
from hf_plookup.invariant.linears import linear_module, linear_weight
from tests.conftest import assert_float_linear, at_every_simd_level, rows_alone_and_float_linear

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")

ROWS = (1, 2, 5, 9, 10, 13, 40)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _compressed(n: int, k: int, group: int | None, symmetric: bool, dtype: torch.dtype, seed: int = 0,
                scale: float = 1.0, layers: int = 1, bits: int = 4) -> torch.nn.Sequential:
    """`layers` linears [k -> n] with biases in a model, quantized and compressed in memory by
    compressed-tensors as llm-compressor does (eval's `compress`: its W4A16 or W8A16 preset,
    symmetric or not; `group` None: one scale a row)."""
    from eval.lib.quantization import compress

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(k, n) for _ in range(layers)])
    with torch.no_grad():
        for m in model:
            m.weight.copy_(torch.randn(n, k, generator=g) * scale)
            m.bias.copy_(torch.randn(n, generator=g))
    model = model.to(dtype)
    compress(model, f"W{bits}A16", group, symmetric=symmetric)
    return model


def _decompressed(module: torch.nn.Module) -> torch.Tensor:
    """compressed-tensors' own decompression of a compressed linear's weight."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(dict(module._parameters), module.quantization_scheme)["weight"]


def test_sub_mul_literal():
    """(8-bit codes: tests/cpu/test_kernels.py, test_q8g_literal.) One column, two groups of 2, offset 8: weights (q - 8 - z) * s = [(-8 - 1) / 2, (7 - 1) / 2 |
    (0 + 2) * 3, (1 + 2) * 3] = [-4.5, 3 | 6, 9], so x = [1, 2, 3, 4] gives -4.5 + 6 + 18 + 36 =
    55.5, plus the bias 0.5."""
    codes = torch.tensor([[0, 15, 8, 9]], dtype=torch.uint8)
    scales, zeros = torch.tensor([[0.5, 3.0]]), torch.tensor([[1.0, -2.0]])
    packed = cpu_kernels.pack_q4(codes, scales, zeros, 2, "sub_mul", 8.0, torch.float32)
    assert packed[64:72].view(torch.int32).tolist() == [2, cpu_kernels.Q4_FORMS["sub_mul"]] == [2, 4]
    out = torch.empty(1, 1)
    x, bias = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([0.5])
    for level, rc in at_every_simd_level(lambda: cpu_kernels._LIB.linear(
            x.data_ptr(), 1, packed.data_ptr(), cpu_kernels.W_Q4, 4, bias.data_ptr(), 1, out.data_ptr(), 0, 1)).items():
        assert rc == 0 and out.item() == 56.0, level


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group, symmetric", [(32, True), (32, False), (None, True), (None, False)],
                         ids=["group-sym", "group-asym", "channel-sym", "channel-asym"])
def test_view_is_compressed_tensors_decompression(group, symmetric, dtype, bits):
    """Held, a linear's weight is the view: its values are compressed-tensors' decompressed weight
    bitwise, its `F.linear` that weight's, and the C kernels read its codes, scales and zero points."""
    model = _compressed(24, 64, group, symmetric, dtype, seed=1, bits=bits)
    module = model[0]
    want = _decompressed(module)
    assert ct.hold_compressed(model) == 1 and ct.held(model) and ct.is_held(module) and linear_module(module)
    w = module.weight
    assert type(w) is ct.CompressedTensorsWeight and linear_weight(module) is w and w.dtype == dtype
    assert torch.equal(w.dequantized(), want) and want.dtype == dtype
    parts = cpu_kernels.q4_parts(w)
    offset = 1 << (bits - 1)
    assert (parts.form, parts.offset, parts.group, parts.bits) == ("sub_mul", offset, group or 64, bits)
    assert cpu_kernels.weight_kind(w) == cpu_kernels.q4_kind(64, group or 64, bits)
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    signed = unpack_from_int32(module.weight_packed, bits, (24, 64))
    assert torch.equal(parts.codes(), (signed.to(torch.int16) + offset).to(torch.uint8))
    assert (parts.shifts == 0).all() == symmetric
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(F.linear(x, w, module.bias), F.linear(x, want, module.bias))
    assert torch.equal(module(x), F.linear(x, want, module.bias))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, k, group", [(16, 128, 32), (24, 256, 128), (40, 64, None)])
def test_linear_is_the_float_linear_of_its_values_row_by_row(n, k, group, dtype, bits):
    model = _compressed(n, k, group, symmetric=n != 24, dtype=dtype, seed=n, bits=bits)
    ct.hold_compressed(model)
    w, b = model[0].weight, model[0].bias
    values = w.dequantized()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    rows = rows_alone_and_float_linear(w, b, values, x, ROWS)
    ref = x.double() @ values.double().T + b.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(rows.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 1e-5], ids=["normal", "small"])
def test_simd_levels_agree_bitwise(dtype, scale, bits):
    """Each level's rounding of the weights to the dtype: normal values, and (small) fp16's
    subnormals. Compared as bits."""
    model = _compressed(24, 256, 64, symmetric=False, dtype=dtype, seed=4, scale=scale, bits=bits)
    ct.hold_compressed(model)
    w = model[0].weight
    if dtype == torch.float16 and scale == 1e-5:
        assert ((w.dequantized() != 0) & (w.dequantized().abs() < 2**-14)).any()
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(5)).to(dtype)
    bits = lambda t: t.view(torch.int16 if t.dtype != torch.float32 else torch.int32)  # noqa: E731
    outs = at_every_simd_level(lambda: [cpu_kernels.linear(x[:m], w, None) for m in ROWS + (70,)])
    for m, got in zip(ROWS + (70,), outs[0]):
        assert_float_linear(got, w, w.dequantized(), x[:m], None, m)
    for level, got in outs.items():
        assert all(torch.equal(bits(a), bits(c)) for a, c in zip(got, outs[0])), f"level {level} differs from the portable C"


def test_hold_and_release():
    """Held: the instances' forwards and the model's decompressing hook off, nothing decompressed
    by a forward, outputs those of compressed-tensors' decompressed model; released: its own
    forwards and hook back, and the next forward decompresses as it would have."""
    model, twin = (_compressed(64, 64, 32, True, torch.float32, seed=6, layers=2) for _ in range(2))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(7))
    assert ct.hold_compressed(model) == 2 and ct.hold_compressed(model) == 2  # idempotent
    assert not hasattr(model, "ct_decompress_hook") and all("forward" not in vars(m) for m in model)
    with torch.inference_mode():
        got, want = model(x), twin(x)  # the twin decompresses at this forward
    assert torch.equal(got, want) and all("weight_packed" in m._parameters for m in model)
    assert all("weight" in m._parameters and "weight_packed" not in m._parameters for m in twin)
    ct.release(model)
    assert not ct.held(model) and all(type(m) is torch.nn.Linear and "forward" in vars(m) for m in model)
    assert hasattr(model, "ct_decompress_hook")
    with torch.inference_mode():
        assert torch.equal(model(x), want)
    assert all("weight" in m._parameters and "weight_packed" not in m._parameters for m in model)


def _mixed(other: str) -> torch.nn.Sequential:
    """Three linears compressed by compressed-tensors: W4A16, W8A16 and `other`'s scheme."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(3)])
    groups = {f"g{i}": preset_name_to_scheme(p, [f"re:^{i}$"]) for i, p in enumerate(["W4A16", "W8A16", other])}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups))
    with torch.no_grad():
        for m in model:
            m.weight_scale.fill_(0.01)  # (finite scales: the C kernels read no weight with another)
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    return model


def test_not_held_unless_every_quantized_linear_can_be():
    """4 and 8 bits are held together; a model with a linear of another scheme (3 bits), or one
    decompressed already, is left to compressed-tensors."""
    model = _mixed("W3A16")
    assert ct._holdable(model[0]) and ct._holdable(model[1]) and not ct._holdable(model[2])
    assert ct.hold_compressed(model) == 0 and not ct.held(model) and type(model[0]) is torch.nn.Linear
    both = _mixed("W8A16")
    assert ct.hold_compressed(both) == 3 and [cpu_kernels.weight_kind(m.weight) for m in both] == [
        cpu_kernels.q4_kind(128, 128), cpu_kernels.W_Q8G, cpu_kernels.W_Q8G]
    done = _compressed(16, 64, 32, True, torch.float32)
    with torch.inference_mode():
        done(torch.zeros(1, 64))
    assert ct.hold_compressed(done) == 0 and not ct.held(done)


def test_a_non_finite_scale_is_not_read():
    """The bf16 tiles round values that cannot be NaN: a weight with an infinite scale is left to
    its own `F.linear`."""
    model = _compressed(16, 64, 32, True, torch.bfloat16)
    ct.hold_compressed(model)
    with torch.no_grad():
        model[0].weight_scale[3, 1] = float("inf")
    w = model[0].weight
    assert cpu_kernels.q4_parts(w) is None and not cpu_kernels.supported(w)


def test_row_words_literal():
    words = torch.tensor([[0x76543210, -0x10000000 + 0x0FEDCBA9]], dtype=torch.int32)  # the second: 0xFFEDCBA9
    codes = cpu_kernels.row_words_codes(words)
    assert codes.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 15]]
    assert torch.equal(cpu_kernels.row_words(codes), words)
    eight = cpu_kernels.row_words_codes(words, 8)
    assert eight.tolist() == [[0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0xFF]]
    assert torch.equal(cpu_kernels.row_words(eight, 8), words)
    assert cpu_kernels.words_codes(words.t(), 8).t().tolist() == eight.tolist()


@pytest.mark.parametrize("preset", ["W4A16", "W8A16"])
def test_a_held_model_keeps_one_copy_and_saves_as_its_checkpoint(tmp_path, preset):
    """Wrapped, a held model's codes live only in the C kernels' packed bytes (`weight_packed` a
    `PackedParameter`); `save_pretrained` writes compressed-tensors' own tensors (the codes as
    loaded), which load back to a model with the same logits; `unwrap` gives plain parameters back."""
    from transformers import AutoModelForCausalLM

    import hf_plookup
    from eval.lib.quantization import save_compressed
    from tests.conftest import tiny_model

    save_compressed(tiny_model("llama"), str(tmp_path / "ckpt"), preset, group=32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    proj = model.model.layers[0].self_attn.q_proj
    loaded = proj.weight_packed.clone()
    hf_plookup.wrap(model, max_cache_tokens=256)
    assert ct.held(model) and type(proj.weight_packed).__name__ == "PackedParameter"
    assert isinstance(proj.weight_packed, torch.nn.Parameter) and torch.equal(proj.weight_packed, loaded)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight_packed, loaded)
    ids = torch.tensor([[5, 7, 9, 11, 13]])
    with torch.inference_mode():  # (the reloaded one decompressed by its first forward, as loaded models are)
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    hf_plookup.unwrap(model)
    assert type(proj.weight_packed) is torch.nn.Parameter and torch.equal(proj.weight_packed, loaded)
