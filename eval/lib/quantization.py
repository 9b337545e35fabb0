"""`--quantization NAME`: the eval scripts' models quantized at load by transformers' own quantizers,
the way a user quantizes one: `from_pretrained(..., quantization_config=...)`, with the config each
name stands for (QUANTIZATIONS). HF's greedy, every script's baseline, then runs the same quantized
model, so a table compares hf_plookup with HF on equal weights and kernels.

    python eval/summarize.py --model smollm2-135m --quantization torchao-int8
    load_model("random:tiny-llama", torch.float32, "cpu", quantization="quanto-int8")

How each kind of model gets quantized (eval/lib/models.py's `load_model` calls `from_pretrained` here):

- a checkpoint (an embedded alias's cached HF directory, a checkpoint directory or hub id, a .gguf
  file): `from_pretrained(path, dtype=..., quantization_config=..., device_map=device)`, as a user
  would; `device_map` has HF's quantizer place the weights on the device as it loads them,
  instead of a `.to(device)` of the quantized model afterwards.
- random weights (`random:SHAPE`): `from_config` has no quantizer, so the random model is saved to
  a temporary directory (`tempfile`'s, /tmp unless TMPDIR says otherwise), released, and loaded
  back through the same `from_pretrained`; the directory is removed once loaded. One copy of the
  weights is in memory at a time: the random model is gone before the quantized one loads. This
  is HF's quantizer itself at work, with its own module filter (the LM head stays unquantized:
  transformers' quantizers leave the output embedding out, `modules_to_not_convert`), not an
  imitation of it through the libraries' own calls.

A missing library is reported before any work starts (`problem`, which `check_option` turns into
the parser's error), naming the package to install; an unknown name is the parser's error
listing the names (`choices`), or a ValueError from `quantization_config`.

Two names are made otherwise: transformers loads AWQ and compressed-tensors checkpoints but cannot
make one at load, so `awq-4bit` has gptqmodel's own AWQ quantizer, and `ct-w4a16` and `ct-w8a16`
compressed-tensors' own compressor (`save_compressed`), make the checkpoint in a temporary directory (removed once
loaded), which `from_pretrained` then loads as a user loads a published one.

One name that does not run everywhere: `torchao-int4` quantizes through mslk's CUDA kernels, so
without mslk (on CPU) it is refused up front with that reason (HF's own load would fail inside a
conversion report). (`quanto-int4`'s weights fail under `torch.inference_mode`; wrap then runs
its steps under `torch.no_grad`, as HF's generate does.)"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Quantization:
    """One `--quantization` name: the module that must import, the pip package that provides it,
    the config as a user writes it (for tables and `--help`), and how to build that config for
    the run's dtype."""

    module: str
    package: str
    config: str
    build: Callable[[torch.dtype, str | None], object]  # (dtype, the checkpoint's path) -> the config
    # other modules the quantizer needs at load, with the package and why (checked with `module`)
    needs: tuple[tuple[str, str, str], ...] = ()
    # where transformers loads such checkpoints but cannot make one at load (AWQ): the library's own
    # quantizer, (the float checkpoint's path, the directory to save the quantized one in, the
    # dtype) -> None; `build` is then unused, transformers reading the config saved with the checkpoint
    make: Callable[[str, str, torch.dtype], None] | None = None


def _torchao(config: str) -> Callable[[torch.dtype, str | None], object]:
    def build(dtype, path):
        from torchao import quantization as q
        from transformers import TorchAoConfig

        return TorchAoConfig({"int8": lambda: q.Int8WeightOnlyConfig(),
                              "int8-dynamic": lambda: q.Int8DynamicActivationInt8WeightConfig(),
                              "int4": lambda: q.Int4WeightOnlyConfig(group_size=32),
                              "intx-int4": lambda: q.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                          granularity=q.PerGroup(32)),
                              "dyn-intx-int4": lambda: q.Int8DynamicActivationIntxWeightConfig(
                                  weight_dtype=torch.int4, weight_granularity=q.PerGroup(32))}[config]())

    return build


def _bnb_4bit(kind: str) -> Callable[[torch.dtype, str | None], object]:
    def build(dtype, path):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=dtype)

    return build


def _bnb_8bit(dtype, path):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


def _quanto(weights: str) -> Callable[[torch.dtype, str | None], object]:
    def build(dtype, path):
        from transformers import QuantoConfig

        return QuantoConfig(weights=weights)

    return build


# GPTQ and AWQ calibrate on these many of the builtin documents (eval/data/builtin.jsonl, shipped
# here): the quantization runs on every load, minutes for SmolLM2 on 2 cores
GPTQ_DOCUMENTS = 8


def _calibration(path):
    """(dataset, tokenizer) to calibrate a quantizer on: builtin documents as text with the
    checkpoint's own tokenizer. Random weights have none: their documents are SmolLM2's tokens,
    taken modulo the model's vocabulary (tiny shapes have a small one), given already tokenized."""
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer

    from .documents import BUILTIN_PATH, load_jsonl

    texts = [d["document"] for d in load_jsonl(BUILTIN_PATH)[:GPTQ_DOCUMENTS]]
    if path is not None and (Path(path) / "tokenizer_config.json").exists():
        return texts, path
    from hf_plookup import embedded

    tok = AutoTokenizer.from_pretrained(embedded.embedded_checkpoint("smollm2-135m"))
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size if path is not None else tok.vocab_size
    rows = [torch.tensor(tok(t).input_ids) % vocab for t in texts]
    return [{"input_ids": r[None], "attention_mask": torch.ones_like(r)[None]} for r in rows], tok


def _gptq(dtype, path):
    """GPTQ 4-bit, groups of 64 (SmolLM2's 576 columns hold no group of 128), calibrated on builtin
    documents (`_calibration`)."""
    from transformers import GPTQConfig

    data, tok = _calibration(path)
    return GPTQConfig(bits=4, group_size=64, dataset=data, tokenizer=tok, desc_act=False)


def _linear_widths(path: str) -> dict[str, int]:
    """The widths of a decoder's linears (their inputs and outputs), from its config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path).get_text_config()
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "query heads x head_dim": c.num_attention_heads * head,
            "key/value heads x head_dim": getattr(c, "num_key_value_heads", c.num_attention_heads) * head}


def _awq_checkpoint(path: str, out: str, dtype: torch.dtype) -> None:
    """An AWQ 4-bit checkpoint of `path` in `out`, made as a user makes one: gptqmodel's AWQ
    quantizer (asymmetric, with zero points, as AutoAWQ's default; groups of 64 as GPTQ's),
    calibrated on builtin documents (`_calibration`), saved, for transformers to load. The model is
    loaded for it in `dtype` where that is fp16 or bf16, else in fp16, as published AWQ
    checkpoints are (gptqmodel's AWQ takes no other): the weights it keeps unquantized, the
    embeddings among them, are saved so."""
    import os
    import tempfile
    from pathlib import Path

    odd = {k: v for k, v in _linear_widths(path).items() if v % 64}
    if odd:
        raise ValueError(f"gptqmodel's AWQ quantizer takes linears of a multiple of 64 outputs; this model has {odd}")
    # gptqmodel's default CPU pool takes half the cores, and refuses to start on 2 cores (its loader
    # asks for 2 workers of that pool)
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, os.cpu_count() or 1)))
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.config import AWQConfig

    data, tok = _calibration(path)
    with tempfile.TemporaryDirectory(prefix="hf_plookup-awq-source-") as source:
        if not isinstance(tok, str):  # gptqmodel loads a tokenizer from the model's directory: lend it one
            for f in Path(path).iterdir():
                (Path(source) / f.name).symlink_to(f.resolve())
            tok.save_pretrained(source)
            path = source
        dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
        model = GPTQModel.load(path, AWQConfig(bits=4, group_size=64, sym=False), device="cpu", dtype=dtype)
        model.quantize(data, batch_size=1)
        model.save(out)


def compress(model: torch.nn.Module, preset: str = "W4A16", group: int | None = 64,
             symmetric: bool | None = None) -> None:
    """Quantize and compress `model` (float) in place as llm-compressor does: compressed-tensors'
    `preset` scheme (W4A16: symmetric int4 in groups of `group`, or one scale a row where `group` is
    None, packed eight a word; W4A16_ASYM: the same with zero points; W8A16: int8 so, four a word;
    `symmetric` overrides the preset's) on every linear but the LM head, each scale (and zero point)
    from its group's or row's range (a min-max observer's: llm-compressor's round-to-nearest), then
    compressed by compressed-tensors' own compressor, which leaves its decompressing hook on the model."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.group_size:
        scheme.weights.strategy, scheme.weights.group_size = ("group", group) if group else ("channel", None)
    if symmetric is not None:
        scheme.weights.symmetric = symmetric
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight_scale"):
                w, args = m.weight.detach(), m.quantization_scheme.weights
                w = w.reshape(w.shape[0], -1, args.group_size) if args.group_size else w.unsqueeze(1)
                scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
                m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
                m.weight_zero_point.copy_(zero.reshape(m.weight_zero_point.shape))
    ModelCompressor.from_pretrained_model(model).compress_model(model)


def save_compressed(model: torch.nn.Module, out: str, preset: str = "W4A16", group: int | None = 64) -> None:
    """`model` (float) compressed in place (`compress`) and saved in `out` with its
    compressed-tensors config: an llm-compressor checkpoint."""
    from compressed_tensors.compressors import ModelCompressor

    compress(model, preset, group)
    model.save_pretrained(out)
    ModelCompressor.from_pretrained_model(model).update_config(out)


def _ct_checkpoint(preset: str):
    """What makes a compressed-tensors checkpoint of scheme `preset` (W4A16 or W8A16, groups of 64,
    as GPTQ's) of `path` in `out`, its unquantized weights in `dtype` (`save_compressed`). A model
    whose linears' inputs are not multiples of 64 is refused before any work."""
    def make(path: str, out: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        inputs = ("hidden_size", "intermediate_size", "query heads x head_dim")
        odd = {k: v for k, v in _linear_widths(path).items() if k in inputs and v % 64}
        if odd:
            raise ValueError(f"ct-{preset.lower()}'s groups of 64 values need linears of a multiple of 64 inputs; "
                             f"this model has {odd}")
        save_compressed(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), out, preset)

    return make


QUANTIZATIONS: dict[str, Quantization] = {
    "torchao-int8": Quantization("torchao", "torchao", "TorchAoConfig(Int8WeightOnlyConfig())", _torchao("int8")),
    "torchao-int8-dynamic": Quantization("torchao", "torchao", "TorchAoConfig(Int8DynamicActivationInt8WeightConfig())",
                                         _torchao("int8-dynamic")),
    # torchao's int4 weights for CPUs: int4 values one a byte, scales and zero points in groups
    "torchao-intx-int4": Quantization("torchao", "torchao",
                                      "TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))",
                                      _torchao("intx-int4")),
    # the same weights, each call's activations quantized per token to int8 (asymmetric) first
    "torchao-dyn-intx-int4": Quantization("torchao", "torchao",
                                          "TorchAoConfig(Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, "
                                          "weight_granularity=PerGroup(32)))", _torchao("dyn-intx-int4")),
    # torchao's int4 weights (its default plain packing) are made by mslk's kernels, a CUDA package:
    # without it HF's load fails deep in a conversion report, so it is checked up front
    "torchao-int4": Quantization("torchao", "torchao", "TorchAoConfig(Int4WeightOnlyConfig(group_size=32))",
                                 _torchao("int4"),
                                 needs=(("mslk", "mslk-cuda on a CUDA machine", "torchao's Int4WeightOnlyConfig (its default plain int4 "
                                         "packing) quantizes through mslk's int4 kernels, a CUDA package"),)),
    "bnb-8bit": Quantization("bitsandbytes", "bitsandbytes", "BitsAndBytesConfig(load_in_8bit=True)", _bnb_8bit),
    "bnb-nf4": Quantization("bitsandbytes", "bitsandbytes",
                            'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=<dtype>)',
                            _bnb_4bit("nf4")),
    "bnb-fp4": Quantization("bitsandbytes", "bitsandbytes",
                            'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=<dtype>)',
                            _bnb_4bit("fp4")),
    "quanto-int8": Quantization("optimum.quanto", "optimum-quanto", 'QuantoConfig(weights="int8")', _quanto("int8")),
    "quanto-int4": Quantization("optimum.quanto", "optimum-quanto", 'QuantoConfig(weights="int4")', _quanto("int4")),
    # made at load from the float checkpoint (calibrated on shipped documents), as a user makes one
    "gptq-4bit": Quantization("gptqmodel", "gptqmodel optimum",
                              f"GPTQConfig(bits=4, group_size=64, dataset=<{GPTQ_DOCUMENTS} builtin documents>, "
                              "desc_act=False)", _gptq,
                              needs=(("optimum.gptq", "optimum", "transformers' GPTQ quantizer calibrates through "
                                      "optimum's GPTQQuantizer"),)),
    # made by gptqmodel's AWQ quantizer (transformers loads AWQ checkpoints, through gptqmodel, but
    # does not make them), then loaded by transformers
    "awq-4bit": Quantization("gptqmodel", "gptqmodel",
                             f"AwqConfig of a checkpoint made by gptqmodel's AWQConfig(bits=4, group_size=64, "
                             f"sym=False) on <{GPTQ_DOCUMENTS} builtin documents>", lambda dtype, path: None,
                             make=_awq_checkpoint),
    # made by compressed-tensors' own compressor, as llm-compressor saves one, then loaded by transformers
    "ct-w4a16": Quantization("compressed_tensors", "compressed-tensors",
                             "a compressed-tensors checkpoint of scheme W4A16 (groups of 64, min-max scales), "
                             "made by its compressor", lambda dtype, path: None, make=_ct_checkpoint("W4A16")),
    "ct-w8a16": Quantization("compressed_tensors", "compressed-tensors",
                             "a compressed-tensors checkpoint of scheme W8A16 (int8, groups of 64, min-max scales), "
                             "made by its compressor", lambda dtype, path: None, make=_ct_checkpoint("W8A16")),
}
NAMES = tuple(QUANTIZATIONS)


def _spec(name: str) -> Quantization:
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}: one of {', '.join(NAMES)}")
    return QUANTIZATIONS[name]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (optimum) missing
        return False


def problem(name: str | None) -> str | None:
    """Why `name` cannot run here (None: nothing known): a library that is not installed, named
    with the package to install. No work is done: it only looks the modules up.

    >>> problem(None) is None
    True
    """
    if name is None:
        return None
    spec = _spec(name)
    if not _importable(spec.module):
        return f"--quantization {name} needs {spec.module}, which is not installed: pip install {spec.package}"
    for module, package, why in spec.needs:
        if not _importable(module):
            return f"--quantization {name}: {why}, and {module} is not installed (pip install {package})"
    return None


def add_quantization_option(parser: argparse.ArgumentParser) -> None:
    """`--quantization NAME` (default: none, the model as loaded). Its help lists every name with
    the config it stands for."""
    parser.add_argument(
        "--quantization", default=None, choices=NAMES, metavar="NAME",
        help="quantize the model at load with HF's own quantizer, from_pretrained(quantization_config=...); HF greedy "
             "(the baseline) runs the same quantized model. NAME: "
             + "; ".join(f"{n}: {q.config}" for n, q in QUANTIZATIONS.items()) + " (default: none)")


def check_option(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The parser's error (exit 2, before any work) when `args.quantization`'s library is missing."""
    message = problem(getattr(args, "quantization", None))
    if message:
        parser.error(message)


def describe(name: str | None) -> str:
    """The quantization as a table says it: "none", or the name and its config.

    >>> describe("quanto-int8")
    'quanto-int8 (QuantoConfig(weights="int8"))'
    """
    return "none" if name is None else f"{name} ({_spec(name).config})"


def quantization_config(name: str, dtype: torch.dtype, path: str | None = None):
    """HF's quantization config that `name` stands for, for a model run in `dtype` (bitsandbytes'
    4-bit compute dtype) loaded from `path` (GPTQ's calibration tokenizer); ValueError for an
    unknown name, ImportError naming the package for a missing library."""
    spec = _spec(name)
    message = problem(name)
    if message:
        raise ImportError(message)
    return spec.build(dtype, path)


def from_pretrained(path, dtype: torch.dtype, device, name: str, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(path, ...)` quantized by `name` (HF's quantizer at
    load), on `device`, in eval mode. A failed load is a RuntimeError that names the quantization
    and the device, HF's own error chained to it."""
    import tempfile

    from transformers import AutoModelForCausalLM

    config = quantization_config(name, dtype, str(path))
    device = torch.device(device)
    make = _spec(name).make
    if make is not None and "gguf_file" in kwargs:
        raise ValueError(f"--quantization {name} quantizes a checkpoint directory, not a .gguf file")
    with tempfile.TemporaryDirectory(prefix="hf_plookup-quantized-") as made:
        try:
            if make is not None:  # the library makes the checkpoint; transformers reads its saved config
                make(str(path), made, dtype)
                path = made
            else:
                kwargs["quantization_config"] = config
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device), **kwargs)
        except Exception as e:
            raise RuntimeError(f"transformers could not load {path} with --quantization {describe(name)} on "
                               f"{device}: {type(e).__name__}: {e}") from e
    return model.eval()


def copy_model(model: torch.nn.Module, reload: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A second model with `model`'s weights that shares none of its modules: a deep copy, or, for
    weights that cannot be deep-copied (optimum-quanto's tensors have no `clone` of their own
    type), `reload()`, the same load again (the same checkpoint or seed gives the same quantized
    weights)."""
    import copy

    try:
        return copy.deepcopy(model)
    except (RuntimeError, TypeError, NotImplementedError):
        return reload()


def _bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's, optimum-quanto's quantized weights) by
    its inner tensors, whose numel and element size are what is stored; a plain one (bitsandbytes
    keeps its packed bytes in plain uint8/int8 parameters) as it is, plus, for bitsandbytes' 4-bit
    weights, the absmax their quant state holds.

    Example: torchao's int8 weight of a 64 x 64 fp32 linear reports 4,096 elements of 4 bytes,
    but stores 4,096 int8 values and 64 fp32 scales (and zero points): 4,096 + 256 + ... bytes."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
    state = getattr(t, "quant_state", None)  # bitsandbytes 4-bit: its absmax (and their own) beside the codes
    extra = 0
    for s in (state, getattr(state, "state2", None)) if state is not None else ():
        absmax = getattr(s, "absmax", None)
        extra += absmax.numel() * absmax.element_size() if isinstance(absmax, torch.Tensor) else 0
    return t.numel() * t.element_size() + extra


def _buffer_linear(module: torch.nn.Module) -> bool:
    """A quantizer's linear that keeps its weights in buffers and is no `nn.Linear` (gptqmodel's
    GPTQ linears: qweight, qzeros, scales, g_idx)."""
    return type(module).__module__.startswith("gptqmodel.") and hasattr(module, "qweight")


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of `model`'s parameters as stored (quantized weights at their stored size), and of
    the buffers a GPTQ linear keeps its weights in: what a decode step reads, the numerator of the
    bandwidth bound. For a plain model the same as numel x element size summed over the parameters."""
    buffers = sum(b.numel() * b.element_size() for m in model.modules() if _buffer_linear(m)
                  for b in m.buffers(recurse=False))
    return sum(_bytes(p) for p in model.parameters()) + buffers


def quantized_linears(model: torch.nn.Module) -> int:
    """How many of `model`'s linears hold quantized weights: a quantizer's own linear class
    (bitsandbytes' Linear8bitLt/Linear4bit, optimum-quanto's QLinear, gptqmodel's GPTQ linears), a
    compressed-tensors linear (an `nn.Linear` with a quantization scheme) or
    a quantized tensor subclass in a plain `nn.Linear` (torchao). 0 for a plain model: a load whose
    quantizer did nothing shows here."""
    count = 0
    for m in model.modules():
        if _buffer_linear(m):
            count += 1
        if not isinstance(m, torch.nn.Linear):
            continue
        if getattr(m, "quantization_scheme", None) is not None:  # compressed-tensors' (compressed: no weight)
            count += 1
            continue
        root = type(m.weight).__module__.split(".")[0]
        if type(m) is not torch.nn.Linear or root in ("torchao", "optimum", "bitsandbytes"):
            count += 1
    return count
