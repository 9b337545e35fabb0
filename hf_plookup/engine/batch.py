"""The rows of one engine loop: their token history, drafts, and which `generate` call each
row belongs to (calls that arrive while a loop runs join it; see engine.Engine.generate)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import time

import numba
import numpy as np
import torch

from ..base.layout import StepLayout
from ..drafting.ngram import NgramProposer
from ..drafting.recycle import SuccessorTable
from ..drafting.sampling import bans_only, process_scores
from ..drafting.suffix import SuffixIndex
from ..drafting.tree import TreeProposer, acceptance_estimate, chain_budget, compaction, walks_rejected
from ..drafting.verify import accept_paths, chain_parents, position_uniforms, row_seeds, sample_targets
from ..stats import SpecStats
from ..steps.head_screen import Argmax, Bans
from .budget import Acceptance, DraftBudget, choose_drafts
from .chains import TALLY_MIN_ROWS, accept_chains, chain_chances_of, count_chain_rows
from .scheduler import ScheduledChunk, Scheduler
from .sequence import DecodeConfig, Sequence
from .stopping import BatchCriteria


@dataclass(slots=True)
class GenerationResult:
    new_tokens: list[np.ndarray]  # B arrays of generated tokens (EOS included, no padding)
    scores: list[list[torch.Tensor]] | None  # per row, processed scores [V] of each new token
    logits: list[list[torch.Tensor]] | None  # per row, raw logits [V] of each new token
    # per row, per layer (K, V) [H_kv, n, D] of its cached tokens (DecodeConfig.keep_kv), else None
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None


@dataclass(slots=True)
class Call:
    """One `generate` call's share of a loop: its prompts, config, stats and, once its rows are
    done, its result (or the error that ended the loop)."""

    prompts: list[np.ndarray]  # each [L_i] int64, padding removed
    cfg: DecodeConfig
    stats: SpecStats
    seqs: list[Sequence] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None
    seed: int = 0  # sampling: drawn from torch's generator when the call's loop starts (drafting.verify)


@numba.njit(cache=True, nogil=True)
def store_drafts(history, rows, lengths, drafts, num_drafts, most, batch_drafts, batch_num_drafts):
    """A step's drafts into the batch, in one compiled call (numpy's fancy indexing takes a few
    calls of fixed cost that outweigh the few tokens a step writes): each row's drafts count is
    cut to `most` (num_drafts, in place), its drafts [B, K'] go to batch_drafts[rows[b], :K'] and
    their count to batch_num_drafts[rows[b]], and the drafts it feeds into history right after
    its last token: history[rows[b], lengths[b] + j] = drafts[b, j] for j < num_drafts[b].

    Example: rows [1], lengths [3], drafts [[7, 8, 9]], num_drafts [3], most 2: num_drafts
    becomes [2], batch_drafts[1, :3] = [7, 8, 9], batch_num_drafts[1] = 2, history[1, 3:5] = [7, 8]."""
    for b in range(rows.shape[0]):
        r = rows[b]
        num_drafts[b] = min(num_drafts[b], most)
        batch_num_drafts[r] = num_drafts[b]
        for j in range(drafts.shape[1]):
            batch_drafts[r, j] = drafts[b, j]
        for j in range(num_drafts[b]):
            history[r, lengths[b] + j] = drafts[b, j]


def joinable(running: DecodeConfig, cfg: DecodeConfig) -> bool:
    """Whether a call with `cfg` can join a loop running `running`: the same drafting and stop
    tokens, greedy, and nothing that needs rows laid out as HF lays them out (processors,
    criteria, streamers, recorded scores) on either side."""
    def plain(c: DecodeConfig) -> bool:
        return not (c.do_sample or c.needs_hf_rows or c.streamer is not None or c.output_scores or c.output_logits)

    return (plain(running) and plain(cfg) and running.k == cfg.k and running.max_ngram == cfg.max_ngram
            and running.tree_nodes == cfg.tree_nodes and running.eos_token_ids == cfg.eos_token_ids
            and running.recycled == cfg.recycled
            and not (running.cross_rows or cfg.cross_rows or running.corpus or cfg.corpus))


class Batch:
    """Token rows of every call in one loop. `history[row, :seq.num_tokens]` is a row's prompt
    (padding removed) and generated tokens; drafts are written right after them before a step
    (a chain's tokens in order, a candidate tree's nodes in node order; `parents` then holds
    each node's parent, see drafting.tree)."""

    def __init__(self, cfg: DecodeConfig, proposer: NgramProposer | TreeProposer | None, sched: Scheduler, ids,
                 cache, tree_min_score: float = 0.0, budget: DraftBudget | None = None,
                 memory: list[np.ndarray] | None = None, acceptance: dict[str, Acceptance] | None = None,
                 successors: SuccessorTable | None = None):
        self.cfg = cfg  # the first call's config: it sets drafting and stopping for every row
        self.proposer = proposer
        self.tree = isinstance(proposer, TreeProposer)
        # how many drafts a step feeds: with `budget` (the engine's, engine.budget), the nodes that
        # pay for their share of the step by measured costs; else those scoring at least tree_min_score
        self.tree_min_score, self.budget = tree_min_score, budget
        # how often fed drafts of each score were accepted, per drafter kind (engine.budget.Acceptance):
        # the budget's, or the engine's where uniform steps size trees by cost (engine.widths); None:
        # nothing reads them, so nothing is counted
        self.acceptance = budget.acceptance if budget is not None else acceptance
        self.memory = memory or []  # earlier calls' generated rows: trees draft from them (drafting.memory)
        # the model's best-ranked successors per token (drafting.recycle), written from each step's
        # verified positions; the trees read them (None: no recycled source)
        self.successors = successors
        self.sched = sched
        self.cache = cache  # the engine's PagedKVCache (tree paths move in it; past_key_values read from it)
        self.register = None  # the prefix pool's hook: a sequence's prefilled prompt pages enter the pool
        # uniform verify steps (CUDA graphs): (chances [B, K], drafts [B]) -> the step's width, from
        # measured step costs (engine.widths), set by the engine where it applies; step_width: the
        # width the last propose chose (None: the runner's own)
        self.width_of: Callable[[np.ndarray, np.ndarray], int] | None = None
        self.step_width: int | None = None
        self._ids = ids  # itertools.count shared by the engine: unique sequence ids
        self.width_drafts = max(cfg.k, proposer.budget if self.tree else 0, 1)  # K: draft slots per row
        self.history = np.zeros((0, 1), dtype=np.int64)  # [B, L]
        self.drafts = np.full((0, self.width_drafts), -1, dtype=np.int64)  # [B, K]
        # [B, K] each draft's parent (chunk index; drafting.tree): a chain's draft j has parent j
        self.parents = np.full((0, self.width_drafts), -1, dtype=np.int64)
        self.n_drafts = np.zeros(0, dtype=np.int64)  # [B]
        self.scores = np.zeros((0, self.width_drafts))  # [B, K] the fed drafts' scores (budget: their acceptance is counted)
        self.recycled = np.zeros((0, self.width_drafts), dtype=bool)  # [B, K] drafts from recycled successors alone
        self._index: SuffixIndex | None = None  # trees: occurrences of every source (drafting.suffix)
        # per row: drafts accepted and verify steps that rejected one (the row's acceptance rate
        # scores its trees' deeper nodes: see accept_rate)
        self.n_accepted = np.zeros(0, dtype=np.int64)  # [B]
        self.n_rejected = np.zeros(0, dtype=np.int64)  # [B]
        self.seeds = np.zeros(0, dtype=np.uint64)  # [B] sampling seed per row
        # [B] left pads of each row in its call's input (models that count them as positions:
        # attention.positions)
        self.pads = np.zeros(0, dtype=np.int64)
        self.calls: list[Call] = []
        self.call_of_row: list[Call] = []
        self.hf_rows: np.ndarray | None = None  # [B, W + extra] rows as HF lays them out (first call only)
        self.width = 0  # W
        self.rec_scores: list[list[torch.Tensor]] | None = None
        self.rec_logits: list[list[torch.Tensor]] | None = None
        self.criteria: BatchCriteria | None = None  # HF's stopping-criteria calls (first call only)
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # row -> per layer (K, V) (keep_kv)
        self._streamed = 0  # tokens of row 0 its streamer has had (streamers run at batch 1)
        self._eos = np.array(sorted(cfg.eos_token_ids), dtype=np.int64)  # the stop tokens, for accept_chains

    def add(self, call: Call) -> None:
        """Give `call`'s prompts rows (growing the buffers) and queue them in the scheduler."""
        cfg = call.cfg
        first = len(self.call_of_row)
        b = len(call.prompts)
        extra = cfg.max_new_tokens + self.width_drafts + 1
        width = max(self.history.shape[1], max(len(p) for p in call.prompts) + extra)
        history = np.zeros((first + b, width), dtype=np.int64)
        history[:first, : self.history.shape[1]] = self.history
        self.history = history
        self.drafts = np.concatenate([self.drafts, np.full((b, self.drafts.shape[1]), -1, dtype=np.int64)])
        parents = np.full((b, self.parents.shape[1]), -1, dtype=np.int64)
        if self.proposer is not None and not self.tree:  # a chain's parents never change: set once
            parents[:, : self.proposer.k] = chain_parents(self.proposer.k)
        self.parents = np.concatenate([self.parents, parents])
        self.n_drafts = np.concatenate([self.n_drafts, np.zeros(b, dtype=np.int64)])
        self.scores = np.concatenate([self.scores, np.zeros((b, self.scores.shape[1]))])
        self.recycled = np.concatenate([self.recycled, np.zeros((b, self.recycled.shape[1]), dtype=bool)])
        self.n_accepted = np.concatenate([self.n_accepted, np.zeros(b, dtype=np.int64)])
        self.n_rejected = np.concatenate([self.n_rejected, np.zeros(b, dtype=np.int64)])
        self.seeds = np.concatenate([self.seeds, row_seeds(call.seed, b)])  # sampling (drafting.verify)
        width_in = cfg.hf_input_ids.shape[1] if cfg.hf_input_ids is not None else 0
        self.pads = np.concatenate([self.pads, [max(width_in - len(p), 0) for p in call.prompts]]).astype(np.int64)
        if not self.calls:
            if cfg.needs_hf_rows:
                self.width = cfg.hf_input_ids.shape[1]
                self.hf_rows = np.zeros((b, self.width + extra), dtype=np.int64)
                self.hf_rows[:, : self.width] = cfg.hf_input_ids
            self._streamed = len(call.prompts[0])
            self.rec_scores = [[] for _ in range(b)] if cfg.output_scores else None
            self.rec_logits = [[] for _ in range(b)] if cfg.output_logits else None
            if cfg.stopping:
                self.criteria = BatchCriteria(cfg.stopping, self.width, b, cfg.pad_token_id,
                                              pad_finished=bool(cfg.eos_token_ids))
        call.stats.num_sequences = b
        call.stats.resize(cfg.k)
        call.stats.drafter = ("" if self.proposer is None else "ngram" if not self.tree else
                              "ngram-tree" + "+rows" * cfg.cross_rows + "+corpus" * (cfg.corpus is not None))
        call.stats.memory_tokens = sum(len(d) for d in self.memory) if self.tree else 0
        for i, p in enumerate(call.prompts):
            row = first + i
            self.history[row, : len(p)] = p
            seq = Sequence(next(self._ids), row, len(p), cfg.max_new_tokens)
            call.seqs.append(seq)
            self.call_of_row.append(call)
            self.sched.add(seq)
        self.calls.append(call)

    def accept_rate(self, rows: np.ndarray) -> np.ndarray:
        """[B] each row's measured acceptance rate (drafting.tree.acceptance_estimate)."""
        return acceptance_estimate(self.n_accepted[rows], self.n_rejected[rows])

    def suffix_index(self) -> SuffixIndex:
        """The loop's occurrence index over its drafting sources (rebuilt when rows join and the
        history grows; it re-indexes the rows' committed tokens at the next update)."""
        rows, width = self.history.shape
        if self._index is None:
            self._index = SuffixIndex(rows, width, self.cfg.cross_rows, list(self.cfg.corpus or ()) + self.memory)
            if self.successors is not None:
                self._index.successors = self.successors.succ
        elif (self._index.rows, self._index.width) != (rows, width):
            self._index = self._index.grow(rows, width)
        return self._index

    def propose(self, running: list[Sequence]) -> np.ndarray:
        """Drafts for the running sequences (written into `history` after their last token)."""
        if self.proposer is None:
            return np.zeros(len(running), dtype=np.int64)
        rows = np.array([s.row for s in running], dtype=np.int64)
        lengths = np.array([s.num_tokens for s in running], dtype=np.int64)
        cap = np.array([s.remaining - 1 for s in running], dtype=np.int64)
        t0 = time.perf_counter()
        budget = self.budget
        if self.tree:
            index = self.suffix_index()
            seqs = [s for call in self.calls for s in call.seqs]
            if index.cross_rows:  # every row's committed tokens are a source, running or not
                index.update(self.history, np.array([s.row for s in seqs]), np.array([s.num_tokens for s in seqs]))
            sc = np.empty((len(rows), self.proposer.budget))
            # which nodes come from recycled successors alone: asked only where the source is on
            rec = np.empty((len(rows), self.proposer.budget), dtype=bool) if self.successors is not None else None
            d, par, nd = self.proposer.propose(self.history, lengths, cap, min_score=0.0 if budget else self.tree_min_score,
                                               rows=rows, index=index, decay=self.accept_rate(rows), scores=sc,
                                               recycled=rec)
            if rec is not None:
                self.recycled[rows, : rec.shape[1]] = rec
            if self.acceptance is not None:  # each node's chance by its score (engine.budget.Acceptance)
                chances = self.acceptance["tree"].chances(sc)
            if budget is not None:
                nd = choose_drafts(chances, nd, budget.costs)
            self.parents[rows, : par.shape[1]] = par
        else:
            d, nd = self.proposer.propose_rows(self.history, rows, lengths, cap)
            # draft j is reached with chance rate**(j + 1) by the row's acceptance record
            # (accept_rate, chain_chances): its score
            sc = chances = chain_chances_of(self.n_accepted, self.n_rejected, rows, d.shape[1])
            if budget is not None:
                nd = choose_drafts(budget.acceptance["chain"].chances(sc), nd, budget.costs)
            elif self.tree_min_score > 0.0:  # the drafts whose chance to be reached is at least tree_min_score
                nd = np.minimum(nd, chain_budget(self.accept_rate(rows), self.tree_min_score))
            # (a chain's parents were set when its row joined: `add`)
        most = d.shape[1]
        if self.width_of is not None:  # one width for the uniform step, each row's drafts cut to it
            self.step_width = self.width_of(chances, nd)
            most = self.step_width - 1
        if self.acceptance is not None:  # read back only where the fed drafts' fate is counted (_commit)
            self.scores[rows, : sc.shape[1]] = sc
        spent = time.perf_counter() - t0
        # the drafts and their counts into the batch; the fed ones (seen by processors) right after
        # each row's last token
        nd = np.array(nd, dtype=np.int64)  # its own copy, cut in place
        store_drafts(self.history, rows, lengths, np.ascontiguousarray(d, dtype=np.int64), nd, most, self.drafts,
                     self.n_drafts)
        calls = (self.calls if len(self.calls) == 1 else
                 {id(self.call_of_row[r]): self.call_of_row[r] for r in rows.tolist()}.values())
        for call in calls:
            call.stats.count_propose(spent)
        if self.hf_rows is not None:
            i, j = np.nonzero(np.arange(d.shape[1])[None, :] < nd[:, None])  # (running row, draft) pairs
            gen = lengths - np.array([s.prompt_len for s in running], dtype=np.int64)  # [B] generated so far
            self.hf_rows[rows[i], self.width + gen[i] + j] = d[i, j]
        return nd

    def finish_calls(self) -> list[Call]:
        """Calls whose rows have all stopped and that have no result yet: their results are set."""
        done = []
        for call in self.calls:
            if call.result is None and all(s.finished for s in call.seqs):
                call.result = self.result(call)
                done.append(call)
        return done

    def result(self, call: Call) -> GenerationResult:
        return GenerationResult(
            [self.history[s.row, s.prompt_len : s.num_tokens].copy() for s in call.seqs],
            self.rec_scores if call is self.calls[0] else None,
            self.rec_logits if call is self.calls[0] else None,
            [self.kv[s.row] for s in call.seqs] if call.cfg.keep_kv else None,
        )

    @property
    def keeps_kv(self) -> bool:
        """Whether a call of this loop returns past_key_values (its rows' KV is saved at finish)."""
        return any(c.cfg.keep_kv for c in self.calls)

    def save_kv(self, seqs: list[Sequence], cache) -> None:
        """Copy the keys/values of finished `seqs` out of the pages before their blocks are freed
        (only for calls that return `past_key_values`): per layer [H_kv, num_cached, D]."""
        for seq in seqs:
            if seq.row in self.kv or not self.call_of_row[seq.row].cfg.keep_kv:
                continue
            slots = torch.from_numpy(self.sched.blocks.slots(seq.seq_id, np.arange(seq.num_cached)))
            layers = []
            for k, v in zip(cache.keys, cache.values):
                sl = slots.to(k.device)
                layers.append(tuple(p.view(-1, *p.shape[2:]).index_select(0, sl).transpose(0, 1).contiguous()
                                    for p in (k, v)))
            self.kv[seq.row] = layers

    # ---- after a forward: the one place a step's outcome changes sequence state ----

    def postprocess(self, chunks: list[ScheduledChunk], layout: StepLayout, logits: torch.Tensor | Argmax,
                    path: str = "eager", reason: str | None = None) -> list[Call]:
        """Everything one forward changes, in order: prompt chunks advance (and enter the prefix
        pool); every row that got logits (`logits` [N, V], kept rows in chunk order, or, where the
        step asked for them (`argmax_request`), possibly an `Argmax` of their greedy tokens) takes its
        tokens (accepted drafts, then the next token, up to EOS or its length limit); accepted
        tree paths move into a chain's slots; HF's stopping criteria may cut rows back; finished
        rows save their keys/values (past_key_values), give back their blocks, and the others
        drop the blocks of rejected drafts. `layout`: the step as the runner laid it out (its
        kept rows and their depths). Returns the calls whose rows are now all done (their
        results set). `path` and `reason`: how the forward ran and why eagerly, counted in
        each call's stats (SpecStats.count_forward).

        Example: a chain row with 3 drafts and 200 cached tokens whose first two drafts are
        accepted appends 3 tokens and ends the step with 203 cached tokens (its last token's
        keys/values come with the next step); its blocks past 203 tokens are freed."""
        if len(self.calls) == 1:  # the common case, without a pass over the rows per call
            decodes = any(not c.is_prefill for c in chunks)
            self.calls[0].stats.count_forward(chunks[0].is_prefill, path if decodes else None, reason)
        else:
            decoding = {id(self.call_of_row[c.seq.row]) for c in chunks if not c.is_prefill}  # calls with a decode row here
            for call in {id(self.call_of_row[c.seq.row]): self.call_of_row[c.seq.row] for c in chunks}.values():
                call.stats.count_forward(chunks[0].is_prefill, path if id(call) in decoding else None, reason)
        prompts = [c for c in chunks if c.is_prefill]
        for c in prompts:
            c.seq.num_cached += c.num_tokens
            if self.register is not None:
                self.register(c.seq)
        # rows with logits: decode chunks and the last chunk of a prompt
        active = [c for c in chunks if not c.is_prefill or c.seq.num_cached >= c.seq.prompt_len] if prompts else chunks
        if active:
            if self._plain_chains and len(active) == len(chunks) and not chunks[0].is_prefill:
                self._commit_chains(active, logits)
            else:
                # depth of each kept row below its chunk's first token; a prompt's last token scores
                # the first generated one, at depth 0 as the root of a verify step does
                fed_depth = (layout.depth[layout.keep] if layout.is_decode else
                             np.where(layout.prefill[layout.seq_of_token[layout.keep]], 0, layout.depth[layout.keep]))
                self._commit(active, logits, fed_depth)
            if self.criteria is not None:
                self.criteria.device = logits.device  # HF's input_ids live on the model's device
                self._check_criteria()
            if self.cfg.streamer is not None:  # batch 1: its every token was checked above
                seq, before = active[0].seq, self._streamed
                for t in self.history[seq.row, before : seq.num_tokens]:
                    self.cfg.streamer.put(torch.tensor([int(t)]))
                self._streamed = seq.num_tokens
        if self.keeps_kv:  # past_key_values: keys/values of finished rows, before their blocks go
            self.save_kv([s for s in self.sched.running if s.finished], self.cache)
        self.sched.retire_finished()
        trim = self.sched.blocks.trim
        for c in active:
            if not c.seq.finished:
                trim(c.seq.seq_id, c.seq.num_cached)
        return self.finish_calls()

    def _targets(self, rows: np.ndarray, n_pos: np.ndarray, fed_depth: np.ndarray, gen: np.ndarray,
                 logits: torch.Tensor | Argmax) -> tuple[torch.Tensor | None, np.ndarray]:
        """Per fed position, its processed scores [N, V] and the token it emits [N]: the argmax,
        or a draw keyed by (row seed, output position) (drafting.verify). Given an `Argmax`, its
        tokens (and no scores)."""
        if isinstance(logits, Argmax):
            return None, logits.tokens.cpu().numpy()
        if not (self.cfg.processors or self.cfg.do_sample):  # greedy: the argmax, whatever the positions
            scores = logits.float()
            return scores, scores.argmax(dim=-1).cpu().numpy()
        out_pos = np.repeat(gen, n_pos) + fed_depth  # [N] the output position each fed row scores
        scores = self._processed(logits, np.repeat(rows, n_pos), out_pos) if self.cfg.processors else logits.float()
        if self.cfg.do_sample:
            u = position_uniforms(self.seeds[np.repeat(rows, n_pos)], out_pos)
            return scores, sample_targets(torch.softmax(scores, dim=-1), u)
        return scores, scores.argmax(dim=-1).cpu().numpy()

    def _processed(self, logits: torch.Tensor, rows: np.ndarray, out_pos: np.ndarray) -> torch.Tensor:
        """The call's logits processors applied to `logits` [N, V], row i being batch row rows[i] at
        output position out_pos[i] (its context in HF's layout: `hf_rows`, `width` + out_pos tokens)."""
        return process_scores(self.cfg.processors, logits, rows, self.width + out_pos, self.hf_rows)

    @property
    def argmax_only(self) -> bool:
        """Whether a step's rows need only their greedy tokens, not their logits: greedy, with
        no logits processors but those that only ban tokens (`BAN_ONLY`), no recorded scores or
        logits, no recycled successors (which rank the logits). A step may then return an `Argmax`
        (steps.head_screen)."""
        cfg = self.cfg
        return not (cfg.do_sample or (cfg.processors and not bans_only(cfg.processors)) or self.rec_scores is not None
                    or self.rec_logits is not None or self.successors is not None)

    def argmax_request(self, chunks: list[ScheduledChunk], layout: StepLayout) -> bool | Bans:
        """What the step `layout` (of `chunks`) asks of the LM head (steps.runner.ModelRunner.run):
        False, the logits; True, each kept row's argmax of them (`argmax_only`); or, for a decode step
        whose processors only ban tokens, a `Bans`: the tokens each kept row may not take, found by
        running the processors on zero scores at the rows' context lengths as `_targets` runs them
        on the logits (the argmax of the processed scores is then the logits' argmax with those
        tokens taken out). A step with prompt rows asks for the logits then.

        Example: with `min_new_tokens=5` and EOS 2, a row that made 3 tokens and feeds 4 (a root and
        3 drafts) has banned EOS at its first two kept rows (outputs 4 and 5) and not at the others."""
        if not self.argmax_only:
            return False
        if not self.cfg.processors:
            return True
        if not layout.is_decode:
            return False
        n_pos = np.array([c.num_tokens for c in chunks], dtype=np.int64)
        rows = np.repeat(np.array([c.seq.row for c in chunks], dtype=np.int64), n_pos)
        gen = np.array([c.seq.num_generated for c in chunks], dtype=np.int64)
        out_pos = np.repeat(gen, n_pos) + layout.depth[layout.keep]  # (as `_targets` counts them)

        def bans(vocab: int) -> torch.Tensor:
            return self._processed(torch.zeros(len(out_pos), vocab), rows, out_pos) == float("-inf")

        return bans

    @property
    def _plain_chains(self) -> bool:
        """Whether a decode step's rows take `_commit_chains`: greedy chains (or plain decoding)
        whose steps record nothing beyond the rows' tokens and counts (no processors, criteria,
        recorded scores or logits, draft acceptance by score, recycled successors)."""
        cfg = self.cfg
        return not (self.tree or cfg.do_sample or cfg.processors or self.hf_rows is not None
                    or self.rec_scores is not None or self.rec_logits is not None or self.acceptance is not None
                    or self.successors is not None)

    def _commit_chains(self, active: list[ScheduledChunk], logits: torch.Tensor | Argmax) -> None:
        """`_commit` of a decode step of greedy chains (`_plain_chains`): the walks, the appended
        tokens and the rows' acceptance counts in one compiled call for all rows
        (engine.chains.accept_chains), then each row's sequence and its call's counts."""
        seqs = [c.seq for c in active]
        n_pos = np.array([c.num_tokens for c in active], dtype=np.int64)  # [S]
        rows = np.array([s.row for s in seqs], dtype=np.int64)  # [S]
        num_tokens = np.array([s.num_tokens for s in seqs], dtype=np.int64)  # [S]
        remaining = np.array([s.remaining for s in seqs], dtype=np.int64)  # [S]
        # greedy targets: the logits' argmax, taken in the walk where the logits are on the host in
        # a dtype numba reads (only at the positions it reaches), else on their device first
        if isinstance(logits, Argmax):
            on_host, scores = False, logits.tokens[:, None].cpu().numpy()
        else:
            on_host = logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64)
            scores = logits.numpy() if on_host else logits.argmax(dim=-1, keepdim=True).cpu().numpy()
        accepted, emitted = np.empty(len(seqs), dtype=np.int64), np.empty(len(seqs), dtype=np.int64)
        finished = np.empty(len(seqs), dtype=np.bool_)
        accept_chains(scores, not on_host, n_pos, rows, self.drafts, self.history, num_tokens, remaining, self._eos,
                      self.n_accepted, self.n_rejected, accepted, emitted, finished)
        tallied = len(self.calls) == 1 and len(seqs) >= TALLY_MIN_ROWS
        if tallied:  # the call's counts for all rows at once
            count_chain_rows(self.calls[0].stats, n_pos, accepted, emitted)
        for seq, m, a, e, f in zip(seqs, n_pos.tolist(), accepted.tolist(), emitted.tolist(), finished.tolist()):
            if not tallied:
                stats = self.call_of_row[seq.row].stats
                stats.count_verify(m - 1, a, m - 1)  # a chain's deepest fed node is its last draft
                stats.count_emitted(e)
            seq.num_cached += 1 + a
            seq.num_tokens += e
            if f:
                seq.finished = True

    def _commit(self, active: list[ScheduledChunk], logits: torch.Tensor | Argmax, fed_depth: np.ndarray) -> None:
        """Accept drafts and append tokens for every row of `active` (see postprocess)."""
        seqs = [c.seq for c in active]
        rows = np.array([s.row for s in seqs], dtype=np.int64)  # [S]
        dec = np.array([not c.is_prefill for c in active], dtype=bool)  # [S] verify (or decode) rows
        n_pos = np.array([c.num_tokens if d else 1 for c, d in zip(active, dec.tolist())], dtype=np.int64)  # [S]
        offsets = np.cumsum(n_pos) - n_pos  # [S]
        num_drafts = n_pos - 1  # [S]
        gen = np.array([s.num_generated for s in seqs], dtype=np.int64)  # [S] before this step
        scores, targets = self._targets(rows, n_pos, fed_depth, gen, logits)
        drafts, parents = self.drafts[rows], self.parents[rows]  # [S, K]
        accepted, paths, final = accept_paths(targets, offsets, num_drafts, drafts, parents)
        if self.successors is not None:
            self._recycle(logits, seqs, rows, offsets, accepted, paths, drafts)
        if self.acceptance is not None:  # how the fed drafts' scores fared (engine.budget.Acceptance)
            fed = np.arange(drafts.shape[1])[None, :] < num_drafts[:, None]  # [S, K]
            hit = np.zeros_like(fed)  # [S, K] the drafts on each row's accepted path
            on_path = np.nonzero(np.arange(paths.shape[1])[None, :] < accepted[:, None])  # (rows, slots)
            hit[on_path[0], paths[on_path] - 1] = True
            self.acceptance["tree" if self.tree else "chain"].record(self.scores[rows][fed], hit[fed])
        if self.tree:
            rejected = walks_rejected(paths, accepted, parents, num_drafts)
            deepest = np.maximum.reduceat(fed_depth, offsets)  # [S] each row's deepest fed node
        else:  # a chain's walk stopped above a draft iff it took fewer than it had; its deepest is its last
            rejected, deepest = accepted < num_drafts, num_drafts
        if dec.all():
            self.n_accepted[rows] += accepted
            self.n_rejected[rows] += rejected
        elif dec.any():
            self.n_accepted[rows[dec]] += accepted[dec]
            self.n_rejected[rows[dec]] += rejected[dec]
        # the loop below works on Python ints: per row, numpy's per-call cost would outweigh the work
        acc_l, m_l, deep_l, final_l = accepted.tolist(), num_drafts.tolist(), deepest.tolist(), final.tolist()
        paths_l, drafts_l = paths.tolist(), drafts.tolist()
        move_src, move_dst = [], []
        for i, (c, seq) in enumerate(zip(active, seqs)):
            stats = self.call_of_row[seq.row].stats
            a = acc_l[i]
            path = paths_l[i][:a]  # chunk indices of the accepted drafts
            if not c.is_prefill:
                stats.count_verify(m_l[i], a, deep_l[i])
                if self.tree:  # a chain's path is in place already; a tree's may not be
                    src, dst = compaction(path)
                    if len(src):
                        move_src.append(self.sched.blocks.slots(seq.seq_id, c.start + src))
                        move_dst.append(self.sched.blocks.slots(seq.seq_id, c.start + dst))
                seq.num_cached += 1 + a
            tokens = [drafts_l[i][p - 1] for p in path] + [final_l[i]]
            emitted = seq.append(self.history, tokens, self.cfg.eos_token_ids)
            if self.hf_rows is not None:
                self.hf_rows[seq.row, self.width + gen[i] : self.width + gen[i] + emitted] = tokens[:emitted]
            stats.count_emitted(emitted)
            if self.rec_scores is not None or self.rec_logits is not None:
                # the fed rows that scored the emitted tokens: the root, then the accepted path
                # (a copy to the device per row: made only where scores or logits are kept)
                kept = torch.tensor([int(offsets[i]) + p for p in [0] + path][:emitted], device=scores.device)
                if self.rec_scores is not None:
                    self.rec_scores[seq.row].extend(scores[kept])
                if self.rec_logits is not None:
                    self.rec_logits[seq.row].extend(logits[kept].float())
        if move_src:  # accepted tree paths into the slots a chain would have used
            self.cache.move_slots(np.concatenate(move_src), np.concatenate(move_dst))

    def _recycle(self, logits: torch.Tensor, seqs: list[Sequence], rows: np.ndarray, offsets: np.ndarray,
                 accepted: np.ndarray, paths: np.ndarray, drafts: np.ndarray) -> None:
        """Write the model's best-ranked next tokens at every verified position (each row's last
        token and its accepted drafts; a prompt's last token) into the successor table, keyed by
        the token there (drafting.recycle), and count each call's accepted drafts that came from
        the table alone. Only the [N, width] top ranks leave the device."""
        idx, tokens = [], []
        for i, seq in enumerate(seqs):
            path = paths[i, : accepted[i]]
            self.call_of_row[seq.row].stats.accepted_recycled += int(self.recycled[rows[i], path - 1].sum())
            idx.append(offsets[i])
            tokens.append(self.history[rows[i], seq.num_tokens - 1])
            idx.extend(offsets[i] + path)
            tokens.extend(drafts[i, path - 1])
        at = torch.as_tensor(np.asarray(idx, dtype=np.int64), device=logits.device)
        top = torch.topk(logits.index_select(0, at), self.successors.width, dim=-1).indices
        self.successors.update(np.asarray(tokens, dtype=np.int64), top.cpu().numpy())

    def _check_criteria(self) -> None:
        """Run HF's stopping-criteria calls that every row has reached (engine.stopping), and cut
        the rows a criterion stops: their tokens after that length are dropped, they finish."""
        call = self.calls[0]
        seqs = call.seqs
        lengths = np.array([self.width + s.num_generated for s in seqs], dtype=np.int64)  # [B]
        ended = np.array([s.finished for s in seqs], dtype=bool)  # [B]
        scores_of = None
        if self.rec_scores is not None:
            def scores_of(t: int) -> torch.Tensor:  # [B, V] HF's scores of step t (rows done by then: zeros)
                rec = self.rec_scores
                like = next(r[t] for r in rec if len(r) > t)
                return torch.stack([r[t] if len(r) > t else torch.zeros_like(like) for r in rec])
        for row, length in self.criteria.advance(self.hf_rows, lengths, ended, scores_of).items():
            seq = seqs[row]
            keep = length - self.width  # tokens generated up to the cut
            drop = seq.num_generated - keep
            seq.num_tokens = seq.prompt_len + keep
            seq.num_cached = min(seq.num_cached, seq.num_tokens)
            seq.finished = True
            call.stats.uncount(drop)
            for rec in (self.rec_scores, self.rec_logits):
                if rec is not None:
                    del rec[row][keep:]
