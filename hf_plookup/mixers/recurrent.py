"""Token mixers that carry a state instead of keys: Mamba and Mamba-2 mixers, gated delta nets,
short convolutions, lightning attention.

Hybrid models (Qwen3-Next, Qwen 3.5, Nemotron-H, Falcon-H1, OLMo-Hybrid, LFM, MiniMax) and pure
state-space models (Mamba) mix tokens in some layers through a recurrence whose state (a causal
convolution's last inputs, a matrix per head) sums up everything before. Such a layer has no keys
to page: its state for each sequence lives here, beside the pages.

The engine packs a step's rows into one `[1, T]` sequence and hands the model no cache object.
So while an engine forward runs, each mixer module's forward is switched (`RecurrentMixers.active`)
to one that splits the packed hidden states by row and calls the module's own forward on each
row with a one-row cache (`RowCache`, HF's own cache layers inside), as HF's `generate` does:

* a prompt chunk runs whole (HF's prefill path: a chunked scan, a convolution over the chunk);
* a decode chunk (the row's last token and its drafts) runs token by token (HF's 1-token decode
  path), and the state after each token is kept as a snapshot, keyed by the tokens it has seen.

A row's next step starts at its committed length, whatever was accepted, and resumes from the
snapshot of that length; the snapshots of rejected drafts are dropped then. Rolling back is a
lookup, so the engine's accept path never touches states.

Example: a row of 10 tokens verifies `[t10, d1, d2, d3]` (positions 10..13); snapshots 11, 12,
13 and 14 are kept. d1 is accepted and d2 rejected, so the row holds 12 tokens; its next step
feeds from position 12 and resumes from snapshot 12.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
from dataclasses import dataclass

import numpy as np
import torch

from ..base.layout import StepRows

# what a mixer's forward calls on HF's cache to keep its state (transformers 5.24's cache API,
# and MiniMax's own cache class)
_STATE_CALLS = ("update_conv_state", "update_recurrent_state", "set_linear_cache")
_CACHE_ARGS = ("cache", "cache_params", "past_key_values")  # the mixer's cache parameter, newest name first
NO_MIXER_LAYER_TYPES = ("moe", "mlp")  # config.layer_types of layers that mix no tokens (Nemotron-H)


@functools.lru_cache(maxsize=None)
def _is_mixer_class(cls: type) -> bool:
    """Whether `cls.forward` keeps a state in HF's cache and takes the cache as an argument."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    params = inspect.signature(cls.forward).parameters
    return any(c in src for c in _STATE_CALLS) and any(a in params for a in _CACHE_ARGS)


@functools.lru_cache(maxsize=None)
def _call_names(cls: type) -> tuple[str, tuple[str, ...]]:
    """A mixer class's cache parameter and the names of its forward's parameters, in order."""
    params = inspect.signature(cls.forward).parameters
    names = tuple(name for name, p in params.items() if name != "self" and p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return next(a for a in _CACHE_ARGS if a in params), names


def _text_config(model: torch.nn.Module):
    """The config of the model's language model (a composite model's text config)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def mixer_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's recurrent token mixers by layer index: modules with an int `layer_idx` whose
    forward keeps a state in HF's cache and takes the cache as an argument."""
    found = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool) and _is_mixer_class(type(m)):
            found[idx] = m
    return found


def state_only(model: torch.nn.Module) -> bool:
    """Whether every layer of the model is a recurrent mixer (Mamba): nothing in it sees positions,
    so a padded row computes as the row alone (its mixers zero the pads' inputs)."""
    config = _text_config(model)
    n = getattr(config, "num_hidden_layers", None)
    mixers = mixer_modules(model)
    return bool(mixers) and n is not None and sorted(mixers) == list(range(n))


def no_mixer_layers(model: torch.nn.Module) -> set[int]:
    """Layers whose config type mixes no tokens at all (an MLP or MoE block alone)."""
    config = _text_config(model)
    types = getattr(config, "layer_types", None) or []
    return {i for i, t in enumerate(types) if t in NO_MIXER_LAYER_TYPES}


def _state_count(model: torch.nn.Module) -> int:
    config = _text_config(model)
    return int(getattr(config, "number_of_conv_states", 1) or 1)


def _new_layer(num_states: int):
    from transformers.cache_utils import LinearAttentionLayer

    return LinearAttentionLayer(number_of_states=num_states)


def _copy_layer(layer):
    """A snapshot of one HF linear-attention cache layer: its state tensors cloned (HF updates
    them in place), its flags copied."""
    new = copy.copy(layer)
    for name in ("conv_states", "recurrent_states"):
        setattr(new, name, {i: None if t is None else t.clone() for i, t in getattr(layer, name).items()})
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                 "conv_kernel_size"):
        setattr(new, name, dict(getattr(layer, name)))
    return new


def _row_cache_class():
    from transformers.cache_utils import Cache

    try:
        from transformers.cache_utils import DummyLayer
    except ImportError:  # transformers before 5.2x: an empty layer that no mixer reads stands in
        from transformers.cache_utils import DynamicLayer as DummyLayer

    class RowCache(Cache):
        """One sequence's cache as a mixer sees it: HF's `Cache` with one real layer (a
        `LinearAttentionLayer`, or MiniMax's lightning state in `linear_cache`) at the running
        mixer's index, dummies elsewhere."""

        def __init__(self, num_layers: int):
            super().__init__(layers=[DummyLayer() for _ in range(num_layers)])
            self.linear_cache: list = [None] * num_layers

        def get_linear_cache(self, layer_idx: int):  # MiniMax's cache API
            return self.linear_cache[layer_idx]

        def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
            self.linear_cache[layer_idx] = linear_cache

    return RowCache


@dataclass(slots=True)
class _State:
    """One sequence's state in one mixer layer."""

    layer: object  # transformers' LinearAttentionLayer
    linear: torch.Tensor | None = None  # MiniMax's lightning-attention state (replaced, never updated in place)

    def copy(self) -> _State:
        return _State(_copy_layer(self.layer), self.linear)


class SequenceStates:
    """Every sequence's mixer states: per (sequence, layer), snapshots keyed by tokens seen."""

    def __init__(self, num_states: int = 1):
        self.num_states = num_states
        self._snaps: dict[tuple[int, int], dict[int, _State]] = {}

    def resume(self, seq_id: int, layer_idx: int, count: int) -> _State:
        """The state after `count` tokens (fresh at 0); every other snapshot of that layer goes."""
        snaps = self._snaps.pop((seq_id, layer_idx), {})
        if count == 0:
            return _State(_new_layer(self.num_states))
        if count not in snaps:
            raise RuntimeError(f"hf_plookup: no recurrent state of sequence {seq_id} in layer {layer_idx} after "
                               f"{count} tokens (held: {sorted(snaps)})")
        return snaps[count]

    def keep(self, seq_id: int, layer_idx: int, count: int, state: _State) -> None:
        self._snaps.setdefault((seq_id, layer_idx), {})[count] = state

    def held(self, seq_id: int, layer_idx: int) -> list[int]:
        """The token counts of the snapshots held for a sequence in a layer."""
        return sorted(self._snaps.get((seq_id, layer_idx), {}))

    def clear(self) -> None:
        self._snaps.clear()

    def __len__(self) -> int:
        return sum(len(s) for s in self._snaps.values())


_STEP: contextvars.ContextVar[tuple[StepRows, SequenceStates] | None] = contextvars.ContextVar(
    "hf_plookup_recurrent_step", default=None)


def _slice(value, lo: int, hi: int, total: int):
    """A per-token argument cut to one row's tokens (`[1, T, ...]` tensors, tuples of them:
    position embeddings); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == total:
        return value[:, lo:hi]
    if isinstance(value, tuple):
        return tuple(_slice(v, lo, hi, total) for v in value)
    return value


class RecurrentMixers:
    """The model's recurrent mixers (`mixer_modules`), switched to per-row calls with their
    sequences' states inside engine forwards (`active`)."""

    def __init__(self, model: torch.nn.Module, mixers: dict[int, torch.nn.Module] | None = None):
        self.model = model
        self.mixers = mixer_modules(model) if mixers is None else mixers
        num_layers = max(self.mixers) + 1 if self.mixers else 0
        config = _text_config(model)
        self.num_layers = max(num_layers, int(getattr(config, "num_hidden_layers", 0) or 0))
        self.states = SequenceStates(_state_count(model))
        self._row_cache = _row_cache_class() if self.mixers else None

    def __bool__(self) -> bool:
        return bool(self.mixers)

    @contextlib.contextmanager
    def active(self, rows: StepRows):
        """Run the mixers per row of `rows` for one forward, with the states in `self.states`;
        the modules' forwards are restored afterwards."""
        saved = {}
        for idx, m in self.mixers.items():
            saved[idx] = m.__dict__.get("forward")
            m.forward = self._forward(m, saved[idx] if saved[idx] is not None else type(m).forward.__get__(m))
        token = _STEP.set((rows, self.states))
        try:
            yield
        finally:
            _STEP.reset(token)
            for idx, m in self.mixers.items():
                if saved[idx] is None:
                    del m.forward
                else:
                    m.forward = saved[idx]

    def _forward(self, module: torch.nn.Module, own):
        cache_arg, names = _call_names(type(module))

        def forward(*args, **kwargs):
            step = _STEP.get()
            kwargs.update(zip(names, args))  # everything by name, so it can be cut per row
            if step is None:
                return own(**kwargs)
            rows, states = step
            hidden = kwargs.pop(names[0])  # [1, T, H]
            kwargs.pop(cache_arg, None)
            return self._run_rows(module, own, cache_arg, names[0], hidden, kwargs, rows, states)

        return forward

    def _run_rows(self, module, own, cache_arg: str, hidden_name: str, hidden: torch.Tensor, kwargs: dict,
                  rows: StepRows, states: SequenceStates):
        idx, total = module.layer_idx, hidden.shape[1]
        pieces, extra = [], None
        cache = self._row_cache(self.num_layers)  # rows run one at a time: layer `idx` holds the running row's state
        for b in range(len(rows.seq_ids)):
            seq, start, n, lo = int(rows.seq_ids[b]), int(rows.starts[b]), int(rows.lengths[b]), int(rows.offsets[b])
            state = states.resume(seq, idx, start)
            spans = [(0, n)] if rows.prefill[b] else [(j, j + 1) for j in range(n)]
            for j, (a, e) in enumerate(spans):
                cache.layers[idx], cache.linear_cache[idx] = state.layer, state.linear
                args = {k: _slice(v, lo + a, lo + e, total) for k, v in kwargs.items()}
                out = own(**{hidden_name: hidden[:, lo + a : lo + e], cache_arg: cache}, **args)
                state.linear = cache.linear_cache[idx]
                if isinstance(out, tuple):
                    out, extra = out[0], len(out)
                pieces.append(out)
                # the last token's state is kept as it is; earlier ones are copied (the next token updates it in place)
                states.keep(seq, idx, start + e, state if j == len(spans) - 1 else state.copy())
            pad = int(rows.offsets[b + 1]) - lo - n
            if pad:  # padded draft positions: never kept, so any value does
                pieces.append(hidden.new_zeros(1, pad, pieces[-1].shape[-1]))
        out = torch.cat(pieces, 1)
        return out if extra is None else (out, *([None] * (extra - 1)))
