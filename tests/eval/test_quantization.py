"""`--quantization NAME` (eval/lib/quantization.py): the option in the scripts that take it, its
errors before any work, `load_model` quantizing for real through HF's quantizer (each installed
library, on a tiny random Llama), and eval/bench.py, eval/cpu_memory.py and eval/summarize.py end to
end on a quantized model with the quantization in their reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval import bench, cpu_memory, summarize
from eval.lib import quantization
from eval.lib.models import load_model

ROOT = Path(__file__).resolve().parents[2]
TINY = "random:tiny-llama"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linears(model):
    for layer in model.model.layers:
        for name in LINEARS:
            yield getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)


def _parse(script, argv):
    if script is summarize:
        return summarize.parse_args(argv)
    if script is bench:
        return bench.parse_args(["--device", "cpu", *argv])
    return cpu_memory.build_parser().parse_args(argv)


@pytest.mark.parametrize("script", [bench, cpu_memory, summarize], ids=lambda m: m.__name__.split(".")[-1])
def test_the_option_parses(script):
    assert _parse(script, []).quantization is None
    assert _parse(script, ["--quantization", "quanto-int8"]).quantization == "quanto-int8"
    assert "--quantization NAME" in script.build_parser().format_help()


def test_an_unknown_name_is_an_error_listing_the_names(capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--device", "cpu", "--quantization", "int3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'int3'" in err and all(n in err for n in quantization.NAMES)
    with pytest.raises(ValueError, match="unknown quantization 'int3': one of torchao-int8, "):
        quantization.quantization_config("int3", torch.float32)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        load_model(TINY, torch.float32, "cpu", quantization="int3")


def test_a_missing_library_is_an_error_naming_the_package_before_any_work(monkeypatch, capsys):
    real = quantization._importable
    monkeypatch.setattr(quantization, "_importable", lambda m: m != "optimum.quanto" and real(m))
    assert quantization.problem("quanto-int8") == ("--quantization quanto-int8 needs optimum.quanto, which is not "
                                                   "installed: pip install optimum-quanto")
    for script in (bench, summarize):
        with pytest.raises(SystemExit) as info:
            _parse(script, ["--quantization", "quanto-int8"])
        assert info.value.code == 2 and "pip install optimum-quanto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cpu_memory.main(["--model", TINY, "--quantization", "quanto-int8"])
    assert "pip install optimum-quanto" in capsys.readouterr().err
    with pytest.raises(ImportError, match="pip install optimum-quanto"):
        load_model(TINY, torch.float32, "cpu", quantization="quanto-int8")


def test_torchao_int4_without_mslk_says_why():
    if quantization._importable("mslk"):
        pytest.skip("mslk is installed here")
    pytest.importorskip("torchao")
    message = quantization.problem("torchao-int4")
    assert message is not None and "mslk" in message and "CUDA" in message and "pip install mslk-cuda" in message


def _expect(name: str):
    """(library to import, an assertion on one quantized decoder linear) for a quantization."""
    if name.startswith("torchao"):
        def check(linear):
            from torchao.utils import TorchAOBaseTensor

            assert type(linear) is torch.nn.Linear and isinstance(linear.weight, TorchAOBaseTensor), type(linear.weight)
            assert linear.weight.qdata.dtype == torch.int8
            if "intx" in name:  # (int4 values one a byte; "dyn": activations quantized per token)
                assert linear.weight.target_dtype == torch.int4
                assert (linear.weight.activation_quantization is not None) == ("dyn" in name)
                return
            # int8-dynamic also quantizes each call's activations; weight-only does not
            assert (linear.weight.act_quant_kwargs is not None) == name.endswith("dynamic")
        return "torchao", check
    if name.startswith("bnb"):
        def check(linear):
            import bitsandbytes as bnb

            if name == "bnb-8bit":
                assert isinstance(linear, bnb.nn.Linear8bitLt) and linear.weight.dtype == torch.int8
            else:
                assert isinstance(linear, bnb.nn.Linear4bit) and linear.weight.dtype == torch.uint8
                assert linear.weight.quant_state.quant_type == name.split("-")[1]
        return "bitsandbytes", check
    if name.startswith("ct-"):
        bits = 4 if name == "ct-w4a16" else 8

        def check(linear):  # (decompressed by the model's first forward, as compressed-tensors does)
            w = linear.quantization_scheme.weights
            assert type(linear) is torch.nn.Linear and (w.num_bits, w.group_size, w.symmetric) == (bits, 64, True)
            assert str(linear.quantization_status.value) in ("compressed", "decompressed")
        return "compressed_tensors", check
    if name.startswith(("gptq", "awq")):
        def check(linear):
            assert type(linear).__module__.startswith("gptqmodel.") and linear.bits == 4
            assert linear.qweight.dtype == torch.int32 and linear.scales.dtype == torch.float16
        return "gptqmodel", check

    def check(linear):
        from optimum import quanto

        assert isinstance(linear, quanto.QLinear)
        assert linear.weight_qtype == (quanto.qint8 if name == "quanto-int8" else quanto.qint4)
    return "optimum.quanto", check


def _bitsandbytes_problem() -> str | None:
    """Why bitsandbytes' own CPU layers do not run here (a wheel without kernels for this CPU), or
    None: asked of the library alone, so that a failure of the loader under test is never skipped."""
    import bitsandbytes as bnb

    x = torch.randn(2, 64)
    try:
        with torch.no_grad():
            # (moving a layer to its device is what quantizes its weights)
            bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False).to("cpu")(x)
            bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4").to("cpu")(x)
    except RuntimeError as e:
        return str(e)
    return None


# AWQ's quantizer takes linears of a multiple of 64 outputs, which the tiny Llama's keys and values are not
TINY_FOR = {"awq-4bit": "random:tiny-llama-128"}


def test_awq_of_a_model_it_cannot_quantize_says_why():
    pytest.importorskip("gptqmodel")
    with pytest.raises(RuntimeError, match=r"multiple of 64 outputs; this model has .*'key/value heads x head_dim': 32"):
        load_model(TINY, torch.float32, "cpu", quantization="awq-4bit")


def test_compressed_tensors_of_a_model_it_cannot_group_says_why(tiny_chat_ckpt):
    pytest.importorskip("compressed_tensors")
    with pytest.raises(RuntimeError, match=r"multiple of 64 inputs; this model has \{'hidden_size': 32"):
        load_model(str(tiny_chat_ckpt), torch.float32, "cpu", quantization="ct-w4a16")


@pytest.mark.parametrize("name", [n for n in quantization.NAMES if n != "torchao-int4"])
def test_load_model_quantizes_the_linears_for_real(name):
    library, check = _expect(name)
    pytest.importorskip(library)
    if library == "bitsandbytes" and (problem := _bitsandbytes_problem()) is not None:
        pytest.skip(f"bitsandbytes does not run here: {problem}")
    tiny = TINY_FOR.get(name, TINY)
    plain, _ = load_model(tiny, torch.float32, "cpu", seed=3)
    model, tok = load_model(tiny, torch.float32, "cpu", seed=3, quantization=name)
    stored = quantization.weight_bytes(model)  # (as loaded: compressed-tensors decompresses at the first forward)
    ids = torch.tensor([[5, 7, 9, 11]])
    with torch.no_grad():  # (optimum-quanto's int4 weights fail under inference_mode: see the module text)
        got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert tok is None and not model.training
    for linear in _linears(model):
        check(linear)
    # HF's quantizer leaves the LM head out, and the model is the same random model, quantized
    assert type(model.lm_head) is torch.nn.Linear and type(model.lm_head.weight) is torch.nn.Parameter
    assert quantization.quantized_linears(model) == 7 * len(model.model.layers) and quantization.quantized_linears(plain) == 0
    # (AWQ's quantizer keeps the unquantized weights in fp16: eval.lib.quantization._awq_checkpoint)
    saved = torch.float16 if name == "awq-4bit" else torch.float32
    assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight.to(saved).float())
    assert torch.isfinite(got).all() and not torch.equal(got, want)
    # near the plain model's logits (4-bit the farthest), far from unrelated weights' (cosine about 0)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.8
    assert stored < quantization.weight_bytes(plain)


def test_copy_model_reloads_what_cannot_be_deep_copied():
    pytest.importorskip("optimum.quanto")
    model, _ = load_model(TINY, torch.float32, "cpu", quantization="quanto-int8")
    reloads = []

    def reload():
        reloads.append(1)
        return load_model(TINY, torch.float32, "cpu", quantization="quanto-int8")[0]

    other = quantization.copy_model(model, reload)
    assert reloads == [1] and other is not model
    ids = torch.tensor([[5, 7, 9]])
    with torch.inference_mode():
        assert torch.equal(other(input_ids=ids).logits, model(input_ids=ids).logits)
    plain, _ = load_model(TINY, torch.float32, "cpu")
    assert quantization.copy_model(plain, reload) is not plain and reloads == [1]  # a deep copy


def _run(script: str, *argv: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "eval" / script), *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_on_a_quantized_model(tmp_path):
    pytest.importorskip("torchao")
    out = tmp_path / "bench.json"
    proc = _run("bench.py", "--model", TINY, "--quantization", "torchao-int8", "--device", "cpu", "--batch-sizes", "1", "2",
                "--k", "4", "--prompt-len", "36", "--num-prompts", "2", "--max-new-tokens", "8", "--threads", "1",
                "--json", str(out), cwd=tmp_path)
    assert "quantized torchao-int8 (14 linears)" in proc.stdout
    assert f"| {TINY} torchao-int8 | 2 | plk-k4 |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["args"]["quantization"] == "torchao-int8"
    (model,) = res["models"]
    assert model["quantization"] == "torchao-int8" and model["quantized_linears"] == 14
    rows = {(r["batch_size"], r["variant"]): r for r in res["results"]}
    assert set(rows) == {(1, "hf-greedy"), (1, "hf-pl-k4"), (1, "plk-greedy"), (1, "plk-k4"),
                         (2, "hf-greedy"), (2, "plk-greedy"), (2, "plk-k4")}
    for key, r in rows.items():
        assert r["quantization"] == "torchao-int8" and r["error"] is None and r["skipped"] is None, key
        if not model["exactness_note"]:  # wrap found its arithmetic row-count invariant: exact, as in fp32
            assert r["equal_to_hf_greedy"] == 1.0, key


def test_cpu_memory_on_a_quantized_model(tmp_path):
    pytest.importorskip("torchao")
    out = tmp_path / "cpu_memory.json"
    proc = _run("cpu_memory.py", "--model", TINY, "--dtype", "fp32", "--quantization", "torchao-int8", "--prompt-len", "40",
                "--max-new-tokens", "12", "--threads", "2", "--json", str(out))
    assert "quantized torchao-int8 (14 linears)" in proc.stdout
    res = json.loads(out.read_text())
    assert res["quantization"] == "torchao-int8" and res["quantized_linears"] == 14
    plain_bytes = sum(p.numel() * p.element_size() for p in load_model(TINY, torch.float32, "cpu")[0].parameters())
    assert 0 < res["weight_bytes"] < plain_bytes  # the stored int8 weights, not their fp32 shape
    assert res["hf_greedy"]["tok_per_s"] > 0 and res["plk_k4"]["tokens_equal_own_greedy"] is True
    if not res["exactness_note"]:
        assert res["plk_greedy"]["tokens_equal_hf"] is True


@pytest.mark.parametrize("name", ["torchao-int8", "quanto-int8"])  # quanto: the wrapped copy is a second load
def test_summarize_on_a_quantized_model(name, tiny_chat_ckpt, tmp_path, capsys):
    pytest.importorskip(_expect(name)[0])
    out = tmp_path / "out"
    rc = summarize.main(["--model", str(tiny_chat_ckpt), "--quantization", name, "--num-docs", "4", "--batch-size", "2",
                         "--max-new-tokens", "12", "--k", "4", "--threads", "1", "--rouge-backend", "rouge_score",
                         "--check-accuracy", "--no-plot", "--out", str(out)])
    assert rc == 0
    assert f"quantization {name} (" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["quantization"] == name and res["args"]["quantization"] == name
    assert (res["args"]["min_exact_match"], res["args"]["max_rouge_drop"]) == summarize.QUANTIZED_THRESHOLDS
    assert [v["name"] for v in res["results"]] == ["hf-greedy", "plk-k4"]
    if not res["exactness_note"]:
        assert res["results"][1]["exact_match"] == 1.0
    assert f"quantization {quantization.describe(name)}" in (out / "results.md").read_text()
