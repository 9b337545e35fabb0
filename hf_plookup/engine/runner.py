"""Packs one step into model inputs and runs the HF model's own forward over the pages."""

from __future__ import annotations

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata, attention_context
from ..attention.registry import engine_attention
from .kv_cache import BlockManager, PagedKVCache
from .scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, blocks: BlockManager, backend: str = "sdpa"):
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.backend = backend
        self.device = model.get_input_embeddings().weight.device

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def prepare(
        self, chunks: list[ScheduledChunk], history: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Build `input_ids` [1, T], `position_ids` [1, T], the attention metadata, and the
        packed indices whose logits are needed ([N] int64: every fed token of a decode chunk,
        the last token of a prompt's final chunk)."""
        bs = self.blocks.block_size
        n = np.array([c.num_tokens for c in chunks], dtype=np.int64)  # [B]
        start = np.array([c.start for c in chunks], dtype=np.int64)  # [B]
        ctx = start + n  # [B]
        b, tq, lk = len(chunks), int(n.max()), int(ctx.max())
        offsets = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=offsets[1:])
        t = int(offsets[-1])

        ids = np.empty(t, dtype=np.int64)
        pos = np.empty(t, dtype=np.int64)
        tables = np.zeros((b, -(-lk // bs)), dtype=np.int64)  # [B, max_blocks]
        keep = []
        for i, c in enumerate(chunks):
            lo, hi = offsets[i], offsets[i + 1]
            ids[lo:hi] = history[c.seq.row, c.start : c.start + c.num_tokens]
            pos[lo:hi] = np.arange(c.start, c.start + c.num_tokens)
            table = self.blocks.table(c.seq.seq_id)
            tables[i, : len(table)] = table
            if not c.is_prefill:
                keep.extend(range(lo, hi))
            elif c.start + c.num_tokens == c.seq.prompt_len:
                keep.append(hi - 1)

        key_pos = np.arange(lk, dtype=np.int64)  # [Lk]
        kv_slots = tables[:, key_pos // bs] * bs + key_pos % bs  # [B, Lk]
        kv_slots[key_pos[None, :] >= ctx[:, None]] = 0
        grid = np.arange(tq, dtype=np.int64)[None, :]  # [1, Tq]
        valid = grid < n[:, None]  # [B, Tq]
        query_pos = np.where(valid, start[:, None] + grid, -1)  # [B, Tq]
        seq_of_token = np.repeat(np.arange(b), n)  # [T]
        slot_mapping = kv_slots[seq_of_token, pos]  # [T]
        if (n == tq).all():
            q_gather = q_scatter = None
        else:
            q_scatter = seq_of_token * tq + (np.arange(t) - offsets[seq_of_token])  # [T]
            q_gather = np.zeros(b * tq, dtype=np.int64)  # [B*Tq]
            q_gather[q_scatter] = np.arange(t)
            q_gather, q_scatter = self._tensor(q_gather), self._tensor(q_scatter)

        meta = AttentionMetadata(
            kv_cache=self.cache,
            slot_mapping=self._tensor(slot_mapping),
            query_pos=self._tensor(query_pos),
            kv_slots=self._tensor(kv_slots),
            context_lens=self._tensor(ctx),
            q_gather=q_gather,
            q_scatter=q_scatter,
            num_seqs=b,
            max_query_len=tq,
            max_context_len=lk,
            backend=self.backend,
        )
        return self._tensor(ids)[None], self._tensor(pos)[None], meta, np.asarray(keep, dtype=np.int64)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], history: np.ndarray) -> torch.Tensor:
        """One forward. Returns the logits at the kept positions, `[N, V]` in fp32."""
        input_ids, position_ids, meta, keep = self.prepare(chunks, history)
        if len(keep) == 0:
            keep_t = torch.zeros(1, dtype=torch.long, device=self.device)  # LM head on one row, unused
        else:
            keep_t = self._tensor(keep)
        with engine_attention(self.model), attention_context(meta):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=None,
                use_cache=False,
                logits_to_keep=keep_t,
            )
        logits = out.logits[0]
        return logits[:0] if len(keep) == 0 else logits
