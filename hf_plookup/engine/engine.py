"""The loop: schedule -> propose -> run -> verify -> commit, over the rows of one `generate`
call and of the concurrent calls that join it (engine.batch holds the rows). What an engine runs
with is decided before it is built (engine.plan)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.registry import BACKEND_CHOICES, TREE_BACKENDS
from ..base.checks import positive_int
from ..steps.head import head_chooser
from ..cpu.huge_pages import to_huge_pages
from ..cpu.packed_codes import pack_quantized, unpack_quantized
from ..cpu.packed_weight import pack_linears, unpack_linears
from ..invariant.linears import InvariantLinears, linear_of
from ..steps.graphs import GraphRunner, batch_bucket
from ..drafting.memory import DraftMemory
from ..drafting.ngram import NgramProposer
from ..drafting.recycle import SuccessorTable
from ..drafting.sampling import history_free
from ..drafting.tree import TreeProposer
from ..stats import SpecStats
from .batch import Batch, Call, GenerationResult, joinable
from .budget import Acceptance, DraftBudget
from .distributed import agree_min, agree_seed
from .layout import lay_out, lay_out_staged
from .kv_cache import BlockManager, PagedKVCache, default_num_tokens
from .plan import EnginePlan, pads_drafts
from .prefix import PrefixPool, copy_caller_kv
from ..steps.c_layers import CpuLayers
from ..steps.runner import ModelRunner
from .scheduler import Scheduler
from .sequence import DecodeConfig
from .warmup import check_warmup, warm_up, warmup_spec
from .widths import StepCosts, candidate_widths, choose_width

logger = logging.getLogger("hf_plookup")


@dataclass(slots=True)
class EngineOptions:
    """Options given to `hf_plookup.wrap(model, **options)`."""

    max_cache_tokens: int | None = None  # KV capacity in tokens (None: from available memory)
    num_blocks: int | None = None  # KV capacity in blocks (overrides max_cache_tokens)
    block_size: int | None = None  # tokens per page (None: 16, or 256 with flash_attn, which needs multiples of 256)
    max_batch_tokens: int | None = None  # token budget of one prefill step (None: plan.MAX_BATCH_TOKENS by device)
    max_num_seqs: int = 256  # most sequences running at once
    # share of free memory for the KV cache when no capacity is given: of available RAM on CPU;
    # on CUDA of the memory left free after a warm-up forward of max_batch_tokens tokens, less
    # that forward's peak (see kv_cache.default_num_tokens)
    cache_memory_fraction: float = 0.25
    attn_backend: str = "auto"  # "auto" (flash_attn if it can run here, else sdpa) | "sdpa" | "flash_attn" | "triton" | "flash_attn4"
    cuda_graphs: bool = True  # capture verify steps in CUDA graphs (CUDA only; implies pad_drafts)
    pad_drafts: bool = False  # every sequence of a verify step feeds k + 1 tokens (missing drafts padded)
    join_calls: bool = True  # concurrent generate calls join the running loop when their configs allow
    # decode/verify steps through torch.compile (inductor), one graph per step width and batch bucket, captured in
    # CUDA graphs when cuda_graphs is on: True | False | "auto" (off for now: see
    # plan.COMPILE_BY_DEFAULT)
    compile: bool | str = "auto"
    # drafts (a chain's, a tree's nodes) whose score (estimated chance that verification reaches
    # them) is below this are left out; None: on CPU the drafts that pay for their share of the
    # step by what steps measured to cost (engine.budget), on CUDA every draft
    tree_min_score: float | None = None
    # every token computed bitwise as in a 1-token step (invariant.linears): True | False | "auto"
    # (on where it measured cheap: see invariant.linears.INVARIANT_AUTO)
    invariant: bool | str = "auto"
    # keep full pages of prefilled prompts after a call and reuse them for prompts that start the
    # same way: True | False | "auto" (on where a pooled page holds the bits a fresh prefill
    # computes: with invariant mode, whose prompt chunks are cut at fixed offsets)
    prefix_cache: bool | str = "auto"
    # tokens of earlier calls' outputs kept as a source for candidate trees (drafting.memory); 0: none.
    # Off by default: a call then drafts from its own rows and arguments only, so the same request
    # runs the same way whatever came before it (a benchmark's variants included)
    draft_memory_tokens: int = 0
    # step buckets built at wrap time, so that no call compiles or captures (engine.warmup): a dict
    # of max_batch_size, prompt_lookup_num_tokens, max_length; None: each bucket built when first met
    warmup: dict | None = None
    # greedy CPU decode steps take each row's token from an int8 copy of the LM head and the exact
    # logits of the few outputs it leaves in doubt (steps.head_screen): the same tokens, a smaller
    # read than the head's; False: the full head every step, and no copy held
    head_screen: bool = True

    def __post_init__(self) -> None:
        for name in ("max_cache_tokens", "num_blocks", "block_size", "max_batch_tokens", "max_num_seqs"):
            setattr(self, name, positive_int(name, getattr(self, name), none_ok=name != "max_num_seqs",
                                             type_error=ValueError))
        for name in ("cuda_graphs", "pad_drafts", "join_calls", "head_screen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compile not in (True, False, "auto") or not isinstance(self.compile, (bool, str)):
            raise ValueError(f"compile must be True, False or 'auto', got {self.compile!r}")
        if self.tree_min_score is not None and (isinstance(self.tree_min_score, bool) or not isinstance(
                self.tree_min_score, (int, float)) or not 0.0 <= self.tree_min_score <= 1.0):
            raise ValueError(f"tree_min_score must be a number in [0, 1] or None, got {self.tree_min_score!r}")
        for name in ("invariant", "prefix_cache"):
            v = getattr(self, name)
            if v not in ("auto", True, False) or not isinstance(v, (bool, str)):
                raise ValueError(f"{name} must be 'auto', True or False, got {v!r}")
        self.draft_memory_tokens = positive_int("draft_memory_tokens", self.draft_memory_tokens, minimum=0,
                                                type_error=ValueError)
        if not 0.0 < self.cache_memory_fraction <= 1.0:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction!r}")
        if self.attn_backend not in BACKEND_CHOICES:
            raise ValueError(f"attn_backend must be one of {BACKEND_CHOICES}, got {self.attn_backend!r}")
        self.warmup = warmup_spec(self.warmup)


# a call with at least this many decode steps, most of them eager with graphs or compile on, logs a line (warn_eager)
EAGER_WARN_MIN_STEPS = 8
# rows of logits a step keeps that the KV cache's sizing leaves memory for: a prompt chunk keeps one
# row per sequence, a verify step one per fed token (256 sequences of 4 tokens)
LOGITS_ROWS = 1024
# nodes of the trees drafted by default (under the draft budget) per prompt_lookup_num_tokens: room for
# a chain of k and as many alternatives; the budget feeds few of them where steps cost
TREE_NODES_PER_DRAFT = 2


def weights_fingerprint(model: torch.nn.Module) -> tuple | None:
    """What decides the K/V a prompt gets besides its tokens: every parameter's and buffer's
    storage, version counter (bumped by in-place changes: optimizer steps, `load_state_dict`,
    merging adapters), dtype and device, and each PEFT layer's active adapters, enabled state and
    scaling. None where a tensor has no version counter (inference tensors): nothing is pooled."""
    parts = []
    try:
        for t in itertools.chain(model.parameters(), model.buffers()):
            parts.append((t.data_ptr(), t._version, t.dtype, t.device))
    except RuntimeError:
        return None
    for m in model.modules():
        if hasattr(m, "_active_adapter"):
            parts.append((m._active_adapter if isinstance(m._active_adapter, str) else tuple(m._active_adapter),
                          getattr(m, "_disable_adapters", None), repr(getattr(m, "scaling", None))))
    return tuple(parts)


def warn_eager(stats: SpecStats, min_steps: int = EAGER_WARN_MIN_STEPS) -> bool:
    """Log one line when most of a call's decode steps (at least `min_steps` of them) ran eagerly
    although CUDA graphs or compiled steps are on: the call then ran at eager speed. True if it did.

    Example: decode_steps_by_path {"eager": 30, "graph": 2}, eager_reasons {"more rows than the
    largest batch bucket (256)": 30} logs "hf_plookup: 30 of 32 decode steps of this call ran
    eagerly, off the captured or compiled steps (more rows than the largest batch bucket (256): 30)"."""
    eager = stats.decode_steps_by_path.get("eager", 0)
    if eager < min_steps or 2 * eager <= stats.decode_steps:
        return False
    why = ", ".join(f"{r}: {n}" for r, n in sorted(stats.eager_reasons.items(), key=lambda x: -x[1]))
    logger.warning(f"hf_plookup: {eager} of {stats.decode_steps} decode steps of this call ran eagerly, off the "
                   "captured or compiled steps" + (f" ({why})" if why else ""))
    return True


class Engine:
    """Owns the paged cache (allocated on first use, kept across calls) and runs calls."""

    def __init__(self, model: torch.nn.Module, options: EngineOptions):
        self.model = model
        parts = [("start", time.perf_counter())]  # wrap's parts, logged at debug level
        self.plan = plan = EnginePlan.of(model, options, timings=parts)  # what runs (engine.plan)
        parts.append(("setup", time.perf_counter()))
        # the plan's decisions that calls read
        self.specs, self.options, self.embedders, self.mixers = plan.specs, plan.options, plan.embedders, plan.mixers
        self.use_compile, self.use_graphs, self.width_policy = plan.use_compile, plan.use_graphs, plan.width_policy
        self.tensor_parallel, self.tree_min_score = plan.tensor_parallel, plan.tree_min_score
        self.prefill_unit, self.prefix_cache, self.prefix_unit_pages = (plan.prefill_unit, plan.prefix_cache,
                                                                        plan.prefix_unit_pages)
        if plan.packs:
            self._pack(parts)
        self.invariant = InvariantLinears(model, plan.prefill_unit) if plan.invariant else None
        # invariant decode steps of a Llama-form model in C, two calls a layer (steps.c_layers)
        self.c_layers = CpuLayers.of(model, self.invariant.forms, options.head_screen) if plan.invariant else None
        if self.c_layers is not None and self.c_layers.screen is not None:
            self.c_layers.screen.prepare()
        parts.append(("invariant mode's checks", time.perf_counter()))
        self.budget = DraftBudget() if plan.budget else None  # kept across calls (engine.budget)
        self.step_costs = StepCosts()  # what uniform steps of each width cost (engine.widths)
        # tree nodes' acceptance by score, for those widths (a chain's drafts take their row's rate);
        # kept across calls, as the budget's
        self.acceptance = {"tree": Acceptance()}
        # CPU: the LM head's faster matmul layout for multi-row steps (timed, so not under tensor parallel)
        self.head = None if plan.tensor_parallel else head_chooser(model)
        parts.append(("the rest", time.perf_counter()))
        logger.debug("hf_plookup engine built in %.2f s: %s", parts[-1][1] - parts[0][1],
                     ", ".join(f"{name} {t - t0:.2f} s" for (_, t0), (name, t) in zip(parts, parts[1:])))
        self._init_state()
        self.warmed: dict | None = None  # what `warm_up` built, and its seconds (engine.warmup)
        if self.options.warmup:
            check_warmup(self, self.options.warmup)  # a spec beyond what the engine holds: refused now

    def warm_up(self) -> None:
        """Build the step buckets of the `warmup` option (engine.warmup), once the model is in the
        form its calls will see (compiled code guards its class). The caller holds the model."""
        if self.options.warmup and self.warmed is None:
            self.warmed = warm_up(self, self.options.warmup)

    def _init_state(self) -> None:
        """What calls build and keep: the cache (allocated on first use), the captured or compiled
        steps, the proposers, the running loop's rows and the calls waiting to join it."""
        self._graphs: GraphRunner | None = None
        self._capacity: int | None = None
        self._cache: PagedKVCache | None = None
        self.blocks: BlockManager | None = None  # the cache's blocks; all free between calls
        self._proposers: dict[tuple[int, int, int, int], NgramProposer | TreeProposer] = {}  # (k, ngram, nodes, recycled)
        self._ids = itertools.count()
        self._loop_lock = threading.Lock()  # one engine loop (or delegated HF call) at a time
        self._state_lock = threading.Lock()  # guards _batch and _pending
        self._batch: Batch | None = None  # the running loop's rows
        self._pending: list[Call] = []  # calls waiting to join it at the next step
        # the weights' fingerprint the prefix pool's pages were computed under: they are kept as
        # long as it does not change
        self._weights: tuple | None = None
        # what earlier calls generated: a source of candidate trees (drafting.memory)
        self.memory = DraftMemory(self.options.draft_memory_tokens)
        # recycled successors (drafting.recycle) by table width, kept across calls where earlier
        # calls' outputs are kept too (draft_memory_tokens); else each loop starts its own
        self._successors: dict[int, SuccessorTable] = {}

    def _pack(self, parts: list) -> None:
        """The C kernels' packed layout becomes the linear weights' only copy (cpu.packed_weight; of a
        quantized weight, its codes' only copy: cpu.packed_codes); the other parameters are copied
        off the memory they shared with the linears' originals (a checkpoint's file mapping is then
        let go), onto 2 MB pages (cpu.huge_pages)."""
        pack_linears(self.model)
        pack_quantized(self.model, linear_of)
        parts.append(("packing", time.perf_counter()))
        to_huge_pages(self.model)
        parts.append(("other weights to 2 MB pages", time.perf_counter()))

    @property
    def capacity_blocks(self) -> int:
        o = self.options
        if o.num_blocks is not None:
            return o.num_blocks
        if self._capacity is None:
            tokens = o.max_cache_tokens or default_num_tokens(
                self.specs, o.cache_memory_fraction, self.model, o.max_batch_tokens, LOGITS_ROWS
            )
            if self.tensor_parallel:  # every rank admits the same rows
                tokens = agree_min(tokens)
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
        """Bucketed decode/verify steps, captured (CUDA with cuda_graphs=True) and/or compiled
        (`compile`), kept across calls; None when steps run plain eager."""
        if (self.use_graphs or self.use_compile) and self._graphs is None:
            self._graphs = GraphRunner(self.model, self.cache(), self.options.attn_backend, self.options.max_num_seqs,
                                       capture=self.use_graphs, compiled=self.use_compile, invariant=self.invariant,
                                       c_layers=self.c_layers, grad_mode=self.plan.grad_mode)
        return self._graphs

    def clear_prefix_cache(self) -> None:
        """Forget every pooled prompt page (no loop may be running)."""
        with self._loop_lock:
            if self.blocks is not None:
                self.blocks.clear_prefixes()
            self._weights = None

    def _pool_valid(self) -> bool:
        """Whether this loop may use the prefix pool: on, and the weights unchanged since the pooled
        pages were computed (else the pool is emptied first; `weights_fingerprint`)."""
        weights = weights_fingerprint(self.model) if self.prefix_cache else None
        if weights is None or weights != self._weights:
            self.blocks.clear_prefixes()
            self._weights = weights
        return weights is not None

    def pad_to(self, drafts: int) -> int | None:
        """Tokens every sequence feeds in a verify step when drafts are padded (`drafts` + 1: k for
        a chain, the node budget for trees), else None."""
        return drafts + 1 if pads_drafts(self.options.pad_drafts, self.use_graphs, self.use_compile) else None

    def uses_trees(self, cfg: DecodeConfig) -> bool:
        """Candidate trees run when asked for (`prompt_lookup_tree_nodes`, or sources beyond the
        row: `draft_cross_rows`, `draft_corpus`) or by default where the draft budget picks the
        nodes (engine.budget: of a tree's nodes it feeds those that pay, a chain's first drafts
        being among them), the attention backend takes a tree mask, and no logits processor looks
        at the tokens (a tree's branches have different histories); otherwise the call drafts one
        chain of k from its own row. Models with recurrent mixers draft chains: their states
        follow one chain of tokens."""
        asked = (cfg.tree_nodes > 0 or cfg.cross_rows or cfg.corpus is not None or cfg.recycled > 0
                 or self.budget is not None)
        return (cfg.k > 0 and asked and self.options.attn_backend in TREE_BACKENDS and history_free(cfg.processors)
                and not self.mixers)

    def proposer(self, cfg: DecodeConfig) -> NgramProposer | TreeProposer | None:
        if cfg.k == 0:
            return None
        # a tree's nodes: as asked, else TREE_NODES_PER_DRAFT per draft of a chain
        nodes = (cfg.tree_nodes or TREE_NODES_PER_DRAFT * cfg.k) if self.uses_trees(cfg) else 0
        key = (cfg.k, cfg.max_ngram, nodes, cfg.recycled if nodes else 0)
        if key not in self._proposers:
            self._proposers[key] = (TreeProposer(cfg.k, nodes, cfg.max_ngram, recycled=cfg.recycled) if nodes
                                    else NgramProposer(cfg.k, cfg.max_ngram))
        return self._proposers[key]

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the model with no engine loop running (for a call handed to HF's own generate,
        whose forwards must not see the engine's attention switched on)."""
        with self._loop_lock:
            yield

    def generate(
        self,
        prompts: list[np.ndarray],  # each [L_i] int64, padding removed
        cfg: DecodeConfig,
        stats: SpecStats | None = None,
    ) -> GenerationResult:
        """Generate every row (prompt-lookup drafts when cfg.k > 0, verified exactly).

        Thread-safe. A call that arrives while a loop runs joins it when it can (same drafting
        and stop tokens, greedy, no processors/criteria/streamer: `batch.joinable`; option
        `join_calls`): its rows are admitted at the next step and it returns when they are done.
        Any other call waits for the running loop to end and then runs its own."""
        stats = stats if stats is not None else SpecStats()
        stats.attn_backend = self.options.attn_backend
        stats.invariant = self.invariant is not None
        stats.prefix_cache = self.prefix_cache
        stats.exactness_note = self.plan.exactness_note
        stats.prompt_tokens = sum(len(p) for p in prompts)
        call = Call(prompts, cfg, stats)
        with self._state_lock:
            batch = self._batch
            joined = batch is not None and self.options.join_calls and joinable(batch.cfg, cfg)
            if joined:
                self._pending.append(call)
        if joined:
            call.done.wait()
            if call.error is not None:
                raise RuntimeError(f"the engine loop this call joined failed ({type(call.error).__name__}: "
                                   f"{call.error})") from call.error
            return call.result
        with self._loop_lock:
            return self._loop(call)

    def _loop(self, own: Call) -> GenerationResult:
        """Run steps until every row of `own` and of the calls that join meanwhile is done: schedule
        (drafts proposed) -> lay out -> run -> postprocess (verify, commit)."""
        self._seed(own)
        self.prepare_steps()
        cache = self.cache()
        graphs = self.graph_runner()
        graph_seconds = _graph_seconds(graphs)  # compile and capture time before this call
        batch = self._new_batch(own.cfg, cache, graphs)
        runner = ModelRunner(self.model, cache, self.options.attn_backend, graphs, self.head, self.invariant,
                             self.c_layers, self.embedders, self.mixers, self.plan.grad_mode)
        pad_to = self.pad_to(batch.width_drafts if batch.proposer is not None else 0)  # plain decoding feeds 1 token
        self._open(batch, own)
        try:
            while self._admit(batch):
                batch.step_width = None  # set by propose, which decode steps alone call
                chunks = batch.sched.schedule(batch.propose)
                layout = self._lay_out(batch, chunks, graphs, pad_to if batch.step_width is None else batch.step_width)
                timer = StepTimer(batch, chunks, graphs, self.budget, self.step_costs)
                # [N, V] at layout.keep, or their Argmax
                logits = runner.run(layout, batch.argmax_request(chunks, layout))
                timer.ran(layout)
                for call in batch.postprocess(chunks, layout, logits, runner.last_path, runner.last_reason):
                    if call is not own:
                        call.done.set()  # a joiner returns as soon as its rows are done
                timer.postprocessed(layout, runner.last_path)
        except BaseException as e:
            self._fail_joiners(batch, own, e)
            raise
        finally:
            self._close(own, graphs, graph_seconds)
        if graphs is not None:
            warn_eager(own.stats)
        self._remember(batch)
        return own.result if own.result is not None else batch.result(own)

    def prepare_steps(self) -> None:
        """Before steps run: compiled steps trace plain parameters, so weights and codes packed in
        place (by another engine of the same modules: cpu.packed_weight, cpu.packed_codes) go plain."""
        if self.use_compile:
            unpack_linears(self.model)
            unpack_quantized(self.model, linear_of)

    def step_widths(self, cfg: DecodeConfig) -> tuple[tuple[int, ...], bool]:
        """The widths a call of `cfg`'s uniform steps feed (several where a step picks its width by
        measured cost: engine.widths; else the one padded width) and whether its steps hold trees:
        the buckets its steps meet (the warm-up's, engine.warmup).

        Example: on CUDA with graphs, k=8 chains: ((1, 5, 9), False); compiled on CPU: ((9,), False)."""
        proposer = self.proposer(cfg)
        if proposer is None:
            return (1,), False
        tree = isinstance(proposer, TreeProposer)
        nodes = proposer.budget if tree else 0
        if self.width_policy:
            return candidate_widths(cfg.k, nodes), tree
        return (self.pad_to(max(cfg.k, nodes, 1)) or 1,), tree

    def _lay_out(self, batch: Batch, chunks: list, graphs: GraphRunner | None, width: int | None):
        """The step's layout (engine.layout): a uniform step of chains whose graph bucket exists is
        laid out straight into that bucket's buffer, padded (`lay_out_staged`), else plainly."""
        if (graphs is not None and width is not None and not batch.tree and not self.embedders and chunks
                and not any(c.is_prefill for c in chunks)):
            staging = graphs.staged(width, len(chunks), max(c.start for c in chunks) + width)
            if staging is not None:
                return lay_out_staged(chunks, batch.history, self.blocks, staging)
        return lay_out(chunks, batch.history, self.blocks, self._cache.scratch_block,
                       batch.parents if batch.tree else None, batch.pads, width, bool(self.embedders))

    def _seed(self, own: Call) -> None:
        """A sampling call's seed, from the generator HF's sampling would draw from."""
        if own.cfg.do_sample:
            own.seed = int(torch.randint(0, 2**63 - 1, (1,), device=self.specs[0].device).item())
            if self.tensor_parallel:
                # every rank samples with rank 0's seed, so the ranks draw the same tokens
                own.seed = agree_seed(own.seed)

    def _successor_table(self, proposer) -> SuccessorTable | None:
        """The table a loop's trees read recycled successors from (None: they draft none)."""
        width = getattr(proposer, "recycled", 0)
        if not width:
            return None
        if width not in self._successors or not self.options.draft_memory_tokens:
            self._successors[width] = SuccessorTable(self.model.config.get_text_config().vocab_size, width)
        return self._successors[width]

    def _new_batch(self, cfg: DecodeConfig, cache: PagedKVCache, graphs: GraphRunner | None) -> Batch:
        """The rows of a loop started by a call of `cfg`: its scheduler, proposer, prefix pool (or
        the callers' past_key_values) and the widths its uniform steps choose among."""
        sched = Scheduler(self.blocks, self.options.max_batch_tokens, self.options.max_num_seqs,
                          aligned_prefill=self.prefill_unit, units_per_chunk=1 if self.mixers else None)
        proposer = self.proposer(cfg)
        sized = self.width_policy and isinstance(proposer, TreeProposer)  # trees' widths read the counts
        batch = Batch(cfg, proposer, sched, self._ids, cache, self.tree_min_score, self.budget,
                      self.memory.docs(), self.acceptance if sized else None, self._successor_table(proposer))
        if self._pool_valid():
            pool = PrefixPool(batch, self.blocks, cache, self.prefix_unit_pages)
            sched.on_admit, sched.defer, batch.register = pool.admit, pool.defer, pool.register
        else:  # the caller's past_key_values still spare their prefill
            sched.on_admit = functools.partial(copy_caller_kv, batch, self.blocks, cache)
        widths = self._widths(batch)
        if graphs is not None:
            graphs.widths = widths  # a bucket's widths captured together (steps.graphs)
        return batch

    def _widths(self, batch: Batch) -> tuple:
        """The widths this loop's uniform steps choose among by measured cost (engine.widths), set
        as `batch.width_of`; none: each step's width is fixed."""
        if not (self.width_policy and batch.proposer is not None):
            return ()
        widths, _ = self.step_widths(batch.cfg)
        batch.width_of = lambda chances, drafts: choose_width(self.step_costs, batch_bucket(len(drafts)), widths,
                                                              chances, drafts)
        return widths

    def _open(self, batch: Batch, own: Call) -> None:
        """Admit `own`'s rows and let other calls join the loop; a streamer gets the prompt first."""
        batch.add(own)
        with self._state_lock:
            self._batch = batch
        if own.cfg.streamer is not None:
            own.cfg.streamer.put(torch.from_numpy(own.cfg.hf_input_ids))

    def _admit(self, batch: Batch) -> bool:
        """Admit the calls waiting to join; False (the loop ends, no call can join it any more)
        when every row is done and none is waiting."""
        with self._state_lock:  # end the loop only with none pending
            for call in self._pending:
                batch.add(call)
            self._pending.clear()
            if batch.sched.done:
                self._batch = None
                return False
        return True

    def _fail_joiners(self, batch: Batch, own: Call, error: BaseException) -> None:
        """The loop failed: every other call in it or waiting to join that is not done yet gets the
        error (its `generate` raises it) and returns."""
        with self._state_lock:
            pending, self._pending, self._batch = self._pending, [], None
        for call in batch.calls + pending:
            if call is not own and not call.done.is_set():
                call.error = error
                call.done.set()

    def _close(self, own: Call, graphs: GraphRunner | None, graph_seconds: tuple[float, float]) -> None:
        """After the loop, however it ended: every page and recurrent state freed, the call's
        compile and capture time counted, its streamer ended."""
        self.blocks.free_all()
        self.mixers.states.clear()
        if graphs is not None:
            own.stats.compile_time += graphs.compile_seconds - graph_seconds[0]
            own.stats.capture_time += graphs.capture_seconds - graph_seconds[1]
        if own.cfg.streamer is not None:
            own.cfg.streamer.end()

    def _remember(self, batch: Batch) -> None:
        """What every row generated, a source for the next calls' trees (drafting.memory)."""
        for call in batch.calls:
            for seq in call.seqs:
                self.memory.add(batch.history[seq.row, seq.prompt_len : seq.num_tokens])


def _graph_seconds(graphs: GraphRunner | None) -> tuple[float, float]:
    """The compile and capture seconds `graphs` has spent so far (none without one)."""
    return (graphs.compile_seconds, graphs.capture_seconds) if graphs is not None else (0.0, 0.0)


class StepTimer:
    """Times one step for the choices of the next ones: an eager decode step under the draft
    budget, what its fed tokens cost (engine.budget); a uniform step whose width was chosen by
    cost, what that width costs (engine.widths), unless it built a new bucket (compile, capture)."""

    __slots__ = ("graphs", "budget", "step_costs", "budgeted", "known", "t0")

    def __init__(self, batch: Batch, chunks: list, graphs: GraphRunner | None, budget: DraftBudget | None,
                 step_costs: StepCosts):
        self.graphs, self.budget, self.step_costs = graphs, budget, step_costs
        timed = batch.step_width is not None  # a width chosen by cost: time the step for the next choices
        # an eager decode step under the draft budget: what its fed tokens cost, for the next choices
        self.budgeted = budget is not None and batch.proposer is not None and not any(c.is_prefill for c in chunks)
        self.t0 = time.perf_counter()
        self.known = len(graphs.graphs) if timed else None  # buckets built before the step

    def ran(self, layout) -> None:
        """After the step's forward: the budget's cost of its fed tokens."""
        if self.budgeted:
            self.budget.costs.record(layout.num_tokens, time.perf_counter() - self.t0)

    def postprocessed(self, layout, path: str) -> None:
        """After the step's postprocess: a uniform step that built no new bucket (no compile, no
        capture), what its width costs."""
        if self.known is not None and path != "eager" and len(self.graphs.graphs) == self.known:
            self.step_costs.record(layout.max_query_len, batch_bucket(layout.num_seqs), time.perf_counter() - self.t0)
