"""One step's layout, from the scheduler to the kernels, and the context that makes it visible to
the attention function.

The engine packs every sequence of a step into one row of `T` tokens. The runner lays the step
out once, on the host, as a `StepLayout` (numpy); CUDA-graph steps pad it to their bucket
(steps.graphs.pad_layout, again a `StepLayout`). What the attention reads of it goes to the
device once (`step_tensors`: a graph's static buffers are these tensors), and
`AttentionMetadata.of` wraps those tensors for the backends, in eager, graph and compiled steps
alike. The attention function (registered with transformers' `AttentionInterface`) is called by
the HF model's own attention modules and finds the metadata here, through a `ContextVar` set
around the forward, never through forward kwargs (not every architecture passes them through).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right

from ..base.layout import StepLayout


@dataclass(slots=True)
class AttentionMetadata:
    """The device half of a `StepLayout`, as the attention backends read it (sizes as the
    layout's: `B`, `T`, `Tq`, `Lk`). Built by `AttentionMetadata.of` from `step_tensors`."""

    kv_cache: "PagedKVCache"  # noqa: F821  the pages (engine.kv_cache.PagedKVCache); None inside the compiled op
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot written by each packed token
    query_pos: torch.Tensor  # [B, Tq] int64: absolute position of each padded query (-1 for padding)
    kv_slots: torch.Tensor  # [B, Lk] int64: cache slot of each key position
    context_lens: torch.Tensor  # [B] int64: keys each sequence attends to (cached + this chunk)
    q_gather: torch.Tensor | None = None  # [B*Tq] int64 packed index of each padded query; None when uniform
    q_scatter: torch.Tensor | None = None  # [T] int64 padded index of each packed token; None when uniform
    # varlen/paged-kernel view of the same step (flash_attn, triton); None where a test leaves it out
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32: packed query offsets of each sequence
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32: cumulative context lengths (keys per sequence)
    cache_seqlens: torch.Tensor | None = None  # [B] int32: context_lens as int32
    block_tables: torch.Tensor | None = None  # [B, W] int32: page ids per sequence (spare entries: a scratch page)
    # candidate-tree steps (drafting.tree): chunk node j of sequence b may see chunk node i when
    # tree_mask[b, j, i]; each chunk starts at query_pos[b, 0] (its root). None: causal chunks.
    tree_mask: torch.Tensor | None = None  # [B, Tq, Tq] bool
    backend: str = "sdpa"  # attention backend that runs this step
    # CUDA-graph and compiled steps: B and Lk are buckets (Lk longer than the contexts), so masks
    # must come from the tensors above, never from shape shortcuts decided on the host at capture
    static_shapes: bool = False
    # invariant mode (invariant.linears): kernels that take it compute each query independently
    # of the rest of the step (attention.triton's invariant form)
    invariant: bool = False
    _masks: dict = field(default_factory=dict)  # sliding window (or None) -> [B, 1, Tq, Lk] bool

    def __post_init__(self) -> None:
        if self.slot_mapping.dim() != 1:
            raise ValueError("slot_mapping must be 1-D [T]")
        if self.query_pos.dim() != 2 or self.kv_slots.dim() != 2 or self.kv_slots.shape[0] != self.query_pos.shape[0]:
            raise ValueError(f"query_pos [B, Tq] and kv_slots [B, Lk] must agree on B, got "
                             f"{list(self.query_pos.shape)} and {list(self.kv_slots.shape)}")
        if (self.q_gather is None) != (self.q_scatter is None):
            raise ValueError("q_gather and q_scatter go together")
        b = self.num_seqs
        for name, shape in (("context_lens", (b,)), ("cu_seqlens_q", (b + 1,)), ("cu_seqlens_k", (b + 1,)),
                            ("cache_seqlens", (b,))):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
        if self.block_tables is not None and (self.block_tables.dim() != 2 or self.block_tables.shape[0] != b):
            raise ValueError(f"block_tables must be [B={b}, W], got {list(self.block_tables.shape)}")

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], kv_cache=None, backend: str = "sdpa", static_shapes: bool = False,
           invariant: bool = False) -> AttentionMetadata:
        """The metadata over `tensors` (named as `DEVICE_ARRAYS`: `step_tensors` of a layout, a
        graph's static buffers, or the compiled op's arguments); names it does not hold are skipped."""
        return cls(kv_cache, **{name: tensors.get(name) for name in _TENSOR_FIELDS}, backend=backend,
                   static_shapes=static_shapes, invariant=invariant)

    @property
    def num_seqs(self) -> int:  # B
        return self.query_pos.shape[0]

    @property
    def max_query_len(self) -> int:  # Tq
        return self.query_pos.shape[1]

    @property
    def max_context_len(self) -> int:  # Lk
        return self.kv_slots.shape[1]

    @property
    def uniform(self) -> bool:
        """True when every sequence feeds `max_query_len` tokens (verify steps, padded drafts)."""
        return self.q_gather is None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def sdpa_mask(self, sliding_window: int | None):
        """The cheapest mask SDPA can take for this step: none for one sequence feeding one
        token, a lower-right causal bias for one sequence feeding several (both let SDPA pick
        its fused kernels), else the explicit boolean mask."""
        if (self.num_seqs == 1 and not self.static_shapes and self.tree_mask is None and not (sliding_window and self.max_context_len > sliding_window)):
            if self.max_query_len == 1:
                return None
            return causal_lower_right(self.max_query_len, self.max_context_len)
        return self.mask(sliding_window)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, Tq, Lk] bool, True where a query may attend to a key (`step_mask`), cached per window."""
        key = sliding_window if sliding_window else None
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = step_mask(self.query_pos, self.context_lens, self.max_context_len, key,
                                             self.tree_mask)
        return m


# the metadata's tensors (AttentionMetadata.of picks them by name)
_TENSOR_FIELDS = tuple(f.name for f in fields(AttentionMetadata) if f.type.startswith("torch.Tensor"))


def step_mask(query_pos: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
              sliding_window: int | None, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, Tq, Lk] bool, True where a query may attend to a key: causal, within the context,
    and within `sliding_window` keys when given, as HF counts it. With `tree_mask` [B, Tq, Tq]
    (candidate trees), a query sees the keys before its chunk (the window applied) and, inside
    the chunk, the nodes its tree_mask row marks (its ancestors and itself)."""
    key_pos = torch.arange(max_context_len, device=query_pos.device)[None, None, :]  # [1, 1, Lk]
    q = query_pos[:, :, None]  # [B, Tq, 1]
    in_context = key_pos < context_lens[:, None, None]
    if tree_mask is None:
        m = (key_pos <= q) & in_context
        if sliding_window:
            m = m & (key_pos > q - sliding_window)
    else:
        start = query_pos[:, :1, None]  # [B, 1, 1] the root's position = the chunk's first key
        before = key_pos < start
        if sliding_window:
            before = before & (key_pos > q - sliding_window)
        rel = (key_pos - start).clamp(0, tree_mask.shape[-1] - 1)  # [B, 1, Lk] chunk node held by each key
        inside = torch.gather(tree_mask, 2, rel.expand(-1, tree_mask.shape[1], -1)) & (key_pos >= start) & in_context
        if sliding_window:  # a chunk key's position is its node's (start + depth), not its slot
            node_pos = torch.gather(query_pos, 1, rel[:, 0, :])[:, None, :]  # [B, 1, Lk]
            inside = inside & (node_pos > q - sliding_window)
        m = before | inside
    # padded query rows attend to key 0 so softmax stays finite; their output is dropped
    m[:, :, 0] |= q[:, :, 0] < 0
    return m[:, None]


_CURRENT: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "hf_plookup_attention_metadata", default=None
)


class _CompiledStep:
    """Where a compiled step finds its metadata: torch.compile cannot trace `ContextVar.get`, but
    it can read a module-level object's attribute (it guards on it, so each graph bucket's
    metadata object gets its own compiled graph). One compiled forward at a time, by the lock.
    `layer_kv`: in regional compilation (steps.regional), the running layer's pages, set inside
    the compiled layer from its inputs, so one compiled layer serves every layer."""

    def __init__(self) -> None:
        self.meta: AttentionMetadata | None = None
        self.layer_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.lock = threading.Lock()


_COMPILED_STEP = _CompiledStep()


@contextlib.contextmanager
def compiled_step_context(meta: AttentionMetadata):
    """Make `meta` visible to the attention function inside a compiled forward."""
    with _COMPILED_STEP.lock:
        _COMPILED_STEP.meta = meta
        try:
            yield meta
        finally:
            _COMPILED_STEP.meta = None
            _COMPILED_STEP.layer_kv = None


def current_metadata() -> AttentionMetadata:
    if torch.compiler.is_compiling():
        return _COMPILED_STEP.meta
    meta = _CURRENT.get()
    if meta is None:
        raise RuntimeError(
            "the hf_plookup attention function ran outside an engine forward: the HF model was called "
            "directly (another thread?) while an hf_plookup generate call had its attention switched; call "
            "the wrapped model instead (it waits for the running generate) or call it outside generate calls"
        )
    return meta


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata):
    """Make `meta` visible to the attention function for the duration of one forward."""
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def compiled_layer_kv() -> tuple[torch.Tensor, torch.Tensor] | None:
    """The running layer's (k_cache, v_cache) in a regionally compiled step (steps.regional), else None."""
    return _COMPILED_STEP.layer_kv


def set_compiled_layer_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Called inside a compiled layer with that layer's pages (traced: the pages are the layer's inputs)."""
    _COMPILED_STEP.layer_kv = (k_cache, v_cache)
