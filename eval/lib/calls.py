"""Timed greedy `generate` calls over one batch: HF's (plain, its own prompt lookup, static-cache,
continuous batching) and hf_plookup's, each returning the generated tokens, the seconds and
the forwards it took (`CallResult`)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .batching import eos_ids, new_tokens
from .timing import sync


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
           extra_eos: set[int] | None = None, cache_implementation: str | None = None,
           max_cache_len: int | None = None) -> CallResult:
    """HF `generate`, greedy (with HF's own prompt lookup when `k`, batch 1 only); `extra_eos`
    adds stop tokens to the model's EOS ids; `cache_implementation="static"`: HF's static cache,
    whose forward HF compiles on CUDA. `max_cache_len`: the static cache's length for every call
    (HF's own argument), so that calls of other prompt lengths reuse one compiled forward instead
    of compiling again for each length."""
    kwargs = _greedy_kwargs(max_new_tokens, pad)
    if k:
        if input_ids.shape[0] != 1:
            raise ValueError("HF's prompt lookup runs at batch size 1 only")
        kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)
    if cache_implementation:
        kwargs["cache_implementation"] = cache_implementation
        if max_cache_len is not None:
            kwargs["max_cache_len"] = max_cache_len
    eos = _with_stops(kwargs, model, extra_eos)
    # no hook on a forward HF compiles: dynamo would trace the counting into the compiled graph
    counting = ForwardCounter(model) if not cache_implementation else contextlib.nullcontext()
    # no_grad, as HF's generate runs itself (inference mode would refuse some quantized weights:
    # optimum-quanto's int4); hf_plookup's engine picks its own mode inside (EnginePlan.grad_mode)
    with torch.no_grad(), counting as counter:
        sync(input_ids.device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        sync(input_ids.device)
        seconds = time.perf_counter() - t0
    tokens = new_tokens(out, input_ids.shape[1], eos)
    # HF runs every row in every forward until all stop: a row's productive steps are
    # its token count in plain greedy; with prompt lookup (batch 1) it is the forward count.
    forwards = counter.count if counter is not None else max(len(t) for t in tokens)
    row_steps = forwards if k else sum(len(t) for t in tokens)
    return CallResult(tokens, seconds, forwards, row_steps)


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
    # generate_batch sizes its cache from free memory, which on CPU costs seconds per call
    defaults = ContinuousBatchingConfig()
    page = getattr(defaults, "page_size", None) or defaults.block_size  # (block_size before transformers 5.2x)
    blocks = sum(-(-(len(r) + max_new_tokens) // page) for r in rows) + len(rows)
    cb_config = ContinuousBatchingConfig(num_blocks=blocks)
    eos = set() if eos_token_id is None else {int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}
    device = next(model.parameters()).device
    # no inference_mode here: generate_batch builds its cache in this thread and writes it from
    # its own worker thread, where inference tensors cannot be updated in place
    with ForwardCounter(model) as counter:
        sync(device)
        t0 = time.perf_counter()
        out = model.generate_batch(rows, generation_config=config, continuous_batching_config=cb_config, progress_bar=False)
        sync(device)
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
    with torch.no_grad():
        sync(input_ids.device)
        t0 = time.perf_counter()
        out = wrapped.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        sync(input_ids.device)
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
