"""Lays one step out (`ModelRunner.layout`: the scheduled chunks as one `StepLayout`) and runs the
HF model's own forward on it over the pages (`ModelRunner.run`)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata, StepLayout, attention_context, step_tensors
from ..attention.positions import given_positions
from ..attention.probe import input_device
from ..attention.registry import engine_attention
from ..drafting.tree import ancestor_mask, depths
from ..cpu.head import HeadChooser, fast_head
from .kv_cache import BlockManager, PagedKVCache
from .scheduler import ScheduledChunk


class ModelRunner:
    """`pad_to`: feed every sequence of a decode step exactly this many tokens (k + 1; missing
    drafts padded), so verify steps are uniform. `graphs`: a `GraphRunner` that takes the
    uniform decode steps it supports (cuda.graphs); everything else runs eagerly. `head`: a
    `cpu_head.HeadChooser` for the LM head of eager CPU steps (None: the model's own).
    `invariant`: an `invariant.InvariantLinears`: every step runs in invariant mode (each token
    computed as in a 1-token step; `head` is not used, and `graphs` runs its steps in the mode too).
    `embedders`: the model's position embedders that count positions from a cache
    (attention.positions), handed each step's `embed_positions`. `mixers`: the model's recurrent
    mixers (mixers.recurrent.RecurrentMixers), run per row with their sequences' states."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, blocks: BlockManager, backend: str = "sdpa",
                 pad_to: int | None = None, graphs=None, head: HeadChooser | None = None, invariant=None,
                 embedders: list[torch.nn.Module] | None = None, mixers=None):
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
        self.embedders = embedders or []
        self.mixers = mixers
        self.device = input_device(model)
        # how the last `run` ran (SpecStats.decode_steps_by_path) and, for a decode step that ran
        # eagerly although `graphs` is given, why (GraphRunner.unsupported)
        self.last_path = "eager"
        self.last_reason: str | None = None

    def layout(self, chunks: list[ScheduledChunk], history: np.ndarray, parents: np.ndarray | None = None,
               pads: np.ndarray | None = None, pad_to: int | None = None) -> StepLayout:
        """Lay out one step. `history`: [B_all, L] int64 token rows (drafts already written after
        each row's last token). `parents`: [B_all, K] int64, the batch's draft-node parents (a
        row's first `num_tokens - 1` entries are its chunk's; chunk indices), or None for chains.
        With parents, every decode chunk is a tree (a chain is the tree whose node j has parent
        j - 1) and the step carries a tree mask; prompt chunks stay chains. `pads`: [B_all] int64
        each row's left pads in its call's input, for `embed_positions` (with `embedders` only).
        `pad_to`: this step's width where the runner pads decode steps (default: its own)."""
        bs = self.blocks.block_size
        scratch = self.cache.scratch_block
        pad_page = scratch if scratch is not None else 0
        n_real = np.array([c.num_tokens for c in chunks], dtype=np.int64)  # [B]
        prefill = np.array([c.is_prefill for c in chunks], dtype=bool)  # [B]
        n = n_real
        width = self.pad_to if pad_to is None else pad_to
        if not prefill.any() and width is not None:
            if (n_real > width).any():
                raise ValueError(f"a decode chunk feeds {int(n_real.max())} tokens, more than pad_to={width}")
            n = np.full_like(n_real, width)
        start = np.array([c.start for c in chunks], dtype=np.int64)  # [B]
        ctx = start + n  # [B]
        b, tq, lk = len(chunks), int(n.max()), int(ctx.max())
        offsets = np.zeros(b + 1, dtype=np.int64)  # [B+1]
        np.cumsum(n, out=offsets[1:])
        t = int(offsets[-1])
        seq_of_token = np.repeat(np.arange(b), n)  # [T]
        index = np.arange(t) - offsets[seq_of_token]  # [T] each token's index in its chunk

        ids = np.zeros(t, dtype=np.int64)
        depth = index.copy()  # chains; tree nodes below
        tables = np.full((b, -(-lk // bs)), pad_page, dtype=np.int64)  # [B, W]
        trees = parents is not None and not prefill.all()
        tree_mask = np.zeros((b, tq, tq), dtype=bool) if trees else None
        keep = []
        for i, c in enumerate(chunks):
            lo, m = offsets[i], c.num_tokens
            ids[lo : lo + m] = history[c.seq.row, c.start : c.start + m]
            if trees:
                par = np.arange(m - 1) if c.is_prefill else parents[c.seq.row, : m - 1]  # [m-1]
                depth[lo : lo + m] = depths(par)
                tree_mask[i] = ancestor_mask(par, tq)
            table = self.blocks.table(c.seq.seq_id)
            tables[i, : len(table)] = table
            if not c.is_prefill:
                keep.extend(range(lo, lo + m))
            elif c.start + m == c.seq.prompt_len:
                keep.append(lo + m - 1)
        pos = start[seq_of_token] + depth  # [T]
        query_pos = np.full((b, tq), -1, dtype=np.int64)  # [B, Tq]
        query_pos[seq_of_token, index] = pos

        key_pos = np.arange(lk, dtype=np.int64)  # [Lk]
        # positions past a sequence's blocks (padded drafts) land in the scratch page via the table
        kv_slots = tables[:, key_pos // bs] * bs + key_pos % bs  # [B, Lk]
        kv_slots[key_pos[None, :] >= ctx[:, None]] = pad_page * bs
        # token j of a chunk is stored at cache position start + j (a tree node too, whatever its depth)
        slot_mapping = kv_slots[seq_of_token, start[seq_of_token] + index]  # [T]
        q_gather = q_scatter = None
        if (n != tq).any():
            q_scatter = seq_of_token * tq + index  # [T]
            q_gather = np.zeros(b * tq, dtype=np.int64)  # [B*Tq]
            q_gather[q_scatter] = np.arange(t)
        cu_k = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(ctx, out=cu_k[1:])
        embed_pos = None
        if self.embedders and pads is not None:
            embed_pos = pos + pads[np.array([c.seq.row for c in chunks], dtype=np.int64)][seq_of_token]  # [T]
        return StepLayout(input_ids=ids, positions=pos, depth=depth, slot_mapping=slot_mapping,
                          keep=np.asarray(keep, dtype=np.int64), prefill=prefill, query_pos=query_pos,
                          kv_slots=kv_slots, context_lens=ctx, block_tables=tables, cu_seqlens_q=offsets,
                          cu_seqlens_k=cu_k, q_gather=q_gather, q_scatter=q_scatter, tree_mask=tree_mask,
                          embed_positions=embed_pos, seq_ids=np.array([c.seq.seq_id for c in chunks], dtype=np.int64),
                          num_real=n_real)

    @torch.inference_mode()
    def run(self, layout: StepLayout) -> torch.Tensor:
        """One forward. Returns the logits at `layout.keep`, `[N, V]`."""
        self.last_path, self.last_reason = "eager", None
        if self.graphs is not None:
            reason = self.graphs.unsupported(layout)
            if reason is None:
                self.last_path = self.graphs.path
                return self.graphs.run(layout)
            if not layout.prefill.all():  # a decoding row runs eagerly
                self.last_reason = reason
        tensors = step_tensors(layout, self.device)
        keep = layout.keep
        # no kept row (a prompt chunk that does not end its prompt): the LM head on one row, unused
        keep_t = torch.from_numpy(keep if len(keep) else np.zeros(1, np.int64)).to(self.device, non_blocking=True)
        layers = self.invariant.layers if self.invariant is not None else None
        if layers is not None and layers.takes(layout) and layout.embed_positions is None and not self.mixers:
            return layers.run(layout, tensors["input_ids"], tensors["positions"], keep_t, self.cache,
                              lambda: self._forward(layout, tensors, keep_t))
        logits = self._forward(layout, tensors, keep_t)
        return logits[:0] if len(keep) == 0 else logits

    def _forward(self, layout: StepLayout, tensors: dict[str, torch.Tensor], keep_t: torch.Tensor) -> torch.Tensor:
        """The step through the model's own forward: logits at `keep_t`."""
        meta = AttentionMetadata.of(tensors, self.cache, self.backend, invariant=self.invariant is not None)
        mode = self.invariant.active(layout, self.device) if self.invariant is not None else fast_head(self.head)
        embed = contextlib.nullcontext()
        if layout.embed_positions is not None:
            embed = given_positions(self.embedders, torch.from_numpy(layout.embed_positions).to(self.device))
        recurrent = self.mixers.active(layout.recurrent_rows()) if self.mixers else contextlib.nullcontext()
        with engine_attention(self.model), attention_context(meta), mode, embed, recurrent:
            out = self.model(
                input_ids=tensors["input_ids"][None],
                position_ids=tensors["positions"][None],
                attention_mask=None,
                use_cache=False,
                logits_to_keep=keep_t,
            )
        logits = out.logits[0]
        if len(layout.keep) and logits.shape[0] != len(layout.keep):  # a model that ignores logits_to_keep (Whisper's decoder)
            logits = logits.index_select(0, keep_t.to(logits.device))
        return logits
