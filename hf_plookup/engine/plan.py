"""What an engine runs with, decided from the model and `wrap`'s options before anything is built
(as `generation.resolve` decides a call's arguments): `EnginePlan.of(model, options)`. The
engine then applies it (engine.Engine): packs weights, builds invariant mode's linears and C
layers, the draft budget, the LM head's chooser."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..attention.ops import COMPILABLE_BACKENDS
from ..attention.positions import position_embedders
from ..attention.registry import resolve_backend, resolve_block_size
from ..cpu.packed_weight import packing_bytes
from ..invariant.linears import CAPTURED_INVARIANT_BACKENDS, resolve_invariant
from ..mixers.recurrent import RecurrentMixers
from .distributed import tensor_parallel
from ..attention.probe import fails_in_inference_mode
from .kv_cache import check_cpu_memory, layer_specs

if TYPE_CHECKING:
    from .engine import EngineOptions

# compile="auto" means off, on every device: "auto" would turn compiled steps on only where whole
# generate calls ran faster with them than without (docs/results.md, "GPU end to end"). On CUDA,
# CUDA graphs of the eager step won whole calls (each new bucket compiles on first use, in timed
# calls too); on CPU compiled steps were no faster than eager ones. Compiled steps stay opt-in
# (compile=True) until they win there too.
COMPILE_BY_DEFAULT = False
# tree_min_score=None on CUDA: every draft is offered, and the uniform step's width (engine.widths)
# decides how many each row feeds; on CPU the draft budget decides (engine.budget)
TREE_MIN_SCORE_CUDA = 0.0
# max_batch_tokens=None: tokens of one prefill step by device type. On a GPU an eager step's cost is
# mostly its kernel launches, whatever its tokens, so a batch's prompts go in few large steps (vLLM
# and SGLang chunk prefills at 8192 tokens too); a CPU's step cost grows with its tokens, and smaller
# chunks keep a step's activations in cache.
MAX_BATCH_TOKENS = {"cuda": 8192, "cpu": 1024}
# invariant mode cuts prompts into chunks at multiples of this many tokens from their start (at
# most max_batch_tokens): a chunk's rows then come out the same whatever else runs, and a pooled
# prefix ends where a fresh prefill's chunk would, so the rest of the prompt is chunked as without it
PREFILL_UNIT = 128


def pads_drafts(pad_drafts: bool, use_graphs: bool, use_compile: bool) -> bool:
    """Whether every row of a verify step feeds the step's whole width (missing drafts padded):
    asked for (`pad_drafts`), or needed by steps in CUDA graphs or compiled per bucket."""
    return pad_drafts or use_graphs or use_compile


def sdpa_only_reason(specs: list) -> str | None:
    """Why only the sdpa backend can run layers with these specs, or None."""
    if any(s.value_head_dim for s in specs):
        return "its layers' values have another head size than their keys (multi-head latent attention)"
    if any(s.sinks for s in specs):
        return "its attention has sinks (an extra logit per head in the softmax, as in gpt-oss)"
    return None


def eager_only_reason(specs: list, embedders: list, mixers: RecurrentMixers) -> str | None:
    """Why this model's steps can be neither compiled nor captured in CUDA graphs, or None."""
    if mixers:
        return "its recurrent mixers run row by row with each sequence's state"
    if embedders:
        return "its position embedding counts positions from its cache (they are handed to it eagerly)"
    if any(s.sinks for s in specs):
        return "its attention has sinks (the compiled attention op has none)"
    return None


def resolve_compile(requested: bool | str, devices: list[torch.device], backend: str, hooked: bool = False,
                    eager_only: str | None = None) -> bool:
    """Whether steps run compiled. True where it cannot work is a ValueError; "auto" is
    COMPILE_BY_DEFAULT where it can. `hooked`: accelerate hooks move or load weights around
    module calls (`device_map` dispatch, CPU/disk offload), which neither a compiled graph nor a
    CUDA graph can hold. `eager_only`: why this model's steps run eagerly only (a patch around
    each forward, an attention feature the compiled op lacks)."""
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
        return reason is None and COMPILE_BY_DEFAULT
    return bool(requested)


def prefix_policy(requested: bool | str, invariant: bool, mixers: RecurrentMixers, block_size: int,
                  prefill_unit: int | None) -> tuple[bool, int]:
    """(whether calls keep and reuse their prompts' full pages: the prefix pool, the pages of one
    prefill unit: a pooled prefix ends on one). "auto": on with invariant mode, where a pooled
    page holds the bits a fresh prefill computes (its prompt chunks are cut at fixed offsets).
    Never for recurrent mixers (prefix_cache=True is then a ValueError): a pooled page holds
    keys, not the recurrent state after it."""
    on = invariant if requested == "auto" else bool(requested)
    if mixers:
        if requested is True:
            raise ValueError("prefix_cache=True cannot run: this model's recurrent mixers keep a state per "
                             "sequence that pooled pages do not hold; use prefix_cache=False or 'auto'")
        on = False
    unit = prefill_unit or max(block_size, PREFILL_UNIT // block_size * block_size)
    if unit % block_size:  # a chunk unit that is not whole pages (max_batch_tokens < block_size)
        on = False
    return on, max(unit // block_size, 1)


def _check_cpu_memory(model: torch.nn.Module, options: EngineOptions, specs: list, packs: bool) -> None:
    """A CPU cache (and packing) that cannot fit is said now, not by the OOM killer. `options`:
    resolved (their block_size)."""
    tokens = options.num_blocks * options.block_size if options.num_blocks else options.max_cache_tokens
    check_cpu_memory(specs, tokens, packing_bytes(model) if packs else 0,
                     sum(p.numel() * p.element_size() for p in model.parameters()))


@dataclass(slots=True)
class EnginePlan:
    """How an engine runs a model: `of` decides it, `Engine.__init__` applies it."""

    options: EngineOptions  # resolved: attn_backend, block_size and max_batch_tokens as they run (what stats report)
    specs: list  # each attention layer's LayerSpec (engine.kv_cache.layer_specs: the probe)
    devices: list[torch.device]
    dtypes: list[torch.dtype]
    hooked: bool  # accelerate dispatch / offload: hooks move or load weights around module calls
    embedders: list  # position embedders handed each step's positions (attention.positions)
    # recurrent mixers (hybrid and state-space models): their per-sequence states (mixers.recurrent)
    mixers: RecurrentMixers
    eager_only: str | None  # why steps cannot be compiled or captured
    use_compile: bool  # decode/verify steps through torch.compile (resolve_compile)
    use_graphs: bool  # verify steps captured in CUDA graphs (steps.graphs)
    tensor_parallel: bool  # ranks must agree on every decision (engine.distributed)
    invariant: bool  # invariant mode (invariant.linears)
    # the C kernels' packed layout becomes the linear weights' only copy (cpu.packed_weight): CPU
    # invariant mode on one device, neither hooked nor compiled
    packs: bool
    prefill_unit: int | None  # invariant mode: prompts cut at multiples of this (PREFILL_UNIT)
    tree_min_score: float  # drafts scoring below it are left out (EngineOptions.tree_min_score)
    # unpadded eager CPU steps: drafts fed by measured step costs and acceptance (engine.budget).
    # Padded steps cost their width whatever is fed, and under tensor parallel the ranks would
    # time their steps apart and disagree.
    budget: bool
    # uniform verify steps in CUDA graphs take one width per step, from what steps of each width
    # measured to cost and how often drafts were accepted (engine.widths), chains and trees alike
    width_policy: bool
    prefix_cache: bool  # the prefix pool (prefix_policy)
    prefix_unit_pages: int  # pages of one prefill unit
    # why greedy may part from HF's greedy after a near-tie: the probe's note on a quantized
    # model's row-count dependent arithmetic (attention.probe, FLOOR_MARGIN); "" for any other
    exactness_note: str = ""
    # steps under torch.no_grad instead of torch.inference_mode: the model's own forward fails in
    # inference mode (attention.probe.fails_in_inference_mode)
    no_grad: bool = False

    @property
    def grad_mode(self):
        """The context the model's forwards run in: torch.inference_mode, or torch.no_grad."""
        return torch.no_grad if self.no_grad else torch.inference_mode

    @classmethod
    def of(cls, model: torch.nn.Module, options: EngineOptions, timings: list | None = None) -> EnginePlan:
        """The plan for `model` under `options`; a ValueError where an option asked for cannot run.
        `timings`: ("probe", time) is appended once the layers are probed (wrap's parts)."""
        notes: list[str] = []
        no_grad = False
        try:
            specs = layer_specs(model, notes)
        except ValueError as e:
            if not fails_in_inference_mode(e):
                raise
            no_grad, notes = True, []
            specs = layer_specs(model, notes, grad_mode=torch.no_grad)
        if timings is not None:
            timings.append(("probe", time.perf_counter()))
        devices = sorted({s.device for s in specs}, key=str)
        dtypes = sorted({s.dtype for s in specs}, key=str)
        backend = resolve_backend(options.attn_backend, devices, dtypes, sdpa_only_reason(specs))
        chunk = options.max_batch_tokens or MAX_BATCH_TOKENS.get(devices[0].type, MAX_BATCH_TOKENS["cpu"])
        resolved = replace(options, attn_backend=backend, block_size=resolve_block_size(backend, options.block_size),
                           max_batch_tokens=chunk)
        hooked = any(hasattr(m, "_hf_hook") for m in model.modules())
        embedders, mixers = position_embedders(model), RecurrentMixers(model)
        eager_only = eager_only_reason(specs, embedders, mixers)
        use_compile = resolve_compile(options.compile, devices, backend, hooked, eager_only)
        distributed = tensor_parallel(model)
        invariant = resolve_invariant(options.invariant, devices, dtypes, backend, compiled=use_compile,
                                      hooked=hooked, distributed=distributed)
        one = devices[0].type if len(devices) == 1 and not hooked else None  # the one device's type, unhooked
        # a captured step holds neither eager-only parts nor invariant steps off CAPTURED_INVARIANT_BACKENDS
        use_graphs = (options.cuda_graphs and one == "cuda" and eager_only is None
                      and not (invariant and backend not in CAPTURED_INVARIANT_BACKENDS))
        packs = invariant and one == "cpu" and not use_compile
        if devices[0].type == "cpu":
            _check_cpu_memory(model, resolved, specs, packs)
        prefill_unit = min(PREFILL_UNIT, chunk) if invariant else None
        auto = options.tree_min_score is None
        padded = pads_drafts(options.pad_drafts, use_graphs, use_compile)
        prefix_cache, unit_pages = prefix_policy(options.prefix_cache, invariant, mixers, resolved.block_size,
                                                 prefill_unit)
        return cls(options=resolved, specs=specs, devices=devices, dtypes=dtypes, hooked=hooked, embedders=embedders,
                   mixers=mixers, eager_only=eager_only, use_compile=use_compile, use_graphs=use_graphs,
                   tensor_parallel=distributed, invariant=invariant, packs=packs, prefill_unit=prefill_unit,
                   tree_min_score=TREE_MIN_SCORE_CUDA if auto else options.tree_min_score,
                   budget=auto and devices[0].type == "cpu" and not distributed and not padded,
                   width_policy=use_graphs, prefix_cache=prefix_cache, prefix_unit_pages=unit_pages,
                   exactness_note=" ".join(notes), no_grad=no_grad)
