"""Invariant attention: every query's reduction over keys is the same whatever the step holds.

In invariant mode (invariant.linears) a token's attention must come out bitwise the same in a
1-token step, a verify step of k+1 tokens, a candidate-tree step, alone or beside other rows.
One padded SDPA call over a step does not give that: its kernels split queries and keys into
blocks by the call's shapes, and a masked key placed between visible ones moves the others
into other vector lanes (measured on this project's CPU: rows of a 5-query call differ from
1-query calls in fp32 and bf16). So, by construction:

- **decode tokens** (1-token, verify and tree steps), on CPU: `cpu.kernels.attend`, one
  query head over exactly its visible keys read in place from the pages, in position order, with
  one fixed order of arithmetic per query. A tree node's keys are the context then its ancestors,
  which is what the same token sees in a chain. Elsewhere (or without the compiled kernels): one
  SDPA call per query, `q [1, H, 1, D]` over exactly its keys in position order, `[1, H_kv, L,
  D]`, no mask: the call HF's own batch-1 decode makes. A sequence's keys are gathered once per
  layer into HF's layout and each of its chain tokens reads a run of them.
- **prompt chunks**: one call per sequence and chunk over exactly that sequence's keys. The
  scheduler cuts prompts at fixed offsets in invariant mode (`Scheduler(aligned_prefill=True)`),
  so a prompt's chunks, and with them its keys and values, do not depend on the other rows.

`InvariantLayout` is built once per step from the step's `base.layout.StepLayout`; the sdpa backend calls
`invariant_attend` when one is active (`invariant_layout`)."""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np
import torch

from ..cpu import kernels as cpu_kernels
from ..base.dense import attend
from ..base.layout import StepLayout


class InvariantLayout:
    """One step's queries as invariant attention sees them.

    `prefill`: (packed offset, tokens, sequence, first cache position) per prompt chunk.
    `decode`: (packed index, sequence, position, visible cache positions [L] in order) per
    decode token. `kv_slots` [B, Lk] maps a sequence's cache positions to flat slots."""

    def __init__(self, num_tokens: int, kv_slots: np.ndarray, positions: np.ndarray,
                 prefill: list[tuple[int, int, int, int]], decode: list[tuple[int, int, int, np.ndarray]],
                 device: torch.device):
        self.num_tokens = num_tokens
        self.kv_slots = kv_slots  # [B, Lk] int64
        self.positions = positions  # [B, Lk] int64: the position id held at each cache position (trees: start + depth)
        self.prefill = prefill
        self.decode = decode
        self.device = device
        # packed row groups for row-invariant linear layers, in order: (start, end, is_prefill), each
        # prompt chunk apart, consecutive decode tokens together
        self.row_groups: list[tuple[int, int, bool]] = []
        for lo, n, is_prefill in sorted([(lo, n, True) for lo, n, _, _ in prefill] + [(t, 1, False) for t, _, _, _ in decode]):
            last = self.row_groups[-1] if self.row_groups else None
            if not is_prefill and last is not None and not last[2] and last[1] == lo:
                self.row_groups[-1] = (last[0], lo + n, False)
            else:
                self.row_groups.append((lo, lo + n, is_prefill))
        self.has_prefill = bool(prefill)
        # the query groups attention runs one SDPA call for: (packed offset, queries), prompt chunks first
        self.query_groups = [(lo, n) for lo, n, _, _ in prefill] + [(t, 1) for t, _, _, _ in decode]
        self._keys: dict = {}  # window -> keys(window)
        self._runs: dict = {}  # window -> decode_runs(window)

    def keys(self, window: int | None):
        """Per window, which keys each query group reads, gathered once per step and layer.

        Returns (idx, bases, views, masks): `idx` [sum of base lengths] flat cache slots;
        `bases` (offset, length) of each gathered key run in `idx`; `views` per group (prompt
        chunks, then decode tokens): (base, start, length), the group's keys being
        `base[start : start + length]`; `masks` per prompt chunk piece ([n, L] bool or None). A
        sequence's prompt chunk has one base that its pieces read from its start; its decode tokens
        share one (its context then the chunk's tokens) when their keys are a run of it (chain
        steps, so gathering costs one copy per sequence, not per token), else a tree node or
        windowed token gets its own."""
        got = self._keys.get(window)
        if got is not None:
            return got
        parts, bases, views, masks = [], [], [], []
        off = 0

        def add_base(slots: np.ndarray) -> int:
            nonlocal off
            parts.append(slots)
            bases.append((off, len(slots)))
            off += len(slots)
            return len(bases) - 1

        ends: dict[int, int] = {}  # sequence -> where its prompt chunk ends
        for _, n, b, start in self.prefill:
            ends[b] = max(ends.get(b, 0), start + n)
        prompt_bases: dict[int, int] = {}  # sequence -> the base its chunk's pieces read
        for lo, n, b, start in self.prefill:
            L = start + n
            if b not in prompt_bases:
                prompt_bases[b] = add_base(self.kv_slots[b, : ends[b]])
            views.append((prompt_bases[b], 0, L))
            q = np.arange(start, L)[:, None]  # [n, 1] positions of the chunk
            k = np.arange(L)[None, :]  # [1, L]
            if start == 0 and not (window and L > window):
                masks.append(None)  # plain causal
            else:
                m = k <= q
                if window:
                    m &= k > q - window
                masks.append(torch.from_numpy(m).to(self.device))
        shared: dict[int, tuple[int, np.ndarray]] = {}  # sequence -> (base, cache positions it holds)
        for _, b, cpos in self.visible(window):
            if b not in shared:
                run = max((c for _, bb, _, c in self.decode if bb == b), key=len)  # the longest query's keys
                shared[b] = (add_base(self.kv_slots[b, run]), run)
            base, run = shared[b]
            lo = int(np.searchsorted(run, cpos[0])) if len(cpos) else 0
            if len(cpos) and lo + len(cpos) <= len(run) and np.array_equal(run[lo : lo + len(cpos)], cpos):
                views.append((base, lo, len(cpos)))
            else:
                views.append((add_base(self.kv_slots[b, cpos]), 0, len(cpos)))
        idx = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64)).to(self.device)
        got = self._keys[window] = (idx, bases, views, masks)
        return got

    def visible(self, window: int | None):
        """Per decode token, the cache positions it reads (in order) under `window`."""
        for t, b, pos, cpos in self.decode:
            yield t, b, (cpos[self.positions[b, cpos] > pos - window] if window else cpos)

    def decode_runs(self, window: int | None):
        """The decode tokens' keys as `cpu_kernels.attend` takes them, built once per step and window:
        (seq [Td], run_lo [Td], run_hi [Td], extra_off [Td+1], extra [E]), Td in packed order.
        A token's keys are the run of cache positions run_lo..run_hi-1 (its context, and for a chain
        the chunk up to itself), then `extra` (a tree node's ancestors and itself)."""
        got = self._runs.get(window)
        if got is None:
            n = len(self.decode)
            seq, lo, hi = (np.zeros(n, np.int64) for _ in range(3))
            extra_off = np.zeros(n + 1, np.int64)
            extras = []
            for i, (_, b, cpos) in enumerate(self.visible(window)):
                seq[i] = b
                if len(cpos):
                    run = int(np.sum(cpos == cpos[0] + np.arange(len(cpos))))  # cpos is sorted: a run, then the rest
                    lo[i], hi[i] = cpos[0], cpos[0] + run
                    extras.append(cpos[run:])
                    extra_off[i + 1] = extra_off[i] + len(cpos) - run
                else:
                    extra_off[i + 1] = extra_off[i]
            extra = np.concatenate(extras) if extras else np.zeros(0, np.int64)
            got = self._runs[window] = (seq, lo, hi, extra_off, extra)
        return got


def build_layout(step: StepLayout, device: torch.device, prefill_unit: int | None = None) -> InvariantLayout:
    """The invariant layout of one step. A prompt chunk is cut at multiples of `prefill_unit`
    positions from the prompt's start (the scheduler's units): each piece is its own attention
    call and its own row group, so the chunk's bits do not depend on how many units the step gave
    it. Example: a chunk of positions 100..399 with units of 128 gives the pieces 100..127,
    128..255, 256..383 and 384..399."""
    offsets = step.cu_seqlens_q
    prefill, decode = [], []
    positions = np.zeros_like(step.kv_slots)  # [B, Lk]
    for b in range(step.num_seqs):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        n = hi - lo
        qp = step.query_pos[b, :n]
        start = int(qp[0])  # the chunk's first position (a tree's root)
        positions[b] = np.arange(positions.shape[1])
        positions[b, start : start + n] = qp
        if step.prefill[b]:
            u = prefill_unit
            cuts = [start, *range(start - start % u + u, start + n, u)] if u else [start]
            for c0, c1 in zip(cuts, [*cuts[1:], start + n]):
                prefill.append((lo + c0 - start, c1 - c0, b, c0))
            continue
        ctx = np.arange(start)
        for j in range(n):
            inside = np.flatnonzero(step.tree_mask[b, j, :n]) if step.tree_mask is not None else np.arange(j + 1)
            decode.append((lo + j, b, int(qp[j]), np.concatenate([ctx, start + inside])))
    return InvariantLayout(int(offsets[-1]), step.kv_slots, positions, prefill, decode, device)


_LAYOUT: contextvars.ContextVar[InvariantLayout | None] = contextvars.ContextVar("hf_plookup_invariant", default=None)


def current_layout() -> InvariantLayout | None:
    return _LAYOUT.get()


@contextlib.contextmanager
def invariant_layout(layout: InvariantLayout | None):
    """Make `layout` visible to the attention function and the linear layers for one forward."""
    token = _LAYOUT.set(layout)
    try:
        yield layout
    finally:
        _LAYOUT.reset(token)


def invariant_attend(layout: InvariantLayout, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     scale: float, sliding_window: int | None, softcap: float | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Packed queries `[1, H, T, D]` over one layer's pages `[num_blocks, block_size, H_kv, D]`
    (K/V already written) -> `[1, T, H, D]`, each query computed as described above."""
    window = sliding_window if sliding_window else None
    # a decode step (the scheduler never mixes prompt chunks into one) on CPU: the C kernel
    # (attention sinks are not in the C kernel: their queries take the per-query path below)
    if (not layout.prefill and sinks is None and k_cache.device.type == "cpu" and k_cache.dtype in cpu_kernels.DTYPES
            and cpu_kernels.available()):
        seq, lo, hi, extra_off, extra = layout.decode_runs(window)
        q = query[0].transpose(0, 1).to(k_cache.dtype)  # [T, H, D]
        return cpu_kernels.attend(q, k_cache, v_cache, layout.kv_slots, seq, lo, hi, extra_off, extra, scale,
                                  softcap).to(query.dtype)[None]
    idx, bases, views, masks = layout.keys(window)
    k_all = k_cache.view(-1, *k_cache.shape[-2:]).index_select(0, idx)  # [sum L, H_kv, D]
    v_all = v_cache.view(-1, *v_cache.shape[-2:]).index_select(0, idx)  # [sum L, H_kv, Dv]
    if k_all.dtype != query.dtype:
        k_all, v_all = k_all.to(query.dtype), v_all.to(query.dtype)
    # each base as HF's cache holds keys: [1, H_kv, L, D], contiguous; a group reads a run of L
    k_bases = [k_all[o : o + n].transpose(0, 1).contiguous()[None] for o, n in bases]
    v_bases = [v_all[o : o + n].transpose(0, 1).contiguous()[None] for o, n in bases]
    out = query.new_empty(query.shape[2], query.shape[1], v_cache.shape[-1])  # [T, H, Dv]
    for g, ((lo, n), (base, start, L)) in enumerate(zip(layout.query_groups, views)):
        k = k_bases[base][:, :, start : start + L]
        v = v_bases[base][:, :, start : start + L]
        mask = masks[g] if g < len(masks) else None
        causal = g < len(masks) and mask is None and n > 1
        o = attend(query[:, :, lo : lo + n], k, v, mask, scale, softcap, is_causal=causal, sinks=sinks)  # [1, H, n, D]
        out[lo : lo + n] = o[0].transpose(0, 1)
    return out[None]
