"""The loop: schedule -> propose -> run -> verify -> commit, over one `generate` call's rows."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..attention.registry import BACKEND_CHOICES, resolve_backend, resolve_block_size
from ..spec.ngram import NgramProposer
from ..spec.sampling import process_scores
from ..spec.verify import accept_greedy, accept_sampling
from ..stats import SpecStats
from .graphs import GraphRunner
from .kv_cache import BlockManager, PagedKVCache, default_num_tokens, layer_specs
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import DecodeConfig, Sequence
from .stopping import first_stops


@dataclass(slots=True)
class GenerationResult:
    new_tokens: list[np.ndarray]  # B arrays of generated tokens (EOS included, no padding)
    scores: list[list[torch.Tensor]] | None  # per row, processed scores [V] of each new token
    logits: list[list[torch.Tensor]] | None  # per row, raw logits [V] of each new token


@dataclass(slots=True)
class EngineOptions:
    """Options given to `hf_plookup.wrap(model, **options)`."""

    max_cache_tokens: int | None = None  # KV capacity in tokens (None: from available memory)
    num_blocks: int | None = None  # KV capacity in blocks (overrides max_cache_tokens)
    block_size: int | None = None  # tokens per page (None: 16, or 256 with flash_attn, which needs multiples of 256)
    max_batch_tokens: int = 1024  # token budget of one prefill step
    max_num_seqs: int = 256  # most sequences running at once
    # share of free memory for the KV cache when no capacity is given: of available RAM on CPU;
    # on CUDA of the memory left free after a warm-up forward of max_batch_tokens tokens, less
    # that forward's peak (see kv_cache.default_num_tokens)
    cache_memory_fraction: float = 0.25
    attn_backend: str = "auto"  # "auto" (flash_attn if it can run here, else sdpa) | "sdpa" | "flash_attn"
    cuda_graphs: bool = True  # capture verify steps in CUDA graphs (CUDA only; implies pad_drafts)
    pad_drafts: bool = False  # every sequence of a verify step feeds k + 1 tokens (missing drafts padded)

    def __post_init__(self) -> None:
        for name in ("max_cache_tokens", "num_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if (v is not None or name != "block_size") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("cuda_graphs", "pad_drafts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not 0.0 < self.cache_memory_fraction <= 1.0:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction!r}")
        if self.attn_backend not in BACKEND_CHOICES:
            raise ValueError(f"attn_backend must be one of {BACKEND_CHOICES}, got {self.attn_backend!r}")


class Engine:
    """Owns the paged cache (allocated on first use, kept across calls) and runs calls."""

    def __init__(self, model: torch.nn.Module, options: EngineOptions):
        self.model = model
        self.specs = layer_specs(model)
        devices = sorted({s.device for s in self.specs}, key=str)
        backend = resolve_backend(options.attn_backend, devices, sorted({s.dtype for s in self.specs}, key=str))
        # resolved: the backend that runs (what stats report) and its block size
        self.options = replace(options, attn_backend=backend, block_size=resolve_block_size(backend, options.block_size))
        self.use_graphs = options.cuda_graphs and len(devices) == 1 and devices[0].type == "cuda"
        self._graphs: GraphRunner | None = None
        self._capacity: int | None = None
        self._cache: PagedKVCache | None = None
        self.blocks: BlockManager | None = None  # the cache's blocks; all free between calls
        self._proposers: dict[tuple[int, int], NgramProposer] = {}
        self._ids = itertools.count()

    @property
    def capacity_blocks(self) -> int:
        o = self.options
        if o.num_blocks is not None:
            return o.num_blocks
        if self._capacity is None:
            tokens = o.max_cache_tokens or default_num_tokens(
                self.specs, o.cache_memory_fraction, self.model, o.max_batch_tokens
            )
            self._capacity = max(-(-tokens // o.block_size), 1)
        return self._capacity

    def check_fits(self, max_tokens: int) -> None:
        """Raise before any work if one sequence of `max_tokens` can never fit the cache."""
        cap = self.capacity_blocks * self.options.block_size
        if max_tokens > cap:
            raise ValueError(
                f"a prompt plus max_new_tokens needs {max_tokens} cache tokens but the KV cache holds {cap}; "
                "raise `max_cache_tokens` (or `num_blocks`) in hf_plookup.wrap(...)"
            )

    def cache(self) -> PagedKVCache:
        if self._cache is None:
            self._cache = PagedKVCache(self.specs, self.capacity_blocks, self.options.block_size, scratch=True)
            self.blocks = BlockManager(self._cache.num_blocks, self._cache.block_size)
        return self._cache

    def graph_runner(self) -> GraphRunner | None:
        """Captured verify steps (CUDA with cuda_graphs=True), kept across calls."""
        if self.use_graphs and self._graphs is None:
            self._graphs = GraphRunner(self.model, self.cache(), self.options.attn_backend, self.options.max_num_seqs)
        return self._graphs

    def pad_to(self, k: int) -> int | None:
        """Tokens every sequence feeds in a verify step when drafts are padded (k + 1), else None."""
        return k + 1 if self.options.pad_drafts or self.use_graphs else None

    def proposer(self, k: int, max_ngram: int) -> NgramProposer:
        key = (k, max_ngram)
        if key not in self._proposers:
            self._proposers[key] = NgramProposer(k, max_ngram)
        return self._proposers[key]

    def generate(
        self,
        prompts: list[np.ndarray],  # each [L_i] int64, padding removed
        cfg: DecodeConfig,
        stats: SpecStats | None = None,
    ) -> GenerationResult:
        """Generate every row (prompt-lookup drafts when cfg.k > 0, verified exactly)."""
        stats = stats if stats is not None else SpecStats()
        stats.num_sequences = len(prompts)
        stats.resize(cfg.k)
        stats.attn_backend = self.options.attn_backend
        cache = self.cache()
        blocks = self.blocks
        runner = ModelRunner(self.model, cache, blocks, self.options.attn_backend, self.pad_to(cfg.k), self.graph_runner())
        sched = Scheduler(blocks, self.options.max_batch_tokens, self.options.max_num_seqs)
        b, k = len(prompts), cfg.k
        extra = cfg.max_new_tokens + k + 1
        history = np.zeros((b, max(len(p) for p in prompts) + extra), dtype=np.int64)  # [B, L]
        hf_rows = None  # [B, W + extra] rows as HF lays them out, for processors and criteria
        width = 0
        if cfg.needs_hf_rows:
            width = cfg.hf_input_ids.shape[1]
            hf_rows = np.zeros((b, width + extra), dtype=np.int64)
            hf_rows[:, :width] = cfg.hf_input_ids
        seqs = []
        for row, p in enumerate(prompts):
            history[row, : len(p)] = p
            seq = Sequence(next(self._ids), row, len(p), cfg.max_new_tokens)
            seqs.append(seq)
            sched.add(seq)
        proposer = self.proposer(k, cfg.max_ngram) if k > 0 else None
        drafts = np.full((b, max(k, 1)), -1, dtype=np.int64)  # [B, k]
        n_drafts = np.zeros(b, dtype=np.int64)  # [B]
        recorded_scores = [[] for _ in range(b)] if cfg.output_scores else None
        recorded_logits = [[] for _ in range(b)] if cfg.output_logits else None

        def propose(running: list[Sequence]) -> np.ndarray:
            if proposer is None:
                return np.zeros(len(running), dtype=np.int64)
            rows = np.array([s.row for s in running])
            lengths = np.array([s.num_tokens for s in running], dtype=np.int64)
            cap = np.array([s.remaining - 1 for s in running], dtype=np.int64)
            d, nd = proposer.propose(history[rows], lengths, cap)
            drafts[rows], n_drafts[rows] = d, nd
            for s in running:  # drafts are fed (and seen by processors) right after the last token
                m = n_drafts[s.row]
                history[s.row, s.num_tokens : s.num_tokens + m] = drafts[s.row, :m]
                if hf_rows is not None:
                    hf_rows[s.row, width + s.num_generated : width + s.num_generated + m] = drafts[s.row, :m]
            return nd

        if cfg.streamer is not None:
            cfg.streamer.put(torch.from_numpy(cfg.hf_input_ids))
        try:
            while not sched.done:
                chunks = sched.schedule(propose)
                logits = runner.run(chunks, history)  # [N, V]
                stats.forwards += 1
                stats.prefill_forwards += chunks[0].is_prefill
                active = [c for c in chunks if not (c.is_prefill and c.seq.num_cached + c.num_tokens < c.seq.prompt_len)]
                for c in chunks:
                    if c.is_prefill:
                        c.seq.num_cached += c.num_tokens
                if active:
                    self._verify_and_commit(active, logits, cfg, history, hf_rows, width, drafts, stats, recorded_scores, recorded_logits)
                sched.retire_finished()
                for c in active:
                    if not c.seq.finished:
                        blocks.trim(c.seq.seq_id, c.seq.num_cached)
        finally:
            blocks.free_all()
            if cfg.streamer is not None:
                cfg.streamer.end()
        return GenerationResult(
            [history[s.row, s.prompt_len : s.num_tokens].copy() for s in seqs],
            recorded_scores,
            recorded_logits,
        )

    def _verify_and_commit(self, active, logits, cfg, history, hf_rows, width, drafts, stats, rec_scores, rec_logits):
        """Score every verified position, accept drafts, append tokens up to the first stop."""
        seqs = [c.seq for c in active]
        rows = np.array([s.row for s in seqs], dtype=np.int64)  # [S]
        n_pos = np.array([1 if c.is_prefill else c.num_tokens for c in active], dtype=np.int64)  # [S]
        offsets = np.cumsum(n_pos) - n_pos  # [S]
        num_drafts = n_pos - 1
        gen = np.array([s.num_generated for s in seqs], dtype=np.int64)  # [S] before this step
        step_drafts = drafts[rows]  # [S, k]
        if cfg.processors:
            pos_rows = np.repeat(rows, n_pos)
            pos_len = width + np.repeat(gen, n_pos) + (np.arange(n_pos.sum()) - np.repeat(offsets, n_pos))
            scores = process_scores(cfg.processors, logits, pos_rows, pos_len, hf_rows)  # [N, V]
        else:
            scores = logits.float()
        if cfg.do_sample:
            accepted, final = accept_sampling(torch.softmax(scores, dim=-1), offsets, num_drafts, step_drafts)
        else:
            accepted, final = accept_greedy(scores, offsets, num_drafts, step_drafts)
        counts = accepted + 1
        candidates = [np.append(step_drafts[i, : accepted[i]], final[i]) for i in range(len(seqs))]
        if cfg.stopping:
            starts = width + gen
            for i, s in enumerate(seqs):
                hf_rows[s.row, starts[i] : starts[i] + counts[i]] = candidates[i]
            cand_rows = np.concatenate([offsets[i] + np.arange(counts[i]) for i in range(len(seqs))])
            keep, stopped = first_stops(
                cfg.stopping, rows, starts, counts, hf_rows, scores[torch.from_numpy(cand_rows).to(scores.device)]
            )
        else:
            keep, stopped = counts, np.zeros(len(seqs), dtype=bool)
        for i, (c, seq) in enumerate(zip(active, seqs)):
            m = num_drafts[i]
            if not c.is_prefill:
                a = int(accepted[i])
                stats.drafted += int(m)
                stats.accepted += a
                for j in range(m):
                    stats.drafted_per_position[j] += 1
                    stats.accepted_per_position[j] += j < a
                seq.num_cached += 1 + a
            emitted = seq.append(history, candidates[i][: keep[i]].tolist(), cfg.eos_token_ids)
            if stopped[i] and emitted == keep[i]:
                seq.finished = True  # a stopping criterion fired on the last kept token
            if hf_rows is not None:
                hf_rows[seq.row, width + gen[i] : width + gen[i] + emitted] = candidates[i][:emitted]
            stats.row_steps += 1
            stats.new_tokens += emitted
            if rec_scores is not None:
                rec_scores[seq.row].extend(scores[offsets[i] : offsets[i] + emitted])
            if rec_logits is not None:
                rec_logits[seq.row].extend(logits[offsets[i] : offsets[i] + emitted].float())
            if cfg.streamer is not None:
                for t in candidates[i][:emitted]:
                    cfg.streamer.put(torch.tensor([int(t)]))
