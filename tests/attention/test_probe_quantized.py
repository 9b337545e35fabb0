"""The wrap-time probe on quantized models (attention.probe, `_arithmetic_floor`): quantized linears
whose arithmetic depends on a call's row count run, with one warning and
`SpecStats.exactness_note`, instead of being refused for semantics they do not have; a real
semantic failure in a quantized model is still refused, naming it. The real quantizers (torchao,
optimum-quanto, bitsandbytes) are tested where installed, on a tiny random Llama."""

from __future__ import annotations

import logging

import pytest
import torch

import hf_plookup
from hf_plookup.api import _state
from hf_plookup.attention import probe
from hf_plookup.cpu import kernels as cpu_kernels

from ..conftest import left_padded, tiny_model, wrap_copy

K = 4  # prompt_lookup_num_tokens


class RowCountLinear(torch.nn.Module):
    """A stand-in for a quantized linear: int8 weights with a per-row scale; a call of one row
    runs in fp32 (a GEMV kernel), a call of more rows through bf16 inputs (a dequantize-and-GEMM
    kernel), so the same row rounds differently with another row count."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 127
        self.weight = torch.nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = None
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() * self.scale
        if x.shape[:-1].numel() > 1:
            x = x.to(torch.bfloat16).float()
        return x @ w.T


def _row_count_model(seed: int = 0) -> torch.nn.Module:
    model = tiny_model("llama", seed=seed)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, RowCountLinear(getattr(layer.self_attn, name)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, name, RowCountLinear(getattr(layer.mlp, name)))
    return model


def _linears_but_head(module: torch.nn.Module, name: str) -> bool:
    """What HF's quantizers convert: the linears but the LM head (modules_to_not_convert)."""
    return isinstance(module, torch.nn.Linear) and "lm_head" not in name


def _greedy(model, ids, mask, n=16, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)


def test_row_count_dependent_linears_run_with_one_warning_and_the_note(caplog):
    model = _row_count_model()
    ids, mask = left_padded(1)
    probe_ids = ((torch.arange(probe.PROBE_TOKENS) * 7 + 3) % 96)[None]
    pos = {"position_ids": torch.arange(probe.PROBE_TOKENS)[None]}
    with torch.inference_mode():  # its own forward moves by more than the tolerance between row counts
        reference = model(input_ids=probe_ids, use_cache=False, **pos).logits.float()
        value, cause = probe._arithmetic_floor(model, probe_ids, pos, reference)
    assert cause == "rows" and value > 1e-3
    with caplog.at_level(logging.WARNING, logger="hf_plookup"):
        wrapped = wrap_copy(model, max_cache_tokens=256)
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=K)
    notes = [r.getMessage() for r in caplog.records if "quantization" in r.getMessage()]
    assert len(notes) == 1, notes  # at wrap, once; not per call
    assert "round a row differently with another row count" in notes[0] and "near-tie" in notes[0]
    assert "keys shared" not in notes[0] and "cache's length" not in notes[0]
    stats = wrapped.last_stats
    assert stats.exactness_note and stats.exactness_note in notes[0]
    assert stats.as_dict()["exactness_note"] == stats.exactness_note


def test_the_rounding_floor_is_the_largest_of_four_one_ulp_moves():
    """The floor's rounding part: the embeddings' outputs moved one ulp, odd elements or even ones,
    up or down, each a draw of the model's spread; `_arithmetic_floor` takes the largest of the four,
    computed here one by one (a bf16 model, whose one-ulp moves are large)."""
    model = tiny_model("llama").to(torch.bfloat16)
    ids = ((torch.arange(probe.PROBE_TOKENS) * 7 + 3) % 96)[None]
    pos = {"position_ids": torch.arange(probe.PROBE_TOKENS)[None]}
    emb = model.get_input_embeddings()
    draws = []
    with torch.inference_mode():
        reference = model(input_ids=ids, use_cache=False, **pos).logits.float()
        for parity in (1, 0):
            for toward in (float("inf"), float("-inf")):
                def move(module, args, out, parity=parity, toward=toward):
                    picked = (torch.arange(out.numel()) % 2 == parity).view(out.shape)
                    return torch.where(picked, torch.nextafter(out, torch.full_like(out, toward)), out)
                handle = emb.register_forward_hook(move)
                draws.append(float((model(input_ids=ids, use_cache=False, **pos).logits.float() - reference).abs().max()))
                handle.remove()
        value, cause = probe._arithmetic_floor(model, ids, pos, reference)
    assert len(set(draws)) > 1  # (distinct draws: the largest is a choice)
    assert value >= max(draws) and (cause == "rows" or value == max(draws))


def test_the_floor_covers_three_times_itself_even_below_the_tolerance():
    """Literal: a bf16 model (compressed-tensors W8A16's SmolLM2) whose own one-ulp floor, 1.09, is
    under the tolerance, 1.25, while the engine's attention moves it by 1.84: its quantized
    arithmetic, which runs with the note; 3.3 is more than 3 times the floor, and refused with that
    reason."""
    floor = probe._Floor(1.09, "rounding", "compressed-tensors")
    assert floor.covers(1.84) and floor.covers(3.27) and not floor.covers(3.3)
    assert floor.beyond().startswith("more than 3 times what its compressed-tensors quantization explains")


def test_plain_models_get_no_note(llama):
    wrapped = wrap_copy(llama, max_cache_tokens=256)
    ids, mask = left_padded(1)
    wrapped.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert wrapped.last_stats.exactness_note == ""
    assert probe._quantizer(llama) is None


def _positions_from_cache(model: torch.nn.Module) -> None:
    """Positions counted from the model's own cache, whatever position_ids it is given: right under
    HF's generate, wrong when fed as the engine feeds it (no cache object)."""

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # `cache` from transformers 5.24 on
        past = cache.get_seq_length() if cache is not None else 0
        n = kwargs["input_ids"].shape[1]
        kwargs["position_ids"] = (past + torch.arange(n, device=kwargs["input_ids"].device))[None]
        return args, kwargs

    model.model.register_forward_pre_hook(hook, with_kwargs=True)


def test_a_quantized_model_with_a_semantic_failure_is_still_refused_naming_it():
    model = _row_count_model()
    _positions_from_cache(model)
    with pytest.raises(ValueError) as info:
        hf_plookup.wrap(model)
    message = str(info.value)
    assert "takes positions or state from somewhere else" in message
    assert "quantization explains" in message and "not its quantized kernels' rounding" in message


def test_the_same_failure_unquantized_keeps_its_message():
    model = tiny_model("llama")
    _positions_from_cache(model)
    with pytest.raises(ValueError, match="takes positions or state from somewhere else") as info:
        hf_plookup.wrap(model)
    assert "quantization" not in str(info.value)


# -- real quantizers, where installed ------------------------------------------------------------
def _check_runs(model: torch.nn.Module, quantizer: str) -> None:
    """Wraps; greedy with k drafts at batch 1 and 2 equals HF greedy of the same quantized model
    in fp32 where the probe found its arithmetic row-count invariant (no note); with a note, the
    note names the quantizer and every row is generated."""
    # wrap's defaults: on CPU in fp32, invariant mode, whose row strategies are kept per weight
    # type (a plain weight of the same shape met earlier in this process does not decide)
    wrapped = wrap_copy(model, max_cache_tokens=512)
    exact = next(model.parameters()).dtype == torch.float32
    for batch in (1, 2):
        ids, mask = left_padded(batch, seed=5)
        ours = _greedy(wrapped, ids, mask, prompt_lookup_num_tokens=K)
        note = wrapped.last_stats.exactness_note
        if note:
            assert quantizer in note and "near-tie" in note
            assert torch.equal(ours[:, : ids.shape[1]], ids) and ours.shape[1] <= ids.shape[1] + 16
        elif exact:  # (bf16 greedy parts from HF's after near-ties, quantized or not: docs/engine.md)
            torch.testing.assert_close(ours, _greedy(model, ids, mask), rtol=0, atol=0)
        else:
            assert torch.equal(ours[:, : ids.shape[1]], ids) and ours.shape[1] <= ids.shape[1] + 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_int8_weight_only(dtype):
    quantization = pytest.importorskip("torchao.quantization")
    model = tiny_model("llama").to(dtype)
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(), filter_fn=_linears_but_head)
    assert probe._quantizer(model) is not None
    _check_runs(model, probe._quantizer(model))


def test_torchao_quantized_head_keeps_the_models_own():
    """torchao's `quantize_` without a filter quantizes `lm_head` too: the CPU head's transposed
    layout (steps.head) takes plain weights only, so the model's own head runs; tokens as HF's."""
    quantization = pytest.importorskip("torchao.quantization")
    from hf_plookup.steps.head import head_chooser

    model = tiny_model("llama")
    assert head_chooser(model) is not None
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    assert head_chooser(model) is None
    wrapped = wrap_copy(model, max_cache_tokens=512, invariant=False)
    ids, mask = left_padded(2, seed=5)
    ours = _greedy(wrapped, ids, mask, prompt_lookup_num_tokens=K)
    if not wrapped.last_stats.exactness_note:
        torch.testing.assert_close(ours, _greedy(model, ids, mask), rtol=0, atol=0)


def test_row_strategy_is_kept_per_weight_type():
    """A quantized weight of a plain weight's shape gets its own row strategy, and so does a weight of
    the same type that the C kernels do not read (torchao's activations quantized over the whole
    call, an `Int8Tensor` too): each computes its rows as 1-row calls of its own strategy do."""
    quantization = pytest.importorskip("torchao.quantization")
    from hf_plookup.invariant.linears import invariant_rows, row_strategy

    plain = torch.nn.Linear(64, 96, bias=False)
    assert row_strategy(plain.weight, None) in ("cpu", "numba", "plain", "rows")
    x = torch.randn(5, 64)
    per_tensor = quantization.Int8DynamicActivationInt8WeightConfig(granularity=quantization.PerTensor())
    for config in (quantization.Int8WeightOnlyConfig(), quantization.Int8DynamicActivationInt8WeightConfig(), per_tensor):
        quantized = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False))
        quantization.quantize_(quantized, config)
        got = row_strategy(quantized[0].weight, None)
        with torch.inference_mode():
            rows = invariant_rows(x, quantized[0].weight, None)
            one = torch.cat([invariant_rows(x[i : i + 1], quantized[0].weight, None) for i in range(5)])
        assert torch.equal(rows, one), got
        assert torch.allclose(rows, quantized(x), rtol=0.05, atol=0.05), got
        if config is not per_tensor and cpu_kernels.available():
            assert got == "cpu"  # the C kernel over the int8 weight (cpu.kernels W_Q8; per-token inputs too)
        else:
            assert got != "cpu"


def test_torchao_int8_dynamic_activations():
    quantization = pytest.importorskip("torchao.quantization")
    model = tiny_model("llama")
    quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig(), filter_fn=_linears_but_head)
    _check_runs(model, probe._quantizer(model))


def test_quanto_int8():
    quanto = pytest.importorskip("optimum.quanto")
    model = tiny_model("llama")
    quanto.quantize(model, weights=quanto.qint8, exclude="lm_head")
    quanto.freeze(model)
    assert probe._quantizer(model) is not None
    _check_runs(model, probe._quantizer(model))


def test_quanto_int4_runs_without_inference_mode():
    """optimum-quanto's int4 weights fail under torch.inference_mode ("Cannot set version_counter
    for inference tensor") and run under torch.no_grad, as HF's generate runs them: the engine then
    runs its steps under no_grad (EnginePlan.no_grad), and a plain model keeps inference mode."""
    quanto = pytest.importorskip("optimum.quanto")
    model = tiny_model("llama")
    quanto.quantize(model, weights=quanto.qint4, exclude="lm_head")
    quanto.freeze(model)
    ids = torch.tensor([[3, 4, 5]])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference tensor"):
        model(ids)  # (the library's own behaviour this test is about)
    _check_runs(model, probe._quantizer(model))
    assert _state(wrap_copy(model)).engine.plan.no_grad
    assert not _state(wrap_copy(tiny_model("llama"))).engine.plan.no_grad


@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_from_pretrained(bits, tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama").save_pretrained(tmp_path)
    config = (BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    try:
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu",
                                                     dtype=torch.float32).eval()
        model(input_ids=torch.tensor([[3, 4]]))
    except Exception as e:  # noqa: BLE001 - a bitsandbytes wheel without kernels for this CPU
        pytest.skip(f"bitsandbytes does not run here: {type(e).__name__}: {e}")
    assert probe._quantizer(model) == "bitsandbytes"
    _check_runs(model, "bitsandbytes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptq_from_pretrained(dtype):
    """A GPTQ 4-bit model made on this machine (transformers' GPTQConfig at load: gptqmodel and
    optimum, calibrated on builtin documents) wraps and runs; in fp32 greedy with drafts equals HF's
    greedy of the same model unless the probe notes its kernel's row-count dependence."""
    pytest.importorskip("gptqmodel")
    pytest.importorskip("optimum.gptq")
    from eval.lib.models import load_model

    model, _ = load_model("random:tiny-llama", dtype, "cpu", seed=3, quantization="gptq-4bit")
    assert probe._quantizer(model) == "gptq"
    _check_runs(model, "gptq")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_awq_checkpoint(dtype):
    """An AWQ 4-bit checkpoint made on this machine (gptqmodel's AWQ quantizer), loaded by
    transformers, wraps and runs as GPTQ's does."""
    pytest.importorskip("gptqmodel")
    from eval.lib.models import load_model

    model, _ = load_model("random:tiny-llama-128", dtype, "cpu", seed=3, quantization="awq-4bit")
    assert probe._quantizer(model) == "awq"
    _check_runs(model, "awq")


def _fp8_checkpoint(path, block: int = 32) -> dict:
    """The tests' tiny Llama saved as a block-wise FP8 checkpoint in `path`, as DeepSeek's and Qwen's
    FP8 checkpoints are (transformers' `FineGrainedFP8Config` format): each linear of the decoder
    layers float8_e4m3fn, with one fp32 `weight_scale_inv` per block of block x block weights.
    Returns each such weight's value, `fp8 * scale` in float32."""
    import json

    from safetensors.torch import load_file, save_file

    tiny_model("llama").save_pretrained(path)
    state, values = load_file(path / "model.safetensors"), {}
    for name in [n for n in state if n.endswith("_proj.weight")]:
        w = state[name].float()
        n, k = w.shape
        blocks = w.reshape(n // block, block, k // block, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        fp8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        values[name] = (fp8.float() * scale[:, None, :, None]).reshape(n, k)
        state[name], state[name + "_scale_inv"] = fp8.reshape(n, k), scale
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (path / "config.json").write_text(json.dumps(config))
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_checkpoint_on_cpu(tmp_path, dtype):
    """An FP8 checkpoint on a machine without FP8 kernels (a CPU): transformers dequantizes its
    weights at load to the model's dtype, each `fp8 * scale` of its block, and the model is then a
    plain one: it wraps without a note and in fp32 gives HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    values = _fp8_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    weights = dict(model.named_parameters())
    for name, value in values.items():
        assert type(weights[name]) is torch.nn.Parameter and torch.equal(weights[name], value.to(dtype)), name
    assert probe._quantizer(model) is None  # (the quantizer is gone with the dequantized weights)
    _check_runs(model, "fp8")
    wrapped = wrap_copy(model, max_cache_tokens=512)
    ids, mask = left_padded(1, seed=5)
    _greedy(wrapped, ids, mask, prompt_lookup_num_tokens=K)
    assert not wrapped.last_stats.exactness_note


def _compressed_tensors_checkpoint(path, preset: str) -> None:
    """The tests' tiny Llama saved as a compressed-tensors checkpoint in `path`, as llm-compressor
    saves one (eval's `save_compressed`): `preset`'s weight-only scheme (W4A16: symmetric int4 in
    groups, here of 32; W8A16: int8 so) on every linear but the head."""
    from eval.lib.quantization import save_compressed

    save_compressed(tiny_model("llama"), str(path), preset, group=32)


@pytest.mark.parametrize("preset", ["W4A16", "W8A16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_checkpoint(tmp_path, preset, dtype):
    """A compressed-tensors checkpoint (llm-compressor's format) loads on CPU with its linears
    compressed and compressed-tensors' forward set on each, which decompresses the weights at the
    model's first forward. Both schemes' linears are held compressed by `wrap` and run on the C
    kernels and C layers (invariant.compressed_tensors; W8A16's as weight kind W_Q8G), in fp32 with
    the greedy tokens of HF's own decompressed model, and `unwrap` gives the model back as it was
    loaded."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from hf_plookup.invariant import compressed_tensors as ct
    from hf_plookup.invariant.linears import row_strategy

    _compressed_tensors_checkpoint(tmp_path, preset)
    reference, model = (AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval() for _ in range(2))
    proj = model.model.layers[0].self_attn.q_proj
    assert "weight" not in dict(proj.named_parameters()) and "forward" in vars(proj)  # held compressed
    assert probe._quantizer(model) == "compressed-tensors"
    wrapped = hf_plookup.wrap(model, max_cache_tokens=512, tree_min_score=0.0)
    kind = cpu_kernels.q4_kind(proj.weight.shape[1], cpu_kernels.q4_parts(proj.weight).group, 4 if preset == "W4A16" else 8)
    assert ct.held(model) and ct.is_held(proj) and not hasattr(model, "ct_decompress_hook")
    # its codes kept, read by the C linears and layers; nothing decompressed
    assert "weight_packed" in proj._parameters and row_strategy(proj.weight, None) == "cpu"
    assert cpu_kernels.weight_kind(proj.weight) == kind and wrapped._engine.c_layers is not None
    for batch in (1, 2):
        ids, mask = left_padded(batch, seed=5)
        ours = _greedy(wrapped, ids, mask, prompt_lookup_num_tokens=K)
        assert not wrapped.last_stats.exactness_note
        assert torch.equal(ours, _greedy(wrapped, ids, mask))  # lossless
        if dtype == torch.float32:
            torch.testing.assert_close(ours, _greedy(reference, ids, mask), rtol=0, atol=0)
    # the first decode step ran both ways and the C layers gave the model's own bits
    assert "weight_packed" in proj._parameters and wrapped._engine.c_layers.on
    # wrapped again without invariant mode: let go (compressed-tensors decompresses it at its next forward)
    hf_plookup.wrap(model, invariant=False)
    assert not ct.held(model) and hasattr(model, "ct_decompress_hook")
    hf_plookup.unwrap(model)
    assert type(proj) is torch.nn.Linear and "forward" in vars(proj) and not ct.held(model)
    ids, mask = left_padded(1, seed=6)
    assert torch.equal(_greedy(model, ids, mask), _greedy(reference, ids, mask))
