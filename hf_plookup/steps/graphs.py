"""CUDA graphs for uniform decode/verify steps.

Every running sequence feeds exactly `q = k + 1` tokens (the runner pads missing drafts), so a
step's shapes depend only on the batch size B and the longest context Lk. Both are rounded up
to buckets (B to 1, 2, 4, 8, ...; Lk to a power-of-two number of pages, at least two), the
step's layout is padded to the bucket (`pad_layout`: dummy rows feed token 0 at positions
0..q-1 and write into the cache's scratch page), and one graph per `(q, B bucket, Lk bucket,
tree)` is captured lazily, the first time such a step runs (or at wrap time: `warm`,
engine.warmup): a warm-up forward on a side stream, then the capture into a graph memory pool
shared by all graphs (they never run concurrently). Where a call's steps choose their width
among a few (`widths`, engine.widths), the first step in a new
`(B bucket, Lk bucket, tree)` captures every one of those widths there at once (on rows that are
all dummies: `dummy_layout`), so which widths later steps pick by their timings never makes a
later call capture: new graphs come only with buckets a call has not met before. Each bucket keeps
its step arrays in one buffer (`Staging`): the graph's static input buffers are views of its
device copy, the bucket's host layout views of its host copy. A step of chains whose bucket exists
is laid out straight into the host copy (engine.layout.lay_out_staged), any other is padded into
it; a replay then uploads the buffer in one copy (none on CPU, where both are one), replays, and
returns the logits of the kept rows. Prefill steps and batches beyond the largest bucket run
eagerly.

`capture=False` runs the same static-buffer forward without a graph: the padding and buffer
layout are then testable on CPU (tests/attention/test_backends.py); the capture itself needs
CUDA (tests/gpu).

`compiled=True` runs that forward through `torch.compile(fullgraph=True, dynamic=False)`
(inductor), the attention as the custom op of attention.ops, the metadata found through
`metadata.compiled_step_context`, whose key dimension (Lk) is marked dynamic: a compile serves every
context bucket of its step width and batch bucket. Captured steps compile one decoder layer per
such bucket and run every layer through it (steps.regional); uncaptured ones compile the whole forward,
as they would otherwise run dynamo's guard checks once per layer and step and lose frozen
weights (docs/results.md, "... compiling on CPU"). On CUDA the compiled forward is then captured like
the eager one (compile first, in the warm-up, then capture its kernels), so a replay launches
inductor's fused kernels from one graph. The seconds spent in first calls of new buckets add
up in `compile_seconds` (compile plus warm-up) and `capture_seconds` (the capture; with an eager
forward, its warm-up too).

`invariant` (a invariant.linears.InvariantLinears): every step runs in invariant mode on its
padded layout; the mode's linears and attention are custom ops, opaque to the compiler. Which
backends' invariant form a graph can capture: invariant.linears.CAPTURED_INVARIANT_BACKENDS.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata
from ..base.layout import DEVICE_ARRAYS, StepLayout
from ..invariant.linears import check_capturable
from .forward import StepForward
from .head import head_chooser
from .regional import RegionalLayers, decoder_layers

if TYPE_CHECKING:
    from ..engine.kv_cache import PagedKVCache


def _import_mkldnn_quietly() -> None:
    """Inductor's pre-grad passes import `torch.utils.mkldnn`, whose classes still use the
    deprecated `torch.jit.script_method` (torch 2.13): 14 DeprecationWarnings on the first compile,
    about torch's own code, which neither hf_plookup nor its users call. Importing that module
    here with only that message silenced keeps the first compile quiet; any other warning shows."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method`", category=DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
COMPILE_BACKEND = "inductor"  # torch.compile backend of compiled steps (tests trace with "aot_eager")


def batch_bucket(num_seqs: int) -> int | None:
    """Smallest bucket holding `num_seqs` sequences (None when beyond the largest)."""
    for b in BATCH_BUCKETS:
        if b >= num_seqs:
            return b
    return None


def context_bucket(max_context_len: int, block_size: int) -> int:
    """Lk rounded up to a power-of-two number of pages, at least two: compiled steps take the key
    dimension as dynamic, and torch specializes a dimension of size 1 (a one-page bucket would
    compile apart)."""
    pages = max(-(-max_context_len // block_size), 2)
    return block_size * (1 << (pages - 1).bit_length())


def pad_layout(layout: StepLayout, num_seqs: int, max_context_len: int, block_size: int, scratch: int) -> StepLayout:
    """A uniform decode `layout` padded to `num_seqs` rows and `max_context_len` keys; its real rows
    and `keep` are the layout's own. Dummy rows feed token 0 at positions 0..q-1 as chains, keep
    their K/V in the scratch page and attend to their own q keys; spare table entries and key
    slots point at the scratch page. A dummy row wider than the page (a tree of more nodes than a
    page has slots) wraps around it: its token j writes slot j mod block_size, so dummies share
    slots, which only they read and whose outputs nobody keeps."""
    if not layout.uniform or not layout.is_decode:
        raise ValueError("only uniform decode steps are padded to graph buckets")
    b, q, lk = layout.num_seqs, layout.max_query_len, layout.max_context_len
    bb, lkb = num_seqs, max_context_len
    if bb < b or lkb < lk or lkb % block_size:
        raise ValueError(f"bucket ({bb}, {lkb}) does not hold a step of ({b}, {lk})")
    pad_slot = scratch * block_size
    j = np.arange(q, dtype=np.int64)
    wrapped = pad_slot + j % block_size  # a dummy row's slots in the scratch page

    def rows(real: np.ndarray, dummy: np.ndarray) -> np.ndarray:  # the real rows, then dummies to the bucket
        return np.concatenate([real, dummy[len(real):]])

    kv_slots = np.full((bb, lkb), pad_slot, dtype=np.int64)
    kv_slots[:b, :lk] = layout.kv_slots
    kv_slots[b:, :q] = wrapped
    tables = np.full((bb, lkb // block_size), scratch, dtype=np.int64)
    tables[:b, : layout.block_tables.shape[1]] = layout.block_tables
    ctx = rows(layout.context_lens, np.full(bb, q, dtype=np.int64))
    cu_k = np.zeros(bb + 1, dtype=np.int64)
    np.cumsum(ctx, out=cu_k[1:])
    tree = None
    if layout.tree_mask is not None:
        tree = rows(layout.tree_mask, np.broadcast_to(np.tril(np.ones((q, q), dtype=bool)), (bb, q, q)))
    return StepLayout(
        input_ids=rows(layout.input_ids, np.zeros(bb * q, dtype=np.int64)),
        positions=rows(layout.positions, np.tile(j, bb)),
        depth=rows(layout.depth, np.tile(j, bb)),
        slot_mapping=rows(layout.slot_mapping, np.tile(wrapped, bb)),
        keep=layout.keep,
        prefill=np.zeros(bb, dtype=bool),
        query_pos=rows(layout.query_pos, np.tile(j, (bb, 1))),
        kv_slots=kv_slots, context_lens=ctx, block_tables=tables,
        cu_seqlens_q=np.arange(bb + 1, dtype=np.int64) * q, cu_seqlens_k=cu_k, tree_mask=tree,
    )


def dummy_layout(q: int, tree: bool) -> StepLayout:
    """A uniform decode step of no rows feeding `q` tokens each (with an empty tree mask where
    `tree`): `pad_layout` makes it a bucket of dummy rows only, the layout a graph of width `q` is
    captured on before any step of that width needs it.

    Example: pad_layout(dummy_layout(5, False), 4, 64, 16, scratch) has 4 rows of 5 tokens, every
    slot in the scratch page, and keeps no logits."""
    none = np.zeros(0, dtype=np.int64)
    return StepLayout(input_ids=none, positions=none, depth=none, slot_mapping=none, keep=none,
                      prefill=np.zeros(0, dtype=bool), query_pos=np.zeros((0, q), dtype=np.int64),
                      kv_slots=np.zeros((0, 0), dtype=np.int64), context_lens=none,
                      block_tables=np.zeros((0, 0), dtype=np.int64), cu_seqlens_q=np.zeros(1, dtype=np.int64),
                      cu_seqlens_k=np.zeros(1, dtype=np.int64),
                      tree_mask=np.zeros((0, q, q), dtype=bool) if tree else None)


def raise_recompile_limit(n: int) -> None:
    """Let dynamo keep `n` compiled graphs of one function (one per bucket, and per kind of layer
    in regional compilation; its default is 8) and as many in all (its default is 256)."""
    import torch._dynamo.config as cfg

    # the names changed across torch versions
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


# a staged bucket's arrays start at multiples of this many bytes of its buffer (what kernels and
# inductor's compiled code expect of an input's alignment)
_ALIGN = 64


class Staging:
    """One bucket's step arrays in one buffer: every array the device reads of a padded step
    (`DEVICE_ARRAYS`, in their device dtypes) and the kept rows, laid end to end in one flat
    host buffer (pinned on CUDA), which goes to the device in one copy; the static buffers a graph
    replays are views of its device twin (on CPU, of the host buffer itself: no copy at all).
    `layout` is the host half, a `StepLayout` over views of the same buffer (the int64 forms that
    the device reads as int32, and `depth`, `prefill`, are host-only arrays beside it): a step is
    laid out by writing into it (engine.layout.lay_out_staged, or `write` from a padded layout).

    Kept across steps, so nothing is allocated per step: only the arrays' contents change, and a
    step's `keep` is a view of the bucket's longest one."""

    __slots__ = ("host", "device", "arrays", "inputs", "layout", "keep", "copied", "pad_page", "_keep_host")

    def __init__(self, padded: StepLayout, device: torch.device, pad_page: int):
        self.pad_page = pad_page  # the cache's scratch page: padding's table entries and slots
        shapes = {}
        for name, (src, dtype) in DEVICE_ARRAYS.items():
            a = getattr(padded, src)
            if a is not None:
                shapes[name] = (a.shape, np.dtype(dtype))
        b, q = padded.query_pos.shape
        shapes["keep"] = ((b * q,), np.dtype(np.int64))
        offsets, size = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = size
            size += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // _ALIGN) * _ALIGN
        pinned = device.type == "cuda"
        self.host = torch.empty(max(size, _ALIGN), dtype=torch.uint8, pin_memory=pinned)
        self.device = self.host if device.type == "cpu" else torch.empty_like(self.host, device=device)
        raw = self.host.numpy()
        self.arrays: dict[str, np.ndarray] = {}  # name -> host view (DEVICE_ARRAYS' names, then "keep")
        self.inputs: dict[str, torch.Tensor] = {}  # name -> device view: the static buffers
        for name, (shape, dtype) in shapes.items():
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            self.arrays[name] = raw[offsets[name] : offsets[name] + n].view(dtype).reshape(shape)
            self.inputs[name] = (self.device[offsets[name] : offsets[name] + n]
                                 .view(_TORCH_DTYPES[dtype]).view(shape))
        self.keep = self.inputs.pop("keep")
        self._keep_host = self.arrays.pop("keep")
        a = self.arrays
        # the host layout: device arrays in int64 where the device reads them so, host copies of the rest
        self.layout = StepLayout(
            input_ids=a["input_ids"], positions=a["positions"], depth=padded.depth.copy(),
            slot_mapping=a["slot_mapping"], keep=self._keep_host[:0], prefill=np.zeros(b, dtype=bool),
            query_pos=a["query_pos"], kv_slots=a["kv_slots"], context_lens=a["context_lens"],
            block_tables=padded.block_tables.astype(np.int64), cu_seqlens_q=padded.cu_seqlens_q.astype(np.int64),
            cu_seqlens_k=padded.cu_seqlens_k.astype(np.int64), tree_mask=a.get("tree_mask"))
        self.copied = None  # CUDA: the event after the last upload (the host buffer is free once it passed)
        self.write(padded)

    def wait(self) -> None:
        """Before the host buffer is written: the last upload from it has finished (CUDA)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def keep_rows(self, n: int) -> None:
        """The step keeps the logits of its first `n` kept rows (`self._keep_host[:n]`, written)."""
        self.layout.keep = self._keep_host[:n]

    @property
    def keep_host(self) -> np.ndarray:
        """[Bb*q] int64: where a step's kept rows are written (the first `len(layout.keep)`)."""
        return self._keep_host

    def write(self, padded: StepLayout) -> None:
        """Write a padded step of this bucket's shapes into the buffer (a step not laid out here)."""
        self.wait()
        for name, (src, _) in DEVICE_ARRAYS.items():
            if name in self.arrays:
                self.arrays[name][...] = getattr(padded, src)
        lay = self.layout
        lay.depth[...] = padded.depth
        lay.prefill[...] = padded.prefill
        lay.block_tables[...] = padded.block_tables
        lay.cu_seqlens_q[...] = padded.cu_seqlens_q
        lay.cu_seqlens_k[...] = padded.cu_seqlens_k
        self._keep_host[: len(padded.keep)] = padded.keep
        self.keep_rows(len(padded.keep))

    def upload(self) -> torch.Tensor:
        """The written step to the device (one copy; none on CPU). Returns its kept rows there."""
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)
            if self.device.is_cuda:  # the copy from pinned memory runs on: the host waits before rewriting
                self.copied = torch.cuda.Event()
                self.copied.record()
        return self.keep[: len(self.layout.keep)]


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (torch's own counter; any model's)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}


@dataclass(slots=True)
class _Graph:
    staging: Staging  # the bucket's step arrays: host layout, upload buffer, static device buffers
    meta: AttentionMetadata  # over the static buffers
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [Bb*q, V] static output of the graph

    @property
    def inputs(self) -> dict[str, torch.Tensor]:  # static buffers: the padded layout's device arrays
        return self.staging.inputs

    @property
    def layout(self) -> StepLayout:  # the padded layout the buffers hold
        return self.staging.layout


class GraphRunner:
    """Captured (or, with capture=False, eagerly run) uniform decode steps, kept across calls."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, backend: str, max_num_seqs: int,
                 capture: bool = True, compiled: bool = False, invariant=None, regional: bool | None = None,
                 c_layers=None, grad_mode=torch.inference_mode):
        if cache.scratch_block is None:
            raise ValueError("CUDA graphs need a cache with a scratch page (PagedKVCache(..., scratch=True))")
        self.model = model
        self.cache = cache
        self.backend = backend
        self.grad_mode = grad_mode  # the context steps run in (steps.runner.ModelRunner's)
        self.block_size = cache.block_size
        self.max_batch = batch_bucket(max_num_seqs) or BATCH_BUCKETS[-1]
        # CPU: the LM head's faster layout (not in invariant mode: the linears are its own)
        head = head_chooser(model) if not compiled and invariant is None else None
        self.forward = StepForward(model, cache, backend, head, invariant, c_layers)
        self.device = self.forward.device
        self.capture = capture
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, got {self.device}")
        self.graphs: dict[tuple[int, int, int, bool], _Graph] = {}  # (q, B bucket, Lk bucket, tree)
        self._staged: set[int] = set()  # ids of the buckets' host layouts (kept as long as their graphs)
        self.pool = None  # graph memory pool shared by all captures
        self.num_replays = 0
        # the widths the running call's uniform steps choose among (engine.widths; set by the
        # engine per call, empty where each step's width is fixed): captured together per bucket
        self.widths: tuple[int, ...] = ()
        self.compiled = compiled
        self.compile_seconds = 0.0  # first calls of new buckets (compile + warm-up) when compiled
        self.capture_seconds = 0.0  # graph captures of new buckets (with the eager warm-up when not compiled)
        # what is compiled: one decoder layer serving all layers (steps.regional) where steps are
        # captured (`regional=None`: iff `capture`), as a replay never runs the 30-odd compiled calls'
        # guards again; else the whole forward, one compiled call per step (and, on CPU, frozen weights)
        self._compiled_forward = None  # the whole forward compiled
        self._regional = None  # steps.regional: one compiled decoder layer for all layers
        self.invariant = invariant  # a invariant.linears.InvariantLinears: every step in invariant mode
        if invariant is not None and capture:
            check_capturable(backend)
        if compiled:
            from ..attention.ops import check_compilable

            check_compilable(backend)
            # q values x kinds of layer (regional) x batch buckets x context buckets, generously
            raise_recompile_limit(4 * 4 * len(BATCH_BUCKETS) * 16)
            _import_mkldnn_quietly()
            options = {"freezing": True} if self.device.type == "cpu" and COMPILE_BACKEND == "inductor" else None
            compile_fn = functools.partial(torch.compile, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND,
                                           options=options)
            if (capture if regional is None else regional) and decoder_layers(model):
                self._regional = RegionalLayers(model, cache, compile_fn)
            else:
                self._compiled_forward = compile_fn(self.forward.logits)

    @property
    def path(self) -> str:
        """How the steps this runner takes run (SpecStats.decode_steps_by_path): "graph" (a captured
        graph replayed), "compiled" (the bucket's compiled forward, uncaptured) or "static" (the
        bucket's static buffers, run eagerly)."""
        return "graph" if self.capture else "compiled" if self.compiled else "static"

    def unsupported(self, layout: StepLayout) -> str | None:
        """Why this runner cannot take the step (it then runs eagerly), or None when it can."""
        if id(layout) in self._staged:  # laid out in a bucket's buffer: a step this runner takes
            return None
        if not layout.is_decode:
            return "a prompt chunk"
        if not layout.uniform:
            return "rows feed different numbers of tokens"
        if layout.num_seqs > self.max_batch:
            return f"more rows than the largest batch bucket ({self.max_batch})"
        if not len(layout.keep):
            return "no row keeps logits"
        return None

    def _static(self, padded: StepLayout) -> _Graph:
        staging = Staging(padded, self.device, self.cache.scratch_block)
        staging.upload()
        meta = self.forward.metadata(staging.inputs, static_shapes=True)
        if self.compiled:
            # the key dimension dynamic: one compiled step (or decoder layer) of a (q, B bucket, tree)
            # serves every context bucket, where each new context bucket would compile again (the
            # attention is an opaque op, so nothing the compiler generates depends on it); where a
            # model's code specializes on it, the compiler falls back to compiling per bucket
            for t in (meta.kv_slots, meta.block_tables):
                if t is not None and t.dim() == 2:
                    torch._dynamo.maybe_mark_dynamic(t, 1)
        return _Graph(staging, meta)

    def staged(self, q: int, num_seqs: int, max_context_len: int, tree: bool = False) -> Staging | None:
        """The buffer of the bucket that a uniform decode step of `num_seqs` rows feeding `q` tokens
        each, with `max_context_len` keys, runs in, for the step to be laid out into
        (engine.layout.lay_out_staged; `run` then uploads its layout as it is); None where that
        bucket has no graph yet (its first step is laid out and padded the plain way, and builds it)."""
        bb = batch_bucket(num_seqs)
        if bb is None or bb > self.max_batch:
            return None
        g = self.graphs.get((q, bb, context_bucket(max_context_len, self.block_size), tree))
        if g is None:
            return None
        g.staging.wait()
        return g.staging

    def _forward(self, g: _Graph) -> torch.Tensor:
        """The model on the static buffers (holding `g.layout`); logits of every fed row, [Bb*q, V]."""
        g.meta._masks.clear()  # masks are rebuilt from the buffers inside the forward (and the graph)
        ids, pos = g.inputs["input_ids"], g.inputs["positions"]
        if self._compiled_forward is not None:
            with self.forward.active(g.layout, g.meta, compiled=True):
                return self._compiled_forward(ids, pos)
        if self._regional is not None:
            with self.forward.active(g.layout, g.meta, compiled=True), self._regional.active():
                return self.forward.logits(ids, pos)
        return self.forward.run(g.layout, g.inputs, g.meta, 0)

    def _capture(self, g: _Graph) -> None:
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(g)  # warm-up: lazy inits, cuBLAS handles, flash-attn's first call; compiles
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.logits = self._forward(g)
        if self.pool is None:
            self.pool = g.graph.pool()
        if self.compiled:
            self.compile_seconds += t1 - t0
            self.capture_seconds += time.perf_counter() - t1
        else:
            self.capture_seconds += time.perf_counter() - t0

    def _build(self, key: tuple[int, int, int, bool], padded: StepLayout) -> _Graph:
        """The bucket `key`'s static buffers over `padded`, captured (or, uncaptured but compiled,
        compiled by a first forward, so compile_seconds holds it)."""
        t0 = time.perf_counter()
        g = self._static(padded)
        if self.capture:
            self._capture(g)
        elif self.compiled:
            self._forward(g)
            self.compile_seconds += time.perf_counter() - t0
        self.graphs[key] = g
        self._staged.add(id(g.layout))
        return g

    def _build_dummy(self, q: int, bb: int, lkb: int, tree: bool) -> bool:
        """The bucket (q, bb, lkb, tree) built on rows that are all padding, unless it exists.
        True if it was built."""
        if (q, bb, lkb, tree) in self.graphs:
            return False
        dummies = pad_layout(dummy_layout(q, tree), bb, lkb, self.block_size, self.cache.scratch_block)
        self._build((q, bb, lkb, tree), dummies)
        return True

    def warm(self, q: int, num_seqs: int, tree: bool, max_context_len: int) -> int:
        """Build every bucket that uniform steps of `q` tokens a row, up to `num_seqs` rows, with up
        to `max_context_len` keys, run in (engine.warmup), in the grad mode steps run in. Returns
        how many were new.

        Example: block_size 16, warm(5, 3, False, 100): batch bucket 4, context buckets 32, 64 and
        128: 3 buckets (one compile where compiled; a capture each where captured)."""
        bb = batch_bucket(num_seqs)
        if bb is None or bb > self.max_batch:
            raise ValueError(f"{num_seqs} rows are more than the largest batch bucket ({self.max_batch})")
        built, lkb = 0, context_bucket(q, self.block_size)
        with self.grad_mode():
            while lkb <= context_bucket(max_context_len, self.block_size):
                built += self._build_dummy(q, bb, lkb, tree)
                lkb *= 2
        return built

    def run(self, layout: StepLayout) -> torch.Tensor:
        """Logits of the layout's kept rows, `[N, V]` (a fresh tensor, safe across replays)."""
        with self.grad_mode():
            return self._run(layout)

    def _run(self, layout: StepLayout) -> torch.Tensor:
        bb = batch_bucket(layout.num_seqs)
        lkb = context_bucket(layout.max_context_len, self.block_size)
        tree = layout.tree_mask is not None
        key = (layout.max_query_len, bb, lkb, tree)
        g = self.graphs.get(key)
        if g is None or layout is not g.layout:  # not laid out in the bucket's buffer: padded to it here
            padded = pad_layout(layout, bb, lkb, self.block_size, self.cache.scratch_block)
            if g is None:
                g = self._build(key, padded)
                # the call's other widths at this bucket too (compiled: one compile per width and
                # batch bucket, which every context bucket shares)
                for q in self.widths:
                    self._build_dummy(q, bb, lkb, tree)
            else:
                g.staging.write(padded)
        keep = g.staging.upload()
        if self.capture:
            g.graph.replay()
            logits = g.logits
        elif self.compiled:
            # a bucket built before can still compile again: a guard of its compiled code failed
            # (the model changed in a way dynamo checks, or torch dropped its compiled code), which
            # counts as compiling, not as the step
            before, t0 = _compiled_graphs(), time.perf_counter()
            logits = self._forward(g)
            if _compiled_graphs() != before:
                self.compile_seconds += time.perf_counter() - t0
        else:
            logits = self._forward(g)
        self.num_replays += 1
        return logits.index_select(0, keep)
