"""The loop: schedule -> propose -> run -> verify -> commit, over the rows of one `generate`
call and of the concurrent calls that join it (engine.batch holds the rows)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..attention.ops import COMPILABLE_BACKENDS
from ..attention.positions import position_embedders
from ..attention.registry import BACKEND_CHOICES, TREE_BACKENDS, resolve_backend, resolve_block_size
from ..steps.head import head_chooser
from ..cpu.huge_pages import to_huge_pages
from ..cpu.packed_weight import pack_linears, packing_bytes, unpack_linears
from ..invariant.linears import CAPTURED_INVARIANT_BACKENDS, InvariantLinears, resolve_invariant
from ..steps.graphs import GraphRunner, batch_bucket
from ..drafting.memory import DraftMemory
from ..drafting.ngram import NgramProposer
from ..drafting.sampling import history_free
from ..drafting.tree import TreeProposer
from ..mixers.recurrent import RecurrentMixers
from ..stats import SpecStats
from .batch import Batch, Call, GenerationResult, joinable
from .budget import Acceptance, DraftBudget
from .distributed import agree_min, agree_seed, tensor_parallel
from .layout import lay_out
from .kv_cache import BlockManager, PagedKVCache, check_cpu_memory, default_num_tokens, layer_specs
from .prefix import PrefixPool, copy_caller_kv
from ..steps.c_layers import CpuLayers
from ..steps.runner import ModelRunner
from .scheduler import Scheduler
from .sequence import DecodeConfig
from .widths import StepCosts, candidate_widths, choose_width

logger = logging.getLogger("hf_plookup")


@dataclass(slots=True)
class EngineOptions:
    """Options given to `hf_plookup.wrap(model, **options)`."""

    max_cache_tokens: int | None = None  # KV capacity in tokens (None: from available memory)
    num_blocks: int | None = None  # KV capacity in blocks (overrides max_cache_tokens)
    block_size: int | None = None  # tokens per page (None: 16, or 256 with flash_attn, which needs multiples of 256)
    max_batch_tokens: int | None = None  # token budget of one prefill step (None: MAX_BATCH_TOKENS by device)
    max_num_seqs: int = 256  # most sequences running at once
    # share of free memory for the KV cache when no capacity is given: of available RAM on CPU;
    # on CUDA of the memory left free after a warm-up forward of max_batch_tokens tokens, less
    # that forward's peak (see kv_cache.default_num_tokens)
    cache_memory_fraction: float = 0.25
    attn_backend: str = "auto"  # "auto" (flash_attn if it can run here, else sdpa) | "sdpa" | "flash_attn" | "triton" | "flash_attn4"
    cuda_graphs: bool = True  # capture verify steps in CUDA graphs (CUDA only; implies pad_drafts)
    pad_drafts: bool = False  # every sequence of a verify step feeds k + 1 tokens (missing drafts padded)
    join_calls: bool = True  # concurrent generate calls join the running loop when their configs allow
    # decode/verify steps through torch.compile (inductor), one graph per bucket, then captured in
    # CUDA graphs when cuda_graphs is on: True | False | "auto" (on where it measured faster: see
    # COMPILE_AUTO)
    compile: bool | str = "auto"
    # drafts (a chain's, a tree's nodes) whose score (estimated chance that verification reaches
    # them) is below this are left out; None: on CPU the drafts that pay for their share of the
    # step by what steps measured to cost (engine.budget), on CUDA every draft
    tree_min_score: float | None = None
    # every token computed bitwise as in a 1-token step (invariant.linears): True | False | "auto"
    # (on where it measured cheap: see invariant.INVARIANT_AUTO)
    invariant: bool | str = "auto"
    # keep full pages of prefilled prompts after a call and reuse them for prompts that start the
    # same way: True | False | "auto" (on where a pooled page holds the bits a fresh prefill
    # computes: with invariant mode, whose prompt chunks are cut at fixed offsets)
    prefix_cache: bool | str = "auto"
    # tokens of earlier calls' outputs kept as a source for candidate trees (drafting.memory); 0: none.
    # Off by default: a call then drafts from its own rows and arguments only, so the same request
    # runs the same way whatever came before it (a benchmark's variants included)
    draft_memory_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_cache_tokens", "num_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if (v is not None or name == "max_num_seqs") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("cuda_graphs", "pad_drafts", "join_calls"):
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
        if (isinstance(self.draft_memory_tokens, bool) or not isinstance(self.draft_memory_tokens, int)
                or self.draft_memory_tokens < 0):
            raise ValueError(f"draft_memory_tokens must be an int >= 0, got {self.draft_memory_tokens!r}")
        if not 0.0 < self.cache_memory_fraction <= 1.0:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction!r}")
        if self.attn_backend not in BACKEND_CHOICES:
            raise ValueError(f"attn_backend must be one of {BACKEND_CHOICES}, got {self.attn_backend!r}")


# a call with at least this many decode steps, most of them eager with graphs or compile on, logs a line (warn_eager)
EAGER_WARN_MIN_STEPS = 8
# Where compile="auto" turns compiled steps on, by device type: where whole generate calls ran faster
# with them than without (docs/results.md, "GPU end to end"). On CUDA, CUDA graphs of the eager
# step won end to end; compiled steps stay opt-in (compile=True) until they win there too.
COMPILE_AUTO = {"cuda": False, "cpu": False}
# tree_min_score=None on CUDA: every draft is offered, and the uniform step's width (engine.widths)
# decides how many each row feeds; on CPU the draft budget decides (engine.budget)
TREE_MIN_SCORE_CUDA = 0.0
# max_batch_tokens=None: tokens of one prefill step by device type. On a GPU an eager step's cost is
# mostly its kernel launches, whatever its tokens, so a batch's prompts go in few large steps (vLLM
# and SGLang chunk prefills at 8192 tokens too); a CPU's step cost grows with its tokens, and smaller
# chunks keep a step's activations in cache.
MAX_BATCH_TOKENS = {"cuda": 8192, "cpu": 1024}
# rows of logits a step keeps that the KV cache's sizing leaves memory for: a prompt chunk keeps one
# row per sequence, a verify step one per fed token (256 sequences of 4 tokens)
LOGITS_ROWS = 1024
# nodes of the trees drafted by default (under the draft budget) per prompt_lookup_num_tokens: room for
# a chain of k and as many alternatives; the budget feeds few of them where steps cost
TREE_NODES_PER_DRAFT = 2
# invariant mode cuts prompts into chunks at multiples of this many tokens from their start (at
# most max_batch_tokens): a chunk's rows then come out the same whatever else runs, and a pooled
# prefix ends where a fresh prefill's chunk would, so the rest of the prompt is chunked as without it
PREFILL_UNIT = 128


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


def sdpa_only_reason(specs: list) -> str | None:
    """Why only the sdpa backend can run layers with these specs, or None."""
    if any(s.value_head_dim for s in specs):
        return "its layers' values have another head size than their keys (multi-head latent attention)"
    if any(s.sinks for s in specs):
        return "its attention has sinks (an extra logit per head in the softmax, as in gpt-oss)"
    return None


def resolve_compile(requested: bool | str, devices: list[torch.device], backend: str, hooked: bool = False,
                    eager_only: str | None = None) -> bool:
    """Whether steps run compiled. True where it cannot work is a ValueError. `hooked`: accelerate
    hooks move or load weights around module calls (`device_map` dispatch, CPU/disk offload),
    which neither a compiled graph nor a CUDA graph can hold. `eager_only`: why this model's steps
    run eagerly only (a patch around each forward, an attention feature the compiled op lacks)."""
    reason = None
    if backend not in COMPILABLE_BACKENDS:
        reason = f"compiled steps support attn_backend {COMPILABLE_BACKENDS}, this model runs {backend!r}"
    elif len(devices) != 1:
        reason = f"compiled steps need the model on one device, it is on {[str(d) for d in devices]}"
    elif hooked:
        reason = "the model is dispatched or offloaded by accelerate (its modules carry hooks)"
    elif eager_only:
        reason = eager_only
    if requested is True and reason is not None:
        raise ValueError(f"compile=True cannot run: {reason}; use compile=False or 'auto'")
    if requested == "auto":
        return reason is None and COMPILE_AUTO.get(devices[0].type, False)
    return bool(requested)


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
        self.specs = layer_specs(model)
        parts.append(("probe", time.perf_counter()))
        devices = sorted({s.device for s in self.specs}, key=str)
        dtypes = sorted({s.dtype for s in self.specs}, key=str)
        backend = resolve_backend(options.attn_backend, devices, dtypes, sdpa_only_reason(self.specs))
        # resolved: the backend that runs (what stats report) and its block size
        chunk = options.max_batch_tokens or MAX_BATCH_TOKENS.get(devices[0].type, MAX_BATCH_TOKENS["cpu"])
        self.options = replace(options, attn_backend=backend, block_size=resolve_block_size(backend, options.block_size),
                               max_batch_tokens=chunk)
        hooked = any(hasattr(m, "_hf_hook") for m in model.modules())  # accelerate dispatch / offload
        # position embedders handed each step's positions (attention.positions)
        self.embedders = position_embedders(model)
        self.use_graphs = options.cuda_graphs and len(devices) == 1 and devices[0].type == "cuda" and not hooked
        # recurrent mixers (hybrid and state-space models): their per-sequence states (mixers.recurrent)
        self.mixers = RecurrentMixers(model)
        eager_only = None  # why steps cannot be compiled or captured
        if self.mixers:
            eager_only = "its recurrent mixers run row by row with each sequence's state"
        elif self.embedders:
            eager_only = "its position embedding counts positions from its cache (they are handed to it eagerly)"
        elif any(s.sinks for s in self.specs):
            eager_only = "its attention has sinks (the compiled attention op has none)"
        self.use_compile = resolve_compile(options.compile, devices, backend, hooked, eager_only)
        self.use_graphs = self.use_graphs and eager_only is None  # a captured step holds neither
        self.tensor_parallel = tensor_parallel(model)  # ranks must agree on every decision (engine.distributed)
        invariant = resolve_invariant(options.invariant, devices, dtypes, backend, compiled=self.use_compile,
                                      hooked=hooked, distributed=self.tensor_parallel)
        packs = invariant and devices[0].type == "cpu" and len(devices) == 1 and not hooked and not self.use_compile
        if devices[0].type == "cpu":  # a cache (and packing) that cannot fit is said now, not by the OOM killer
            tokens = options.num_blocks * self.options.block_size if options.num_blocks else options.max_cache_tokens
            check_cpu_memory(self.specs, tokens, packing_bytes(model) if packs else 0,
                             sum(p.numel() * p.element_size() for p in model.parameters()))
        parts.append(("setup", time.perf_counter()))
        if packs:
            # the C kernels' packed layout becomes the linear weights' only copy (cpu.packed_weight)
            pack_linears(model)
            parts.append(("packing", time.perf_counter()))
            # the other parameters copied off the memory they shared with the linears' originals (a
            # checkpoint's file mapping is then let go), onto 2 MB pages (cpu.huge_pages)
            to_huge_pages(model)
            parts.append(("other weights to 2 MB pages", time.perf_counter()))
        self.prefill_unit = min(PREFILL_UNIT, self.options.max_batch_tokens) if invariant else None
        self.invariant = InvariantLinears(model, self.prefill_unit) if invariant else None
        # invariant decode steps of a Llama-form model in C, two calls a layer (steps.c_layers)
        self.c_layers = CpuLayers.of(model, self.invariant.forms) if invariant else None
        parts.append(("invariant mode's checks", time.perf_counter()))
        if invariant and backend not in CAPTURED_INVARIANT_BACKENDS:
            self.use_graphs = False
        auto = options.tree_min_score is None
        self.tree_min_score = TREE_MIN_SCORE_CUDA if auto else options.tree_min_score
        self._graphs: GraphRunner | None = None
        # unpadded eager CPU steps: drafts fed by measured step costs and acceptance (kept across
        # calls; engine.budget). Padded steps cost their width whatever is fed, and under tensor
        # parallel the ranks would time their steps apart and disagree.
        self.budget = (DraftBudget() if auto and devices[0].type == "cpu" and not self.tensor_parallel
                       and self.pad_to(1) is None else None)
        # uniform verify steps in CUDA graphs take one width per step, from what steps of each width
        # measured to cost and how often drafts were accepted (engine.widths), chains and trees alike
        self.width_policy = self.use_graphs
        self.step_costs = StepCosts()
        # tree nodes' acceptance by score, for those widths (a chain's drafts take their row's rate);
        # kept across calls, as the budget's
        self.acceptance = {"tree": Acceptance()}
        # CPU: the LM head's faster matmul layout for multi-row steps (timed, so not under tensor parallel)
        self.head = None if self.tensor_parallel else head_chooser(model)
        parts.append(("the rest", time.perf_counter()))
        logger.debug("hf_plookup engine built in %.2f s: %s", parts[-1][1] - parts[0][1],
                     ", ".join(f"{name} {t - t0:.2f} s" for (_, t0), (name, t) in zip(parts, parts[1:])))
        self._capacity: int | None = None
        self._cache: PagedKVCache | None = None
        self.blocks: BlockManager | None = None  # the cache's blocks; all free between calls
        self._proposers: dict[tuple[int, int, int], NgramProposer | TreeProposer] = {}
        self._ids = itertools.count()
        self._loop_lock = threading.Lock()  # one engine loop (or delegated HF call) at a time
        self._state_lock = threading.Lock()  # guards _batch and _pending
        self._batch: Batch | None = None  # the running loop's rows
        self._pending: list[Call] = []  # calls waiting to join it at the next step
        # prefix pool (BlockManager): on with invariant mode under "auto"; its pages are kept as
        # long as the weights' fingerprint does not change
        self.prefix_cache = invariant if options.prefix_cache == "auto" else bool(options.prefix_cache)
        if self.mixers:  # a pooled page holds keys, not the recurrent state after it
            if options.prefix_cache is True:
                raise ValueError("prefix_cache=True cannot run: this model's recurrent mixers keep a state per "
                                 "sequence that pooled pages do not hold; use prefix_cache=False or 'auto'")
            self.prefix_cache = False
        bs = self.options.block_size
        unit = self.prefill_unit or max(bs, PREFILL_UNIT // bs * bs)
        if unit % bs:  # a chunk unit that is not whole pages (max_batch_tokens < block_size)
            self.prefix_cache = False
        self.prefix_unit_pages = max(unit // bs, 1)
        self._weights: tuple | None = None  # the fingerprint the pooled pages were computed under
        # what earlier calls generated: a source of candidate trees (drafting.memory)
        self.memory = DraftMemory(options.draft_memory_tokens)

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
                                       c_layers=self.c_layers)
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
        return drafts + 1 if self.options.pad_drafts or self.use_graphs or self.use_compile else None

    def uses_trees(self, cfg: DecodeConfig) -> bool:
        """Candidate trees run when asked for (`prompt_lookup_tree_nodes`, or sources beyond the
        row: `draft_cross_rows`, `draft_corpus`) or by default where the draft budget picks the
        nodes (engine.budget: of a tree's nodes it feeds those that pay, a chain's first drafts
        being among them), the attention backend takes a tree mask, and no logits processor looks
        at the tokens (a tree's branches have different histories); otherwise the call drafts one
        chain of k from its own row. Models with recurrent mixers draft chains: their states
        follow one chain of tokens."""
        asked = cfg.tree_nodes > 0 or cfg.cross_rows or cfg.corpus is not None or self.budget is not None
        return (cfg.k > 0 and asked and self.options.attn_backend in TREE_BACKENDS and history_free(cfg.processors)
                and not self.mixers)

    def proposer(self, cfg: DecodeConfig) -> NgramProposer | TreeProposer | None:
        if cfg.k == 0:
            return None
        # a tree's nodes: as asked, else TREE_NODES_PER_DRAFT per draft of a chain
        nodes = (cfg.tree_nodes or TREE_NODES_PER_DRAFT * cfg.k) if self.uses_trees(cfg) else 0
        key = (cfg.k, cfg.max_ngram, nodes)
        if key not in self._proposers:
            self._proposers[key] = TreeProposer(cfg.k, nodes, cfg.max_ngram) if nodes else NgramProposer(cfg.k, cfg.max_ngram)
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
        """Run steps until every row of `own` and of the calls that join meanwhile is done."""
        cfg = own.cfg
        if cfg.do_sample:
            # the call's sampling seed, from the generator HF's sampling would draw from
            own.seed = int(torch.randint(0, 2**63 - 1, (1,), device=self.specs[0].device).item())
            if self.tensor_parallel:
                # every rank samples with rank 0's seed, so the ranks draw the same tokens
                own.seed = agree_seed(own.seed)
        if self.use_compile:  # compiled steps trace plain parameters: weights packed in place (by
            unpack_linears(self.model)  # another engine of the same modules: cpu.packed_weight) go plain
        cache = self.cache()
        blocks = self.blocks
        graphs = self.graph_runner()
        compile_before = graphs.compile_seconds if graphs is not None else 0.0
        capture_before = graphs.capture_seconds if graphs is not None else 0.0
        sched = Scheduler(blocks, self.options.max_batch_tokens, self.options.max_num_seqs,
                          aligned_prefill=self.prefill_unit, units_per_chunk=1 if self.mixers else None)
        proposer = self.proposer(cfg)
        sized = self.width_policy and isinstance(proposer, TreeProposer)  # trees' widths read the counts
        batch = Batch(cfg, proposer, sched, self._ids, cache, self.tree_min_score, self.budget,
                      self.memory.docs(), self.acceptance if sized else None)
        if self._pool_valid():
            pool = PrefixPool(batch, blocks, cache, self.prefix_unit_pages)
            sched.on_admit, sched.defer, batch.register = pool.admit, pool.defer, pool.register
        else:  # the caller's past_key_values still spare their prefill
            sched.on_admit = functools.partial(copy_caller_kv, batch, blocks, cache)
        drafts = batch.width_drafts if batch.proposer is not None else 0  # plain decoding feeds 1 token per step
        widths = ()  # the widths this call's uniform steps choose among (none: each step's is fixed)
        if self.width_policy and batch.proposer is not None:
            widths = candidate_widths(cfg.k, batch.proposer.budget if batch.tree else 0)
            batch.width_of = lambda chances, drafts: choose_width(self.step_costs, batch_bucket(len(drafts)), widths,
                                                                  chances, drafts)
        if graphs is not None:
            graphs.widths = widths  # a bucket's widths captured together (steps.graphs)
        runner = ModelRunner(self.model, cache, self.options.attn_backend, graphs, self.head, self.invariant,
                             self.c_layers, self.embedders, self.mixers)
        pad_to = self.pad_to(drafts)
        batch.add(own)
        with self._state_lock:
            self._batch = batch
        if cfg.streamer is not None:
            cfg.streamer.put(torch.from_numpy(cfg.hf_input_ids))
        try:
            while True:
                with self._state_lock:  # admit joiners; end the loop only with none pending
                    for call in self._pending:
                        batch.add(call)
                    self._pending.clear()
                    if sched.done:
                        self._batch = None
                        break
                batch.step_width = None  # set by propose, which decode steps alone call
                chunks = sched.schedule(batch.propose)
                layout = lay_out(chunks, batch.history, blocks, cache.scratch_block,
                                 batch.parents if batch.tree else None, batch.pads,
                                 pad_to if batch.step_width is None else batch.step_width, bool(self.embedders))
                timed = batch.step_width is not None  # a width chosen by cost: time the step for the next choices
                # an eager decode step under the draft budget: what its fed tokens cost, for the next choices
                budgeted = self.budget is not None and batch.proposer is not None and not any(c.is_prefill for c in chunks)
                t0 = time.perf_counter()
                if timed:
                    known = len(graphs.graphs)
                logits = runner.run(layout)  # [N, V] at layout.keep
                if budgeted:
                    self.budget.costs.record(layout.num_tokens, time.perf_counter() - t0)
                for call in batch.postprocess(chunks, layout, logits, runner.last_path, runner.last_reason):
                    if call is not own:
                        call.done.set()  # a joiner returns as soon as its rows are done
                if timed and runner.last_path != "eager" and len(graphs.graphs) == known:
                    # a uniform step that built no new bucket (no compile, no capture): what its width costs
                    self.step_costs.record(layout.max_query_len, batch_bucket(layout.num_seqs), time.perf_counter() - t0)
        except BaseException as e:
            with self._state_lock:
                pending, self._pending, self._batch = self._pending, [], None
            for call in batch.calls + pending:
                if call is not own and not call.done.is_set():
                    call.error = e
                    call.done.set()
            raise
        finally:
            blocks.free_all()
            self.mixers.states.clear()
            if graphs is not None:
                own.stats.compile_time += graphs.compile_seconds - compile_before
                own.stats.capture_time += graphs.capture_seconds - capture_before
            if cfg.streamer is not None:
                cfg.streamer.end()
        if graphs is not None:
            warn_eager(own.stats)
        for call in batch.calls:  # what every row generated, a source for the next calls' trees
            for seq in call.seqs:
                self.memory.add(batch.history[seq.row, seq.prompt_len : seq.num_tokens])
        return own.result if own.result is not None else batch.result(own)
