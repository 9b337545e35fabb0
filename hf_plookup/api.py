"""`wrap(model, **options)` and `PlookupModel`: the HF model, with `generate` run by the engine."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import fields

import torch

from .attention.registry import register
from .engine.engine import Engine, EngineOptions
from .generation import GENERATE_ARGS, OWN_ARGS, resolve
from .outputs import PlookupGenerateOutput, assemble  # noqa: F401  (PlookupGenerateOutput: public name)
from .drafting.ngram import NgramProposer
from .stats import SpecStats

logger = logging.getLogger("hf_plookup")

_OPTION_NAMES = {f.name for f in fields(EngineOptions)}


class PlookupModel:
    """Behaves as the wrapped HF model (attributes, calls, saving) except for `generate`.

    `generate` may be called from several threads: a call that arrives while another runs joins
    its engine loop at the next step when their settings allow (greedy, same drafting and stop
    tokens, no processors/criteria/streamer; option `join_calls`), else it waits for that loop
    to end. `last_stats` is per thread: the stats of the calling thread's last call (also on the
    output with `return_dict_in_generate`)."""

    def __init__(self, model: torch.nn.Module, options: EngineOptions):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_engine", Engine(model, options))
        object.__setattr__(self, "_local", threading.local())  # per thread: .stats

    # -- passthrough --------------------------------------------------------------------
    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_model"), name)

    def __setattr__(self, name, value):
        if name in type(self).__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._model, name, value)

    def __call__(self, *args, **kwargs):
        with self._engine.exclusive():  # not while an engine loop has the attention switched
            return self._model(*args, **kwargs)

    def __repr__(self) -> str:
        return f"PlookupModel({self._model!r})"

    def __dir__(self):
        return sorted(set(dir(self._model)) | set(super().__dir__()))

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped HF model."""
        return self._model

    @property
    def options(self) -> EngineOptions:
        return self._options

    @property
    def last_stats(self) -> SpecStats | None:
        """`SpecStats` of this thread's last `generate` call (None before the first)."""
        return getattr(self._local, "stats", None)

    # -- generate -----------------------------------------------------------------------
    def generate(self, inputs=None, generation_config=None, **kwargs):
        """Same arguments and result as HF's `generate`; greedy (with `prompt_lookup_num_tokens`
        for n-gram drafts) runs on the paged engine, any batch size; the rest goes to HF."""
        start = time.perf_counter()
        args = {name: kwargs.pop(name) for name in list(kwargs) if name in GENERATE_ARGS}
        own = {name: kwargs.pop(name) for name in OWN_ARGS if name in kwargs}  # HF's generate does not know them
        request = resolve(self._model, inputs, generation_config, args, kwargs, own)
        stats = SpecStats()
        if isinstance(request, str):
            logger.warning(f"hf_plookup: delegating to transformers' generate ({request})")
            stats.delegated, stats.delegated_reason = True, request
            try:
                with self._engine.exclusive():  # HF's forwards must not see the engine's attention switched on
                    return self._model.generate(inputs, generation_config=generation_config, **args, **kwargs)
            finally:
                stats.wall_time = time.perf_counter() - start
                self._local.stats = stats

        engine = self._engine
        engine.check_fits(max(len(p) for p in request.prompts) + request.decode.max_new_tokens)
        try:
            result = engine.generate(request.prompts, request.decode, stats)
        finally:
            stats.wall_time = time.perf_counter() - start
            self._local.stats = stats
        return assemble(self._model, request, result, stats, self._engine.exclusive)


def wrap(model, **options) -> PlookupModel:
    """Wrap an HF causal LM so its `generate` runs on hf_plookup's engine.

    Options (see `EngineOptions`): max_cache_tokens, num_blocks, block_size, max_batch_tokens,
    max_num_seqs, cache_memory_fraction, attn_backend ("auto" | "sdpa" | "flash_attn" | "triton"),
    compile ("auto" | True | False), cuda_graphs, pad_drafts, join_calls. Wrapping a
    `PlookupModel` again rewraps the same HF model with the options merged.
    """
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"unknown hf_plookup.wrap option(s) {sorted(unknown)}; allowed: {sorted(_OPTION_NAMES)}")
    if isinstance(model, PlookupModel):
        if not options:
            return model
        merged = {f.name: getattr(model.options, f.name) for f in fields(EngineOptions)}
        merged.update(options)
        return PlookupModel(model.model, EngineOptions(**merged))
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate"):
        raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"model: encoder-decoder architecture '{model.config.model_type}' is not supported")
    opts = EngineOptions(**options)
    threads = torch.get_num_threads()
    try:
        register()
        NgramProposer(1)  # compile (or load from numba's disk cache) before the first generate
        wrapped = PlookupModel(model, opts)
    finally:
        torch.set_num_threads(threads)  # numba's threading layer start-up resets OpenMP's count
    return wrapped
