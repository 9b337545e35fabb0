"""Invariant mode: inside engine forwards, a token's hidden states, keys/values and logits are
bitwise the same whether it runs in a 1-token step, a verify or tree step, alone or beside other
rows, whatever the prefill chunking. Greedy with drafts then equals greedy without in every
dtype, and seeded sampling does not depend on the batch.

Pieces (the user's model outside `generate` is untouched: everything is switched on around one
engine forward and restored after):

- **attention**: on sdpa, `invariant.attention` (on CPU the decode queries through
  `cpu.kernels.attend`, elsewhere one SDPA call per decode query over exactly its keys;
  prompt chunks per sequence, cut at fixed offsets by the scheduler); on Triton, the
  kernel's invariant form (`attention.triton.paged_attention(invariant=True)`: query blocks
  and key splits of fixed sizes).
- **linear layers and LM head** (`InvariantLinears`): every `nn.Linear` of the model (and each
  layer `linear_module` finds computing just `F.linear`, such as a frozen quanto `QLinear`) goes
  through the op `hf_plookup::invariant_linear`, which computes each decode row exactly as it
  would be alone. How is decided once per weight shape, dtype, device and thread count by a
  check on this machine (`row_strategy`: rows of 2..PROBE_ROWS-row calls bitwise equal to 1-row
  calls on random inputs), the first that passes of: `"cpu"` (cpu.kernels, fp32/bf16/fp16 on
  CPU: row-invariant by construction and faster than torch's call at every decode row count),
  `"plain"` (torch's batched call, in pieces of at most `PROBE_ROWS` rows), `"numba"`
  (invariant.row_linear, fp32 on CPU where the C kernels were not built), `"triton"`
  (invariant.triton_linear, CUDA); else `"rows"` (one 1-row call per row: equal by construction).
  A prompt chunk's rows need only be the same in every batch, not equal to 1-row calls: the
  "cpu" kernel for bf16 and for fp32 chunks of up to PREFILL_TORCH_ROWS rows (without it, such
  chunks take the weight's decode strategy: a short call's rows change with its row count, and
  where a prompt is cut depends on the step's other work), else torch's call,
  and that call takes the step's neighbouring chunks with it where `merge_safe` found that its
  rows do not depend on the call's length (one GEMM of many rows is faster than several).
- **RMSNorm modules** on CPU whose arithmetic `cpu_kernels.rms_norm` reproduces (`rms_form`
  checks each on random rows): one C call per norm instead of HF's half-dozen torch ops.
- **everything else** (embeddings, other norms, RoPE, activations, residuals, the KV write) is
  per-row elementwise work or per-row reductions; tests/invariant/test_linears.py checks the whole
  forward bitwise on the tiny architectures.

Compiled and CUDA-graph steps (steps.graphs) run in the mode too: the linears and the
attention are opaque ops there, and the layout of the step padded to its bucket is made
current around the forward. Inductor fuses the rest; on CPU its kernels keep a row's
arithmetic whatever the bucket (tested). CUDA graphs capture only the backends of
`CAPTURED_INVARIANT_BACKENDS`.

Not covered: projections that are not `nn.Linear` (fused MoE experts, GPT-2's `Conv1D`)."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools

import torch
import torch.nn.functional as F

from . import bnb4bit, bnb8bit, compressed_tensors, gptq
from .attention import build_layout, current_layout, invariant_layout
from ..cpu import kernels as cpu_kernels
from . import row_linear
from ..cpu.kernels import rms_eps, rms_form
from ..cpu.packed_weight import dense

# Where invariant="auto" turns the mode on, by (device type, dtype). On CPU the mode runs decode
# and verify steps through cpu.kernels, which are faster than torch's kernels for every row
# count of such a step, so it is on for float32, bfloat16 and float16 wherever those kernels were built
# (INVARIANT_AUTO_NEEDS_KERNELS); bfloat16 and float16 without them stay on too (slower, but
# without the mode their prompt lookup can part from plain greedy). CUDA: not measured, off. Also
# off where it was not measured: compiled steps, the Triton backend, accelerate-dispatched and
# tensor-parallel models.
INVARIANT_AUTO = {("cpu", torch.float32): True, ("cpu", torch.bfloat16): True, ("cpu", torch.float16): True}
INVARIANT_AUTO_NEEDS_KERNELS = {("cpu", torch.float32)}
PROBE_ROWS = 16

_STRATEGIES: dict[tuple, str] = {}  # (N, K, dtype, device, bias, threads) -> "cpu" | "plain" | "numba" | "triton" | "rows"
INVARIANT_BACKENDS = ("sdpa", "triton")  # attention backends with an invariant form
# the invariant forms a CUDA graph can capture: sdpa's lays its per-query calls out on the host
# for each step, which a replayed graph cannot redo (compiled steps run it: it is an opaque op there)
CAPTURED_INVARIANT_BACKENDS = ("triton",)


def linear_module(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is `F.linear(x, w, module.bias)` with w = `linear_weight(module)`
    and nothing more (but casts to w's dtype and back), with no forward set on the instance: a plain
    `nn.Linear` (its weight may be a quantized tensor subclass, as torchao's are); optimum-quanto's
    `QLinear` whose weights are frozen (quantized once) and whose activations are not quantized (its
    forward is then `F.linear` with its quantized weight; unfrozen, it quantizes the weight again on
    every call); bitsandbytes' 4-bit `Linear4bit` (invariant.bnb4bit) and its 8-bit `Linear8bitLt`
    once `wrap` holds it (invariant.bnb8bit); gptqmodel's GPTQ linear in
    torch's CPU int4 form (invariant.gptq); a compressed-tensors linear `wrap` holds compressed
    (invariant.compressed_tensors)."""
    if "forward" in vars(module):
        return False
    if type(module) is torch.nn.Linear:
        return True
    cls = type(module)
    if cls.__name__ == "QLinear" and cls.__module__.startswith("optimum.quanto"):
        return getattr(module, "activation_qtype", True) is None and getattr(module, "frozen", False)
    return (bnb4bit.is_linear4bit(module) or bnb8bit.is_linear8bit(module) or gptq.is_gptq_linear(module)
            or type(module) is compressed_tensors.CompressedLinear)  # (held, or decompressed since: a float weight)


def module_view(module: torch.nn.Module):
    """The function that gives a quantized module's `ModuleWeight` (`bnb4bit.linear_weight` for a
    bitsandbytes 4-bit module, `bnb8bit.linear_weight` for a held 8-bit one, `gptq.linear_weight` for a GPTQ one, `compressed_tensors.linear_weight`
    for a held compressed-tensors one), else None: the module's weight is its own. Asked of the
    module as it is (with no forward set on the instance)."""
    if bnb4bit.is_linear4bit(module):
        return bnb4bit.linear_weight
    if bnb8bit.is_linear8bit(module):
        return bnb8bit.linear_weight
    if compressed_tensors.is_held(module):
        return compressed_tensors.linear_weight
    return gptq.linear_weight if gptq.is_gptq_linear(module) else None


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """The [N, K] weight of a `linear_module`'s `F.linear`: its `weight`, or for a bitsandbytes 4-bit
    or GPTQ module the `ModuleWeight` that stands for it (its dtype may differ from the input's)."""
    view = module_view(module)
    return module.weight if view is None else view(module)


def linear_of(module: torch.nn.Module) -> torch.Tensor | None:
    """`linear_weight(module)` for a `linear_module`, else None (what cpu.packed_codes walks a model by)."""
    return linear_weight(module) if linear_module(module) else None


def check_capturable(backend: str) -> None:
    """Raise unless invariant steps on `backend` can be captured in CUDA graphs."""
    if backend not in CAPTURED_INVARIANT_BACKENDS:
        raise ValueError(f"invariant steps are captured in CUDA graphs on attn_backend {CAPTURED_INVARIANT_BACKENDS}, "
                         f"not {backend!r}")


def resolve_invariant(requested, devices: list[torch.device], dtypes: list[torch.dtype], backend: str,
                      compiled: bool = False, hooked: bool = False, distributed: bool = False) -> bool:
    """Whether invariant mode runs (`requested` as validated by EngineOptions). True where it
    cannot run is a ValueError; "auto" is on only where INVARIANT_AUTO says it measured well."""
    reason = None
    if backend not in INVARIANT_BACKENDS:
        reason = f"invariant mode runs on attn_backend {INVARIANT_BACKENDS}, this model runs {backend!r}"
    if requested is True and reason is not None:
        raise ValueError(f"invariant=True cannot run: {reason}; use invariant=False or 'auto'")
    if requested == "auto":
        measured = (backend == "sdpa" and not (compiled or hooked or distributed) and len(devices) == 1
                    and len(dtypes) == 1)
        key = (devices[0].type, dtypes[0])
        kernels = key not in INVARIANT_AUTO_NEEDS_KERNELS or cpu_kernels.available()
        return reason is None and measured and kernels and INVARIANT_AUTO.get(key, False)
    return bool(requested)


def _each_row(fn, x2d: torch.Tensor) -> torch.Tensor:
    """`fn` of every row of x2d alone, concatenated."""
    return torch.cat([fn(x2d[i : i + 1]) for i in range(x2d.shape[0])])


def _rows_exact(fn, x: torch.Tensor) -> bool:
    """Whether `fn(x[:m])` gives every row bitwise as `fn` of that row alone, m = 2..PROBE_ROWS."""
    ref = _each_row(fn, x)
    return all(torch.equal(fn(x[:m]), ref[:m]) for m in range(2, x.shape[0] + 1))


def _triton_supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    from . import triton_linear

    return triton_linear.supported(weight)


def _triton_rows(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from . import triton_linear  # imported on first use: CPU installs need not have triton

    return triton_linear.row_linear(x2d, weight, bias)


# the row-invariant linear kernels: (takes this weight, kernel). row_strategy tries FIRST_KERNELS
# before torch's own call (they are faster than it at every decode row count), the rest after it.
KERNELS = {"cpu": (cpu_kernels.supported, cpu_kernels.linear), "numba": (row_linear.supported, row_linear.row_linear),
           "triton": (_triton_supported, _triton_rows)}
FIRST_KERNELS = ("cpu",)
# a prompt chunk of more rows than this runs torch's call (its GEMM is as fast from about here on)
# in float32, and in bfloat16 on CPUs with bf16 dot products (cpu_kernels.torch_bf16_is_native);
# the "cpu" kernel takes shorter chunks, every bfloat16 one elsewhere (torch's bf16 GEMM then
# widens in software and runs at about half its float32 speed) and every float16 one (torch's fp16
# GEMM was slower than the "cpu" kernel on every CPU measured, docs/results.md)
PREFILL_TORCH_ROWS = 64
# a prompt chunk of this many rows (by dtype) up to PREFILL_TORCH_ROWS, where long chunks take torch's
# call, takes it too, padded with zero rows to PREFILL_TORCH_ROWS + 1 rows (`_padded_gemm`): such a
# chunk is a prompt's last part of a unit, and from about these row counts torch's GEMM ran the padded
# call faster than the "cpu" kernel ran the chunk, on SmolLM2's linears on an AMX Xeon, where bf16 runs
# on oneDNN's AMX GEMM (docs/measurements/cpu-xeon-2026-11-30-head-screen/NOTES.md)
PADDED_MIN_ROWS = {torch.float32: 40, torch.bfloat16: 8}
# prompt chunks that take torch's call run as one call of at most this many rows where
# `merge_safe` holds (a step's chunks of several sequences, or of several units of one)
MERGE_ROWS = 1024
_MERGE_PROBE_SIZES = (128, 65, 128, 128, 101, 128, 77, 128)
_MERGE_SAFE: dict[tuple, bool] = {}


def strategy_key(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What `row_strategy`'s choice is kept by: shape, dtype, device, the weight's type (and its
    data's) and the C kernels' kind of it (a torchao `Int8Tensor` is weight-only or not), whether
    there is a bias, and torch's thread count."""
    # (a parameter's data is read, not a tensor subclass's: quanto's tinygemm weights raise on `.data`
    # in inference mode)
    inner = weight.data if type(weight) is torch.nn.Parameter else weight
    return (*weight.shape, weight.dtype, weight.device, type(weight), type(inner),
            cpu_kernels.weight_kind(weight), bias is None, torch.get_num_threads())


def row_strategy(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """How decode rows of this weight are computed, checked once per shape on random inputs: the
    first of "cpu" (cpu.kernels, float32/bfloat16 on CPU), "plain" (the batched `F.linear`,
    HF's own arithmetic), "numba" (invariant.row_linear, float32 on CPU) and "triton"
    (invariant.triton_linear, CUDA) that takes the weight and gives every row bitwise as a 1-row
    call does for every row count up to PROBE_ROWS; else "rows" (one 1-row `F.linear` per row).
    The weight's type is part of the key: a quantized tensor subclass of a plain weight's shape
    takes other kernels."""
    key = strategy_key(weight, bias)
    got = _STRATEGIES.get(key)
    if got is None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(PROBE_ROWS, weight.shape[1], generator=gen)
        # one row with a large value in two columns, as real activations have: a kernel that picks
        # such outlier columns over all rows of a call (bitsandbytes' LLM.int8, from 6 up) shows its
        # rows' dependence only so
        x[1, :2] = 24.0
        x = x.to(weight.device, weight.dtype)
        plain = ("plain", F.linear)
        first = [(name, KERNELS[name][1]) for name in FIRST_KERNELS if KERNELS[name][0](weight)]
        rest = [(name, fn) for name, (takes, fn) in KERNELS.items() if name not in FIRST_KERNELS and takes(weight)]
        with torch.no_grad():  # (not inference mode: some quantized weights fail there, steps.runner)
            got = next((name for name, fn in [*first, plain, *rest] if _rows_exact(lambda t: fn(t, weight, bias), x)),
                       "rows")
        _STRATEGIES[key] = got
    return got


def invariant_rows(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d [M, K] -> [M, N], each row bitwise as that row alone: as `F.linear(x2d[i:i+1], weight,
    bias)` ("plain", "rows") or as the row-invariant kernel of it ("numba", "triton")."""
    m = x2d.shape[0]
    strategy = row_strategy(weight, bias)
    if strategy in KERNELS:
        return KERNELS[strategy][1](x2d, weight, bias)
    if m == 1:
        return F.linear(x2d, weight, bias)
    if strategy == "rows":
        return _each_row(lambda t: F.linear(t, weight, bias), x2d)
    if m <= PROBE_ROWS:
        return F.linear(x2d, weight, bias)
    return torch.cat([F.linear(x2d[i : i + PROBE_ROWS], weight, bias) for i in range(0, m, PROBE_ROWS)])


def _group_call(rows: int, is_prefill: bool, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Which call a row group of the step takes: "cpu" (`cpu_kernels.linear`), "gemm" (`F.linear`
    of a chunk of more than PREFILL_TORCH_ROWS rows) or "rows" (`invariant_rows` under the
    weight's other strategy). Decode rows take their weight's `row_strategy`. A prompt chunk's
    rows take the "cpu" kernel where that is the weight's strategy, except for long chunks in
    float32, and in bfloat16 where torch's bf16 GEMM is native (never in float16). Short chunks never take torch's
    batched call: where a prompt is cut depends on what else shares the step (a chain's budget
    moves the cuts), and torch's rows change with the call's row count below about 64 rows; a
    short chunk of PADDED_MIN_ROWS rows or more (a prompt's last part of a unit) takes it padded
    to a fixed row count ("padded", `_padded_gemm`) where long chunks take it."""
    cpu = row_strategy(weight, bias) == "cpu"
    if not is_prefill:
        return "cpu" if cpu else "rows"
    short = rows <= PREFILL_TORCH_ROWS
    if cpu and (rows < PADDED_MIN_ROWS.get(weight.dtype, PREFILL_TORCH_ROWS + 1) or weight.dtype == torch.float16
                or (weight.dtype == torch.bfloat16 and not cpu_kernels.torch_bf16_is_native())):
        return "cpu"
    if short:
        return "padded" if cpu else "rows"
    return "gemm"  # (only "gemm" calls are merged: merge_safe checks long chunks)


def merge_safe(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether one `F.linear` call over several prompt chunks (each of more than
    PREFILL_TORCH_ROWS rows, at most MERGE_ROWS rows in all) gives every row bitwise as its
    chunk's own call: checked once per shape, dtype, device and thread count on random chunks,
    merged from the first chunk and up to the last. (On the CPUs measured, MKL's and oneDNN's
    GEMMs do not split the reduction by the row count from there on, and one call of many rows
    runs at a higher rate than several calls of fewer: why merging is worth checking for.)"""
    key = (*weight.shape, weight.dtype, weight.device, bias is None, torch.get_num_threads())
    got = _MERGE_SAFE.get(key)
    if got is None:
        gen = torch.Generator(device="cpu").manual_seed(1)
        cuts = [0]
        for n in itertools.cycle(_MERGE_PROBE_SIZES):
            if cuts[-1] + n > MERGE_ROWS:
                break
            cuts.append(cuts[-1] + n)
        x = torch.randn(cuts[-1], weight.shape[1], generator=gen).to(weight.device, weight.dtype)
        weight = dense(weight)
        with torch.no_grad():  # (not inference mode: some quantized weights fail there, steps.runner)
            ref = torch.cat([F.linear(x[a:b], weight, bias) for a, b in zip(cuts, cuts[1:])])
            spans = [(0, b) for b in cuts[2:]] + [(a, cuts[-1]) for a in cuts[1:-2]]
            got = all(torch.equal(F.linear(x[a:b], weight, bias), ref[a:b]) for a, b in spans)
        _MERGE_SAFE[key] = got
    return got


def _merged(groups, weight: torch.Tensor, bias: torch.Tensor | None) -> list[list]:
    """The step's row groups as calls, [start, end, call] in order: consecutive groups of the
    "cpu" kernel (row-invariant by construction) as one call, and of torch's call on long prompt
    chunks ("gemm") as one call of at most MERGE_ROWS rows where `merge_safe`.

    Example (fp32, two 128-row chunks, then a 40-row chunk, then 3 decode rows):
    [[0, 256, "gemm"], [256, 296, "padded"], [296, 299, "cpu"]]."""
    calls: list[list] = []
    for lo, hi, is_prefill in groups:
        call = _group_call(hi - lo, is_prefill, weight, bias)
        last = calls[-1] if calls else None
        if last is not None and last[2] == call and last[1] == lo and (
                call == "cpu" or (call == "gemm" and hi - last[0] <= MERGE_ROWS and merge_safe(weight, bias))):
            last[1] = hi
        else:
            calls.append([lo, hi, call])
    return calls


def _padded_gemm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of a short prompt chunk x2d [m <= PREFILL_TORCH_ROWS, K] as the first m rows of one
    call of PREFILL_TORCH_ROWS + 1 rows, the rest zeros: every such chunk is a call of the same shape,
    so a row's bits depend on its values and its place in the chunk alone (a GEMM's row does not
    read the other rows), whatever else shares the step.

    Example: a prompt of 944 tokens in units of 128 ends with a 48-row chunk, computed as rows 0-47
    of a 65-row F.linear."""
    m = x2d.shape[0]
    padded = x2d.new_zeros(PREFILL_TORCH_ROWS + 1, x2d.shape[1])
    padded[:m] = x2d
    return F.linear(padded, weight, bias)[:m]


_CALLS = {"cpu": cpu_kernels.linear, "gemm": F.linear, "padded": _padded_gemm, "rows": invariant_rows}
_TORCH_CALLS = ("gemm", "padded")  # the calls that read the weight unpacked


def _invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K] with row-invariant arithmetic. When the rows
    are the step's packed tokens, each row group (a prompt chunk piece, a run of decode tokens)
    takes its `_group_call`, merged as `_merged` allows; other row sets (the LM head's kept rows)
    are all decode-like."""
    x2d = x.reshape(-1, x.shape[-1])
    layout = current_layout()
    if layout is None or x2d.shape[0] != layout.num_tokens or not layout.has_prefill:
        y = invariant_rows(x2d, weight, bias)
    else:
        calls = _merged(layout.row_groups, weight, bias)
        # torch's calls read the weight unpacked (where it is held packed: cpu.packed_weight), once
        # for all of them: a prompt cut into units where merging is not safe makes several
        plain = dense(weight) if any(call in _TORCH_CALLS for _, _, call in calls) else None
        if len(calls) == 1:
            lo, hi, call = calls[0]
            y = _CALLS[call](x2d[lo:hi], plain if call in _TORCH_CALLS else weight, bias)
        else:  # each call's rows written in place, not concatenated after (a copy of the whole output)
            y = x2d.new_empty(x2d.shape[0], weight.shape[0])
            for lo, hi, call in calls:
                if call == "gemm" and _plain_float(plain):
                    _gemm_into(x2d[lo:hi], plain, bias, y[lo:hi])
                else:
                    y[lo:hi] = _CALLS[call](x2d[lo:hi], plain if call in _TORCH_CALLS else weight, bias)
    return y.reshape(*x.shape[:-1], -1)


def _plain_float(weight: torch.Tensor | None) -> bool:
    return weight is not None and type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dtype.is_floating_point


def _gemm_into(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """`F.linear(x2d, weight, bias)` of a plain float weight written into `out` (contiguous rows): the
    op F.linear runs for a 2-D input, `addmm` with a bias and `mm` without, so the same bits
    (tests/invariant/test_linears.py checks them against F.linear)."""
    if bias is None:
        torch.mm(x2d, weight.t(), out=out)
    else:
        torch.addmm(bias, x2d, weight.t(), out=out)


@torch.library.custom_op("hf_plookup::invariant_linear", mutates_args=())
def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`_invariant_linear` as an op, so that compiled steps keep it opaque (inductor would pick
    its own matmul) and the step's layout is read when it runs, not when it is traced."""
    return _invariant_linear(x, weight, bias)


@invariant_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _bind_norm(module: torch.nn.Module, form: str):
    eps = rms_eps(module)

    def forward(x):
        w = module.weight
        if torch.compiler.is_compiling() or x.dtype != w.dtype or x.device.type != "cpu":
            return type(module).forward(module, x)
        return cpu_kernels.rms_norm(x, w, eps, form)

    return forward


class InvariantLinears:
    """Routes every plain `nn.Linear` of `model` through `invariant_linear`, and its RMSNorm
    modules that `rms_form` recognises through `cpu_kernels.rms_norm`, for one engine forward
    (`active`), restoring the modules after."""

    def __init__(self, model: torch.nn.Module, prefill_unit: int | None = None):
        # a prompt chunk spanning several of the scheduler's units is computed unit by unit where
        # the rows' bits would depend on the chunk's length (invariant.attention.build_layout)
        self.prefill_unit = prefill_unit
        self.modules = [m for m in model.modules() if linear_module(m)]
        self.forwards = [self._bind(m) for m in self.modules]
        # RMSNorm modules whose arithmetic cpu_kernels.rms_norm reproduces: one C call instead of
        # the half-dozen torch ops of HF's forward (row-local either way)
        forms = {m: rms_form(m) if "forward" not in vars(m) else None for m in model.modules()}
        for m, form in forms.items():
            if form is not None:
                self.modules.append(m)
                self.forwards.append(_bind_norm(m, form))
        # decode steps whose linears all run the C kernels (whose bits do not depend on threads)
        # run torch's own ops on one thread (cpu_kernels.serial_torch)
        self.serial_decode = bool(self.modules) and all(
            cpu_kernels.supported(linear_weight(m)) for m in self.modules if linear_module(m))
        # the norms' forms, for the decode steps that run a Llama-form model's layers in C (steps.c_layers)
        self.forms = forms

    @staticmethod
    def _bind(module):
        # a quantized module's view, asked per call (it may change), by the function found now: the
        # module bound here has its forward set during steps, when module_view takes it for no linear
        view = module_view(module)
        if view is not None:  # in its weight's dtype, as its own forward computes
            def cast(x):
                w, b = view(module), module.bias
                y = _invariant_linear(x.to(w.dtype), w, None if b is None else b.to(w.dtype))
                return y.to(x.dtype)

            return cast
        if type(module.weight) is not torch.nn.Parameter:  # a tensor subclass (a sharded DTensor): no op for it
            return lambda x: _invariant_linear(x, module.weight, module.bias)

        def forward(x):
            # the op only where a compiled step traces the forward (it keeps the call opaque);
            # eager steps call the function itself (an op call costs more than a small kernel)
            if torch.compiler.is_compiling():
                return torch.ops.hf_plookup.invariant_linear(x, module.weight, module.bias)
            return _invariant_linear(x, module.weight, module.bias)

        return forward

    @contextlib.contextmanager
    def active(self, layout, device: torch.device):
        """Linear layers, recognised norms and attention in invariant mode for the step `layout`
        (a base.layout.StepLayout; for a compiled or captured step, the layout padded to its bucket)."""
        # through the instance dict: nn.Module's __setattr__/__delattr__ check for parameters,
        # buffers and submodules on every call, which adds up over a model's linears every step
        for m, f in zip(self.modules, self.forwards):
            m.__dict__["forward"] = f
        serial = self.serial_decode and layout.is_decode and device.type == "cpu"
        try:
            with invariant_layout(build_layout(layout, device, self.prefill_unit)), \
                    cpu_kernels.serial_torch() if serial else contextlib.nullcontext():
                yield
        finally:
            for m, f in zip(self.modules, self.forwards):
                if m.__dict__.get("forward") is f:
                    del m.__dict__["forward"]
