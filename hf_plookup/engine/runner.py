"""Packs one step into model inputs and runs the HF model's own forward over the pages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata, attention_context
from ..attention.probe import input_device
from ..attention.registry import engine_attention
from ..drafting.tree import ancestor_mask, depths
from .cpu_head import HeadChooser, fast_head
from .kv_cache import BlockManager, PagedKVCache
from .scheduler import ScheduledChunk


@dataclass(slots=True)
class StepPlan:
    """One step as numpy arrays (B sequences, T packed tokens), before it becomes tensors
    (eager) or fills a CUDA graph's static buffers. Padded draft positions are fed (and get
    positions, slots and keys) but their logits are never kept."""

    input_ids: np.ndarray  # [T] int64 (0 at padded positions)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_pos: np.ndarray  # [B, Tq] int64, -1 past a sequence's chunk
    kv_slots: np.ndarray  # [B, Lk] int64, the padding slot past a context
    context_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, ceil(Lk / block_size)] int64, spare entries: the scratch page (or 0)
    cu_seqlens_q: np.ndarray  # [B+1] int64
    cu_seqlens_k: np.ndarray  # [B+1] int64
    q_gather: np.ndarray | None  # [B*Tq] int64; None when uniform
    q_scatter: np.ndarray | None  # [T] int64; None when uniform
    keep: np.ndarray  # [N] int64 packed rows whose logits are returned, in chunk order
    is_decode: bool  # no prompt chunk in this step
    tree_mask: np.ndarray | None = None  # [B, Tq, Tq] bool: candidate trees (drafting.tree); None for chains

    @property
    def num_seqs(self) -> int:
        return self.query_pos.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.query_pos.shape[1]

    @property
    def max_context_len(self) -> int:
        return self.kv_slots.shape[1]

    @property
    def uniform(self) -> bool:
        return self.q_gather is None


class ModelRunner:
    """`pad_to`: feed every sequence of a decode step exactly this many tokens (k + 1; missing
    drafts padded), so verify steps are uniform. `graphs`: a `GraphRunner` that takes the
    uniform decode steps it supports (engine.graphs); everything else runs eagerly. `head`: a
    `cpu_head.HeadChooser` for the LM head of eager CPU steps (None: the model's own).
    `invariant`: an `invariant.InvariantLinears`: every step runs in invariant mode (each token
    computed as in a 1-token step; `head` is not used, and `graphs` runs its steps in the mode too)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, blocks: BlockManager, backend: str = "sdpa",
                 pad_to: int | None = None, graphs=None, head: HeadChooser | None = None, invariant=None):
        if pad_to is not None and pad_to < 1:
            raise ValueError(f"pad_to must be >= 1 or None, got {pad_to}")
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.backend = backend
        self.pad_to = pad_to
        self.graphs = graphs
        self.head = head
        self.invariant = invariant
        self.device = input_device(model)

    def _tensor(self, a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        if dtype is not None:
            t = t.to(dtype)
        return t.to(self.device, non_blocking=True)

    def plan(self, chunks: list[ScheduledChunk], history: np.ndarray, tree_parents=None) -> StepPlan:
        """Lay out one step. `history`: [B_all, L] int64 token rows (drafts already written).
        `tree_parents(row, num_drafts)`: a candidate tree's parents for a decode chunk (None for
        chains): its nodes are fed in node order at position start + depth, each seeing only its
        ancestors within the chunk."""
        bs = self.blocks.block_size
        scratch = self.cache.scratch_block
        n_real = np.array([c.num_tokens for c in chunks], dtype=np.int64)  # [B]
        is_decode = not any(c.is_prefill for c in chunks)
        n = n_real
        if is_decode and self.pad_to is not None:
            if (n_real > self.pad_to).any():
                raise ValueError(f"a decode chunk feeds {int(n_real.max())} tokens, more than pad_to={self.pad_to}")
            n = np.full_like(n_real, self.pad_to)
        start = np.array([c.start for c in chunks], dtype=np.int64)  # [B]
        ctx = start + n  # [B]
        b, tq, lk = len(chunks), int(n.max()), int(ctx.max())
        offsets = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=offsets[1:])
        t = int(offsets[-1])

        ids = np.zeros(t, dtype=np.int64)
        pos = np.empty(t, dtype=np.int64)
        tables = np.full((b, -(-lk // bs)), scratch if scratch is not None else 0, dtype=np.int64)  # [B, W]
        keep = []
        trees = is_decode and tree_parents is not None
        tree_mask = np.zeros((b, tq, tq), dtype=bool) if trees else None
        query_pos = np.where(np.arange(tq)[None, :] < n[:, None], start[:, None] + np.arange(tq)[None, :], -1)  # [B, Tq]
        for i, c in enumerate(chunks):
            lo, m = offsets[i], c.num_tokens
            ids[lo : lo + m] = history[c.seq.row, c.start : c.start + m]
            pos[lo : offsets[i + 1]] = np.arange(c.start, c.start + n[i])
            if trees:
                parents = tree_parents(c.seq.row, m - 1)
                pos[lo : lo + m] = c.start + depths(parents)
                query_pos[i, :m] = pos[lo : lo + m]
                tree_mask[i] = ancestor_mask(parents, tq)
            table = self.blocks.table(c.seq.seq_id)
            tables[i, : len(table)] = table
            if not c.is_prefill:
                keep.extend(range(lo, lo + m))
            elif c.start + m == c.seq.prompt_len:
                keep.append(lo + m - 1)

        key_pos = np.arange(lk, dtype=np.int64)  # [Lk]
        # positions past a sequence's blocks (padded drafts) land in the scratch page via the table
        kv_slots = tables[:, key_pos // bs] * bs + key_pos % bs  # [B, Lk]
        kv_slots[key_pos[None, :] >= ctx[:, None]] = scratch * bs if scratch is not None else 0
        seq_of_token = np.repeat(np.arange(b), n)  # [T]
        # token j of a chunk is stored at cache position start + j (for a tree node: not its position)
        slot_mapping = kv_slots[seq_of_token, start[seq_of_token] + np.arange(t) - offsets[seq_of_token]]  # [T]
        if (n == tq).all():
            q_gather = q_scatter = None
        else:
            q_scatter = seq_of_token * tq + (np.arange(t) - offsets[seq_of_token])  # [T]
            q_gather = np.zeros(b * tq, dtype=np.int64)  # [B*Tq]
            q_gather[q_scatter] = np.arange(t)
        cu_k = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(ctx, out=cu_k[1:])
        return StepPlan(ids, pos, slot_mapping, query_pos, kv_slots, ctx, tables, offsets, cu_k,
                        q_gather, q_scatter, np.asarray(keep, dtype=np.int64), is_decode, tree_mask)

    def metadata(self, plan: StepPlan) -> AttentionMetadata:
        i32 = torch.int32
        return AttentionMetadata(
            kv_cache=self.cache,
            slot_mapping=self._tensor(plan.slot_mapping),
            query_pos=self._tensor(plan.query_pos),
            kv_slots=self._tensor(plan.kv_slots),
            context_lens=self._tensor(plan.context_lens),
            q_gather=None if plan.q_gather is None else self._tensor(plan.q_gather),
            q_scatter=None if plan.q_scatter is None else self._tensor(plan.q_scatter),
            num_seqs=plan.num_seqs,
            max_query_len=plan.max_query_len,
            max_context_len=plan.max_context_len,
            backend=self.backend,
            cu_seqlens_q=self._tensor(plan.cu_seqlens_q, i32),
            cu_seqlens_k=self._tensor(plan.cu_seqlens_k, i32),
            cache_seqlens=self._tensor(plan.context_lens, i32),
            block_tables=self._tensor(plan.block_tables, i32),
            tree_mask=None if plan.tree_mask is None else self._tensor(plan.tree_mask),
            invariant=self.invariant is not None,
        )

    def prepare(
        self, chunks: list[ScheduledChunk], history: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Build `input_ids` [1, T], `position_ids` [1, T], the attention metadata, and the
        packed indices whose logits are needed ([N] int64: every real token of a decode chunk,
        the last token of a prompt's final chunk)."""
        plan = self.plan(chunks, history)
        return self._tensor(plan.input_ids)[None], self._tensor(plan.positions)[None], self.metadata(plan), plan.keep

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], history: np.ndarray, tree_parents=None) -> torch.Tensor:
        """One forward. Returns the logits at the kept positions, `[N, V]`."""
        plan = self.plan(chunks, history, tree_parents)
        if self.graphs is not None and self.graphs.supports(plan):
            return self.graphs.run(plan)
        keep = plan.keep
        if len(keep) == 0:
            keep_t = torch.zeros(1, dtype=torch.long, device=self.device)  # LM head on one row, unused
        else:
            keep_t = self._tensor(keep)
        meta = self.metadata(plan)
        mode = self.invariant.active(plan, self.device) if self.invariant is not None else fast_head(self.head)
        with engine_attention(self.model), attention_context(meta), mode:
            out = self.model(
                input_ids=self._tensor(plan.input_ids)[None],
                position_ids=self._tensor(plan.positions)[None],
                attention_mask=None,
                use_cache=False,
                logits_to_keep=keep_t,
            )
        logits = out.logits[0]
        if len(keep) and logits.shape[0] != len(keep):  # a model that ignores logits_to_keep (Whisper's decoder)
            logits = logits.index_select(0, keep_t.to(logits.device))
        return logits[:0] if len(keep) == 0 else logits
