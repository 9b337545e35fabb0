"""What one step feeds, on the host: `StepLayout` (the scheduled chunks packed into one row of
tokens, with everything the attention and the head need of them), its upload (`step_tensors`),
and `StepRows` (how the packed tokens split into sequences, as recurrent mixers need it).

The engine lays a step out (engine.layout), the step runners run it (steps/), the attention
backends and invariant mode read it (attention/, invariant/); it imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class StepRows:
    """How one step's packed tokens split into sequences, as the mixers need it (`B` chunks)."""

    seq_ids: np.ndarray  # [B] int64: each chunk's sequence id (keys its states)
    starts: np.ndarray  # [B] int64: tokens each sequence held before its chunk (its first token's position)
    lengths: np.ndarray  # [B] int64: real tokens of each chunk (padded drafts after them are not run)
    offsets: np.ndarray  # [B+1] int64: packed offset of each chunk
    prefill: np.ndarray  # [B] bool: a prompt chunk (run whole) or a decode chunk (token by token)

    def __post_init__(self) -> None:
        b = len(self.seq_ids)
        for name, n in (("starts", b), ("lengths", b), ("offsets", b + 1), ("prefill", b)):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StepRows.{name} must have {n} entries, got {len(getattr(self, name))}")


@dataclass(slots=True)
class StepLayout:
    """One step on the host: `B` sequences, each feeding one chunk (a prompt chunk, or a row's
    last token and its drafts), packed into `T` tokens; `Tq` is the longest chunk, `Lk` the
    longest context (cached keys plus the chunk), `N` the rows whose logits are kept.

    Queries are unpacked into a padded `[B, Tq]` grid and keys gathered into a padded `[B, Lk]`
    grid. Padded draft positions (uniform verify steps) are fed and get positions, slots and keys,
    but their logits are never kept. A candidate tree's nodes are fed in node order, stored at
    consecutive cache positions and positioned at start + depth; each sees only its ancestors
    within the chunk."""

    input_ids: np.ndarray  # [T] int64: token fed at each packed position (0 at padded draft positions)
    positions: np.ndarray  # [T] int64: position id of each fed token (a tree node: its chunk's start + its depth)
    depth: np.ndarray  # [T] int64: depth below the chunk's first token (a chain token: its index in the chunk)
    slot_mapping: np.ndarray  # [T] int64: flat cache slot written by each fed token (token j: position start + j)
    keep: np.ndarray  # [N] int64: packed rows whose logits are returned, in chunk order
    prefill: np.ndarray  # [B] bool: sequence b feeds a prompt chunk
    query_pos: np.ndarray  # [B, Tq] int64: position of each padded query (-1 past a sequence's chunk)
    kv_slots: np.ndarray  # [B, Lk] int64: cache slot of each key position (past a context: the padding slot)
    context_lens: np.ndarray  # [B] int64: keys each sequence attends to (cached + this chunk)
    block_tables: np.ndarray  # [B, W] int64, W = ceil(Lk / block_size): page ids (spare: the scratch page, or 0)
    cu_seqlens_q: np.ndarray  # [B+1] int64: packed query offsets of each sequence
    cu_seqlens_k: np.ndarray  # [B+1] int64: cumulative context lengths
    q_gather: np.ndarray | None = None  # [B*Tq] int64: packed index of each padded query; None when uniform
    q_scatter: np.ndarray | None = None  # [T] int64: padded index of each packed token; None when uniform
    tree_mask: np.ndarray | None = None  # [B, Tq, Tq] bool: chunk node j sees node i (drafting.tree); None: chains
    # [T] int64: the position each token's position embedding gets on a model that counts them
    # from its cache (positions plus the row's left pads: attention.positions); None for others
    embed_positions: np.ndarray | None = None
    # [B] int64 each chunk's sequence id and [B] int64 its real tokens (padded drafts left out):
    # what recurrent mixers key and cut their states by (mixers.recurrent); None where unused
    seq_ids: np.ndarray | None = None
    num_real: np.ndarray | None = None

    def __post_init__(self) -> None:
        b, tq = self.query_pos.shape
        t = self.input_ids.shape[0]
        for name, shape in (("positions", (t,)), ("depth", (t,)), ("slot_mapping", (t,)), ("prefill", (b,)),
                            ("context_lens", (b,)), ("cu_seqlens_q", (b + 1,)), ("cu_seqlens_k", (b + 1,)),
                            ("q_gather", (b * tq,)), ("q_scatter", (t,)), ("tree_mask", (b, tq, tq)),
                            ("embed_positions", (t,)), ("seq_ids", (b,)), ("num_real", (b,))):
            a = getattr(self, name)
            if a is not None and a.shape != shape:
                raise ValueError(f"StepLayout.{name} must be {list(shape)}, got {list(a.shape)}")
        if self.kv_slots.shape[0] != b or self.block_tables.shape[0] != b:
            raise ValueError(f"kv_slots and block_tables must have B={b} rows")
        if (self.q_gather is None) != (self.q_scatter is None):
            raise ValueError("q_gather and q_scatter go together")

    @property
    def num_seqs(self) -> int:
        return self.query_pos.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.query_pos.shape[1]

    @property
    def max_context_len(self) -> int:
        return self.kv_slots.shape[1]

    @property
    def uniform(self) -> bool:
        """True when every sequence feeds `max_query_len` tokens (verify steps, padded drafts)."""
        return self.q_gather is None

    @property
    def seq_of_token(self) -> np.ndarray:
        """[T] int64: the sequence (0..B-1) each packed token belongs to."""
        return np.repeat(np.arange(self.num_seqs), np.diff(self.cu_seqlens_q))

    @property
    def is_decode(self) -> bool:
        """No prompt chunk in this step."""
        return not self.prefill.any()

    def recurrent_rows(self) -> StepRows:
        """The step as recurrent mixers split it (needs `seq_ids` and `num_real`)."""
        return StepRows(self.seq_ids, self.positions[self.cu_seqlens_q[:-1]], self.num_real, self.cu_seqlens_q,
                        self.prefill)

    def device_arrays(self) -> dict[str, np.ndarray]:
        """What the device reads of this step (the model's inputs, the attention's layout), in the
        dtypes it reads them in; fields that are None are left out."""
        out = {}
        for name, (src, dtype) in DEVICE_ARRAYS.items():
            a = getattr(self, src)
            if a is not None:
                out[name] = np.ascontiguousarray(a, dtype=dtype)
        return out


# name on the device -> (StepLayout field, dtype). flash-attn and the Triton kernel take int32
# offsets, lengths and tables; cache_seqlens is context_lens in that form.
DEVICE_ARRAYS = {
    "input_ids": ("input_ids", np.int64), "positions": ("positions", np.int64),
    "slot_mapping": ("slot_mapping", np.int64), "query_pos": ("query_pos", np.int64),
    "kv_slots": ("kv_slots", np.int64), "context_lens": ("context_lens", np.int64),
    "q_gather": ("q_gather", np.int64), "q_scatter": ("q_scatter", np.int64),
    "cu_seqlens_q": ("cu_seqlens_q", np.int32), "cu_seqlens_k": ("cu_seqlens_k", np.int32),
    "cache_seqlens": ("context_lens", np.int32), "block_tables": ("block_tables", np.int32),
    "tree_mask": ("tree_mask", np.bool_),
}


def step_tensors(layout: StepLayout, device: torch.device | str) -> dict[str, torch.Tensor]:
    """`layout.device_arrays()` on `device`: the one upload of an eager step (a graph bucket keeps
    the same arrays in one buffer of its own, uploaded in one copy: steps.graphs.Staging)."""
    return {name: torch.from_numpy(a).to(device, non_blocking=True) for name, a in layout.device_arrays().items()}
