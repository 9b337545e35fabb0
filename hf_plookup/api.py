"""`wrap(model, **options)`: the HF model itself, its class swapped to a subclass whose
`generate` runs on the engine (`PlookupModel`, the mixin); `unwrap(model)` swaps it back."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import fields

import torch

from .attention.registry import register
from .cpu.packed_codes import unpack_quantized
from .cpu.packed_weight import unpack_linears
from .invariant import bnb4bit, bnb8bit, compressed_tensors
from .invariant.linears import linear_of
from .engine.engine import Engine, EngineOptions
from .generation import GENERATE_ARGS, OWN_ARGS, resolve
from .outputs import PlookupGenerateOutput, assemble  # noqa: F401  (PlookupGenerateOutput: public name)
from .drafting.ngram import NgramProposer
from .stats import SpecStats

logger = logging.getLogger("hf_plookup")

_OPTION_NAMES = {f.name for f in fields(EngineOptions)}


_STATE = "_hf_plookup"  # the instance __dict__ key of a wrapped model's `_State`
_BASE = "_hf_plookup_base"  # the class attribute naming the plain HF class of a swapped class


class _State:
    """What hf_plookup keeps on a wrapped model: never a module attribute (so never in
    `state_dict`), never copied or pickled (a copy gets a fresh one with the same options)."""

    def __init__(self, options: EngineOptions, engine: Engine | None = None):
        self.options = options  # as given to wrap
        self.engine = engine  # built lazily; rebuilt when the parameters' devices/dtypes change
        self.signature = None if engine is None else _signature(engine.model)
        self.lock = threading.Lock()  # building the engine
        self.local = threading.local()  # per thread: .stats (last call), .inside (this thread runs the engine)


class PlookupModel:
    """The mixin of a wrapped model's class: `class LlamaForCausalLM(PlookupModel, LlamaForCausalLM)`.

    Everything but `generate`, `options`, `last_stats` is the HF model's own.
    `isinstance(model, hf_plookup.PlookupModel)` tells a wrapped model.

    `generate` may be called from several threads: a call that arrives while another runs joins
    its engine loop at the next step when their settings allow (greedy, same drafting and stop
    tokens, no processors/criteria/streamer; option `join_calls`), else it waits for that loop
    to end. `last_stats` is per thread: the stats of the calling thread's last call (also on the
    output with `return_dict_in_generate`). A call of the model itself waits while an engine loop
    runs (the loop switches the model's attention)."""

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # the engine's compiled steps: plain module call
            return super().__call__(*args, **kwargs)
        state = self.__dict__.get(_STATE)
        while state is not None and not getattr(state.local, "inside", False):
            engine = state.engine
            if engine is None:
                break
            with engine.exclusive():  # not while an engine loop has the attention switched
                if state.engine is engine:  # else rebuilt meanwhile: wait on the new one
                    return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)  # engine forwards, HF's delegated generate, no engine yet

    def __reduce_ex__(self, protocol):
        """Pickle and deepcopy: the plain class (importable) and the options; the engine is left out."""
        state = self.__getstate__()
        own = state.pop(_STATE, None)
        options = own.options if own is not None else EngineOptions()
        return _restore, (getattr(type(self), _BASE), options), state

    @property
    def options(self) -> EngineOptions:
        """The options given to `wrap`."""
        return _state(self).options

    @property
    def last_stats(self) -> SpecStats | None:
        """`SpecStats` of this thread's last `generate` call (None before the first)."""
        return getattr(_state(self).local, "stats", None)

    def clear_prefix_cache(self) -> None:
        """Forget the prompt pages kept for reuse (option `prefix_cache`). hf_plookup already does
        when the weights change in place, an adapter is switched or the model moves; this is for
        changes it cannot see (e.g. a forward hook that alters keys)."""
        engine = _state(self).engine
        if engine is not None:
            engine.clear_prefix_cache()

    @property
    def _engine(self) -> Engine:
        """The engine for the model as it is now (built, or rebuilt after a device/dtype change)."""
        return _current_engine(self, _state(self))

    # -- generate -----------------------------------------------------------------------
    def generate(self, inputs=None, generation_config=None, **kwargs):
        """Same arguments and result as HF's `generate`; greedy (with `prompt_lookup_num_tokens`
        for n-gram drafts) runs on the paged engine, any batch size; the rest goes to HF."""
        state = _state(self)
        with _inside(state):
            return self._plookup_generate(state, inputs, generation_config, kwargs)

    def _plookup_generate(self, state: _State, inputs, generation_config, kwargs: dict):
        start = time.perf_counter()
        args = {name: kwargs.pop(name) for name in list(kwargs) if name in GENERATE_ARGS}
        own = {name: kwargs.pop(name) for name in OWN_ARGS if name in kwargs}  # HF's generate does not know them
        request = resolve(self, inputs, generation_config, args, kwargs, own)
        engine = _current_engine(self, state)
        stats = SpecStats()
        if isinstance(request, str):
            logger.warning(f"hf_plookup: delegating to transformers' generate ({request})")
            stats.delegated, stats.delegated_reason = True, request
            try:
                rows = inputs if inputs is not None else kwargs.get("input_ids")
                if isinstance(rows, torch.Tensor) and rows.dim() == 2 and rows.shape[0] > 1:
                    # HF's prompt lookup refuses batches; drafts never change HF's greedy tokens
                    kwargs["prompt_lookup_num_tokens"] = None
                with engine.exclusive():  # HF's forwards must not see the engine's attention switched on
                    return super().generate(inputs, generation_config=generation_config, **args, **kwargs)
            finally:
                stats.wall_time = time.perf_counter() - start
                state.local.stats = stats

        engine.check_fits(max(len(p) for p in request.prompts) + request.decode.max_new_tokens)
        try:
            result = engine.generate(request.prompts, request.decode, stats)
        finally:
            stats.wall_time = time.perf_counter() - start
            state.local.stats = stats
        return assemble(self, request, result, stats, engine.exclusive)


_CLASSES: dict[type, type] = {}  # plain HF class -> its swapped class (one per class)
_CLASSES_LOCK = threading.Lock()


def plookup_class(base: type) -> type:
    """The wrapped class of `base`, made once: same name, qualname and module (so
    `save_pretrained` writes `architectures: [base name]` and pipelines see a known model)."""
    with _CLASSES_LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__,
                         "__doc__": base.__doc__, _BASE: base}
            cls = _CLASSES[base] = type(base)(base.__name__, (PlookupModel, base), namespace)
        return cls


def _restore(base: type, options: EngineOptions):
    """Unpickling / deepcopy: an empty instance of the wrapped class with a fresh state; the
    module's attributes are set next by `__setstate__`."""
    obj = base.__new__(base)
    obj.__class__ = plookup_class(base)
    obj.__dict__[_STATE] = _State(options)
    return obj


def _state(model) -> _State:
    state = model.__dict__.get(_STATE)
    if state is None:  # e.g. a wrapped class instantiated by hand
        state = model.__dict__.setdefault(_STATE, _State(EngineOptions()))
    return state


@contextlib.contextmanager
def _inside(state: _State):
    """This thread runs the engine (or HF's delegated generate): its model calls go straight through."""
    before = getattr(state.local, "inside", False)
    state.local.inside = True
    try:
        yield
    finally:
        state.local.inside = before


def _signature(model: torch.nn.Module) -> tuple:
    """Devices and dtypes of the parameters: the engine (cache pages, probe, backend) is built for these."""
    return tuple((p.device, p.dtype) for p in model.parameters())


# Libraries whose linears `wrap` holds in a form invariant mode's linears take, before the probe's
# first forward would change it (compressed-tensors decompresses, bitsandbytes repacks its 4-bit ones on
# AVX-512 BF16 CPUs; its 8-bit ones are marked with their model's dtype): each one's (held, hold,
# release), invariant.compressed_tensors, invariant.bnb4bit and invariant.bnb8bit
_HOLDS = ((compressed_tensors.held, compressed_tensors.hold_compressed, compressed_tensors.release),
          (bnb4bit.held, bnb4bit.hold_flat, bnb4bit.release), (bnb8bit.held, bnb8bit.hold, bnb8bit.release))


def _build(model: torch.nn.Module, options: EngineOptions) -> Engine:
    """A new engine for `model`: registers the attention, warms the proposer, runs the probe.
    Quantized linears that the probe's forward would change are held first (`_HOLDS`), and let go
    again where the engine does not run them through invariant mode's linears, or fails to build."""
    threads = torch.get_num_threads()
    held_before = [held(model) for held, _, _ in _HOLDS]  # (by an engine of this model that stays on a failure)
    if options.invariant is not False:
        for _, hold, _ in _HOLDS:
            hold(model)
    try:
        register()
        NgramProposer(1)  # compile (or load from numba's disk cache) before the first generate
        engine = Engine(model, options)
    except BaseException:
        for (_, _, release), before in zip(_HOLDS, held_before):
            if not before:
                release(model)
        raise
    finally:
        torch.set_num_threads(threads)  # numba's threading layer start-up resets OpenMP's count
    if not engine.plan.invariant:
        for _, _, release in _HOLDS:
            release(model)
    return engine


def _current_engine(model: torch.nn.Module, state: _State) -> Engine:
    """The state's engine, (re)built when missing (after a copy or unpickling) or when the
    parameters moved or changed dtype since it was built."""
    signature = _signature(model)
    with state.lock:
        old = state.engine
        if old is not None and state.signature == signature:
            return old
        with old.exclusive() if old is not None else contextlib.nullcontext(), _inside(state):
            state.engine = _build(model, state.options)  # the probe calls the model
            state.signature = signature
            state.engine.warm_up()
        return state.engine


def wrap(model, **options):
    """Make an HF causal LM's `generate` run on hf_plookup's engine; returns the same object.

    The model's class is swapped to a subclass of it (`PlookupModel` first), so the result is
    still the model: `isinstance` checks, `.to(...)`/`.eval()`/... chaining, `state_dict`,
    `save_pretrained`, deepcopy and pickle all behave as for the plain model.

    Options (see `EngineOptions`): max_cache_tokens, num_blocks, block_size, max_batch_tokens,
    max_num_seqs, cache_memory_fraction, attn_backend ("auto" | "sdpa" | "flash_attn" | "triton" | "flash_attn4"),
    compile ("auto" | True | False), cuda_graphs, pad_drafts, join_calls, tree_min_score,
    invariant ("auto" | True | False), prefix_cache ("auto" | True | False), draft_memory_tokens, warmup (a
    dict: the compiled or captured steps of later calls built now; engine.warmup), head_screen (greedy CPU
    steps' tokens from an int8 copy of the LM head; steps.head_screen).

    Example: `wrap(model, max_cache_tokens=32768)` then `model.generate(ids, prompt_lookup_num_tokens=4)`;
    a second call whose prompt starts with the first one's 600 tokens takes 512 of them from the
    prefix pool (`model.last_stats.cached_prompt_tokens == 512`).
    Wrapping a wrapped model again returns it; with options, its engine is rebuilt with the
    options merged.
    """
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise TypeError(f"unknown hf_plookup.wrap option(s) {sorted(unknown)}; allowed: {sorted(_OPTION_NAMES)}")
    if isinstance(model, PlookupModel):
        if not options:
            return model
        state = _state(model)
        merged = {f.name: getattr(state.options, f.name) for f in fields(EngineOptions)}
        merged.update(options)
        opts = EngineOptions(**merged)
        with _inside(state):
            engine = _build(model, opts)
        model.__dict__[_STATE] = new = _State(opts, engine)
        _warm_up(model, new, state)
        return model
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate"):
        raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"model: encoder-decoder architecture '{model.config.model_type}' is not supported")
    opts = EngineOptions(**options)
    engine = _build(model, opts)  # refuses a model the engine cannot run, its class unchanged
    model.__class__ = plookup_class(type(model))
    model.__dict__[_STATE] = state = _State(opts, engine)
    _warm_up(model, state, None)
    return model


def _warm_up(model, state: _State, before: _State | None) -> None:
    """The `warmup` option's step buckets, built on the model in its wrapped class (compiled
    code guards the class it ran on). Should the warm-up fail, the model is left as it was
    before `wrap`: its plain class (`before` None) or its earlier state."""
    try:
        with _inside(state):
            state.engine.warm_up()
    except BaseException:
        if before is None:
            unwrap(model)
        else:
            model.__dict__[_STATE] = before
        raise


def unwrap(model):
    """The plain HF model again (same object, its own class, plain parameters where `wrap` packed its
    CPU linear weights: cpu.packed_weight, and the libraries' plain code tensors where it packed
    quantized ones: cpu.packed_codes; compressed-tensors' own forwards and hook where it held their
    linears compressed: invariant.compressed_tensors; bitsandbytes' repacking where it held it off:
    invariant.bnb4bit); hf_plookup's state is dropped. A model that is not wrapped is returned as is."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(model, PlookupModel):
        return model
    state = model.__dict__.get(_STATE)
    engine = state.engine if state is not None else None
    with engine.exclusive() if engine is not None else contextlib.nullcontext():
        model.__class__ = getattr(type(model), _BASE)
        model.__dict__.pop(_STATE, None)
        unpack_linears(model)
        unpack_quantized(model, linear_of)
        for _, _, release in _HOLDS:
            release(model)
    return model
