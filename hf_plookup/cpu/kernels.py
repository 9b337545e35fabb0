"""Row-invariant CPU kernels for decode, verify and tree steps: a linear layer and paged attention.

A verify step of k+1 tokens on a CPU should cost about what a 1-token step costs: both read
every weight once, and for a handful of rows the arithmetic is cheap. MKL's `F.linear` does
not behave so for few rows (it picks a kernel by the row count and splits rows between
threads, so each row also rounds differently in a 1-row and a 5-row call). The C kernels in
`hf_plookup/csrc/` (built at install as `hf_plookup._cpu_kernels`) do:

- `linear(x, weight, bias)`: each weight is streamed once per call for all rows, and each output
  is one FMA chain over k = 0 .. K-1 in order, so row i of an M-row call is bitwise that row
  alone, at any M and thread count. float32, bfloat16 and float16 (widened exactly, fp32
  accumulation, rounded once at the output). The kernel reads the weight packed (`pack`: panels of 8 output
  columns, their values for one k side by side), for tiles that need no horizontal sums and read
  each panel as one stream (docs/results.md, "...: weights packed by output column"). Under the
  engine the packed layout is the weight itself (cpu.packed_weight: one copy); a plain weight
  gets a packed copy made once and kept while it lives and is unchanged (`packed`).
- `rms_norm(x, weight, eps, form)`: RMS normalization of each row alone, its sum of squares in
  the same fixed lane order (the two forms HF's RMSNorm modules take, `RMS_FORMS`); a prompt
  chunk's rows go over the threads in blocks of 64.
- `attend(...)`: one query head over exactly its visible keys, read in place from the pages in
  position order, with one fixed order of arithmetic per query: chains, tree nodes (the
  context, then the node's ancestors), GQA, sliding windows (the caller trims the keys) and
  tanh soft-capping. With AVX-512 BF16, bf16 scores q.k take the dot-product instruction (lane l
  adds the exact products of values d+2l+1, then d+2l, of each 16, values and sums below FLT_MIN
  flushed to 0): a fixed order too, but bf16 attention's bits then depend on whether the CPU has
  the instruction; the rest of attention is unchanged.

`steps.c_layers` runs whole decoder layers of decode steps from these kernels (`layer_attention`,
`layer_mlp` in `csrc/layers.c`). Every kernel takes float32, bfloat16 and float16 (`DTYPES`).

Threads: the kernels split their work over `torch.get_num_threads()` threads of a small pool
of their own (numba's OpenMP layer beside torch's OpenMP runtime took milliseconds a call).
They are called through ctypes, which lets go of the GIL while they run.

Worked example (fp32, 2 threads): a 5-row call gives each row bitwise as a 1-row call does::

    >>> w = torch.randn(1536, 576); x = torch.randn(5, 576)
    >>> torch.equal(linear(x, w, None)[3:4], linear(x[3:4], w, None))
    True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

try:
    from .. import _cpu_kernels as _ext
except ImportError:  # built without a C compiler: the callers fall back (invariant.linears.row_strategy)
    _ext = None

# the dtypes of every kernel (16-bit values widened exactly to fp32 for arithmetic, fp16 by F16C)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/cpu_kernels.h, DT_F32 ...


def dtype_code(dtype: torch.dtype) -> int:
    """The C kernels' code of a dtype of `DTYPES` (csrc/cpu_kernels.h: DT_F32, DT_BF16, DT_F16)."""
    return _DT_CODES[dtype]


def _load():
    """The C entry points with their signatures (None without the build)."""
    if _ext is not None:
        lib = ctypes.CDLL(_ext.__file__)  # the extension module already imported: no second copy
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        lib.linear.restype = i64
        lib.linear.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64]
        lib.attend.restype = i64
        lib.attend.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, f32, f32, ptr, i64, i64]
        lib.uses_avx2.restype = i64
        lib.simd_level.restype = i64
        lib.set_simd_level.restype = i64
        lib.set_simd_level.argtypes = [i64]
        lib.pack_weight.restype = None
        lib.pack_weight.argtypes = [ptr, i64, i64, i64, ptr, i64, i64]
        lib.rms_norm.restype = i64
        lib.rms_norm.argtypes = [ptr, i64, i64, ptr, f32, i64, ptr, i64, i64]
        lib.screen_pack.restype = i64
        lib.screen_pack.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64]
        lib.screen_pick.restype = None
        lib.screen_pick.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64, ptr, ptr, i64]
        lib.screen_exact.restype = i64
        lib.screen_exact.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr]
        lib.quantize_rows_i8.restype = None
        lib.quantize_rows_i8.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr]
        return lib
    return None


_LIB = _load()


_local = threading.local()  # .threads: the kernels' thread count inside serial_torch()


def threads() -> int:
    """Threads the kernels split a call over: torch's count, or the count it had when the calling
    thread entered `serial_torch`."""
    return getattr(_local, "threads", None) or torch.get_num_threads()


@contextlib.contextmanager
def serial_torch():
    """Torch's own ops on one thread for a while, the kernels keeping torch's thread count.

    In a decode step the kernels do the heavy work on their own pool; what torch computes besides
    (activations, residuals, RoPE on a few dozen rows) is too small to gain from threads, yet from
    32,768 elements (22 rows of SmolLM2's 1,536-wide MLP) torch hands it to its OpenMP threads,
    which then spin beside the kernels' workers for the cores: a step just past that size took far
    longer than one just below it. Process-wide, as torch's setting is; nested uses are no-ops."""
    n = torch.get_num_threads()
    if n <= 1 or getattr(_local, "threads", None):
        yield
        return
    _local.threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _local.threads = None


def available() -> bool:
    """Whether the compiled kernels were built and load."""
    return _LIB is not None


def uses_avx2() -> bool:
    """Whether the AVX2/FMA path runs (else the portable C path)."""
    return available() and bool(_LIB.uses_avx2())


def simd_level() -> int:
    """The vector code the kernels run: 0 portable C, 1 AVX2 + FMA, 2 as 1 but bf16 attention scores
    by AVX-512 BF16 dot products (their own order, see the module text). Every level gives the same
    linears and norms, bit for bit."""
    return int(_LIB.simd_level()) if available() else 0


def set_simd_level(level: int) -> int:
    """Run a lower level than the CPU allows (tests compare the levels; between calls, not during
    one); returns the previous one."""
    return int(_LIB.set_simd_level(level))


@functools.cache
def cpu_level() -> int:
    """The highest level this CPU runs (`simd_level` before any `set_simd_level`)."""
    if not available():
        return 0
    was = set_simd_level(99)
    return set_simd_level(was)


@functools.cache
def torch_bf16_is_native() -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86 AVX-512 BF16 or AMX), which torch's
    bf16 GEMM (oneDNN) uses: then it beats `linear` on long prompt chunks, where arithmetic, not
    memory, bounds the call (invariant.linears._group_call). Read from /proc/cpuinfo; False where
    that cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _own_packing(t: torch.Tensor) -> torch.Tensor | None:
    """The packed values a tensor carries itself (a weight that is a cpu.packed_weight.PackedWeight,
    a quantized weight's codes that are a cpu.packed_codes.PackedCodes), else None."""
    got = t.__dict__.get("packed") if hasattr(t, "__dict__") else None
    return got if isinstance(got, torch.Tensor) else None


def _plain(t: torch.Tensor) -> bool:
    """A CPU tensor the kernels may read: a plain tensor or parameter, or a weight packed in place
    (not another tensor subclass, such as a sharded DTensor)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) or _own_packing(t) is not None) and t.device.type == "cpu"


# the kinds of weight the C linears read (csrc/cpu_kernels.h): a float weight of the call's dtype,
# int8 values with one scale per output column (`int8_parts`), 4-bit codes with a scale and a
# shift per column and group of values (`q4_parts`), or 8-bit codes so (`q4_parts` with bits 8:
# every weight dequantized before its product, where W_Q8 scales a column's sum), or int8 values
# whose inputs are quantized to int8 token by token first (`Int8Parts.tokens`), or 4-bit codes laid
# out along k (W_Q4K: `q4_kind`), or bitsandbytes' LLM.int8 codes read where bitsandbytes keeps them
# (W_Q8B: `Int8Parts.llm_int8`)
W_FLOAT, W_Q8, W_Q4, W_Q8G, W_Q8T, W_Q4K, W_Q8B = 0, 1, 2, 3, 4, 5, 6
Q4_KINDS = (W_Q4, W_Q4K, W_Q8G)  # the kinds `q4_parts` reads
# the dtypes of the tensor that holds a quantized kind's values (`values_of`; GPTQ and
# compressed-tensors keep their codes in int32 words, torchao its grouped ones as int8 values)
VALUES_DTYPES = {W_Q8: (torch.int8,), W_Q8T: (torch.int8,), W_Q8B: (torch.int8,), W_Q4: (torch.uint8, torch.int32, torch.int8),
                 W_Q4K: (torch.uint8, torch.int32, torch.int8), W_Q8G: (torch.uint8, torch.int32, torch.int8)}
# how a W_Q4 code q becomes its weight, f being q - offset (cpu_kernels.h, q4_value): "mul_sub",
# round(round(f * scale) - shift) in the dtype; "fma", fma(f, scale, shift) in float32; "lut",
# round(codebook[q] * scale) from float32; "sub_mul_f16", round(fp16((f - shift) * scale)) from
# float32; "sub_mul", round((f - shift) * scale) from float32 (shift: a zero point)
Q4_FORMS = {"mul_sub": 0, "fma": 1, "lut": 2, "sub_mul_f16": 3, "sub_mul": 4}
Q4_META_BYTES = 128  # a W_Q4 weight's header (cpu_kernels.h, q4_meta)
Q4K_BLOCK = 32  # W_Q4K: the values of k a column's 16 bytes hold (cpu_kernels.h)


# id(weight) -> (a weak reference to it, its int8_parts): a quantized tensor's attributes cost
# microseconds each to read, and `linear` asks for them on every call
_INT8_PARTS: dict[int, tuple] = {}
_INT8_TYPES = {"Int8Tensor": "torchao", "WeightQBytesTensor": "optimum.quanto",  # class -> its library
               "Bnb8bitWeight": "hf_plookup"}  # (bitsandbytes' 8-bit linear seen as a weight: invariant.bnb8bit)


class Int8Tokens(NamedTuple):
    """torchao's per-token symmetric int8 quantization of a linear's inputs (csrc quantize_rows_i8:
    codes in [qmin, qmax], one scale a row)."""

    qmin: int
    qmax: int


class Int8Parts(NamedTuple):
    """An int8 weight as `int8_parts` reads it: its `values` [N, K] int8 and its `scales` [N] (one an
    output column). `tokens`: for a weight whose library quantizes each call's inputs to int8 row by
    row first (torchao's `Int8DynamicActivationInt8WeightConfig`), how (`Int8Tokens`): the weight
    kind W_Q8T, whose bytes are laid out for float32 calls (`packed_dtype`) whatever the model's dtype.
    `llm_int8`: for bitsandbytes' LLM.int8 (weight kind W_Q8B, each row quantized with its own outliers:
    cpu_kernels.h), the outlier threshold rounded to fp16 as torch compares with it (0: no outliers);
    its `values` are bitsandbytes' own codes, which the kernels read in place, and `scales` its SCB."""

    values: torch.Tensor
    scales: torch.Tensor
    tokens: Int8Tokens | None = None
    llm_int8: float | None = None


def int8_parts(weight: torch.Tensor) -> Int8Parts | None:
    """The `Int8Parts` of a CPU weight quantized to int8 with one scale per output column, as two
    libraries hold it: torchao's `Int8Tensor` (`Int8WeightOnlyConfig`; `qdata`, `scale` [N, 1]) and
    optimum-quanto's `WeightQBytesTensor` of qint8 on axis 0 (`_data`, `_scale` [N, 1]); else None.
    The weight's dtype (float32 or bfloat16) is the one its linear computes in; the scales are rounded
    to it before use (torchao keeps float32 scales for a bfloat16 model and rounds them so).

    Both libraries' linears compute x @ values^T, then scale each output column: torchao as
    `mm(x, values.to(dtype)) * scale`, quanto in float32 by scaling the values first (the same
    products, rounded in another place). `linear` takes torchao's order (cpu_kernels.h, W_Q8). A
    torchao zero point is not read: torchao's own weight-only linear does not read it either.

    torchao's `Int8DynamicActivationInt8WeightConfig` (its default: each token's inputs quantized to
    int8 with a scale of their own, symmetric) makes the same weight with an activation
    quantization: its linear quantizes each input row, multiplies the int8 codes exactly (int32
    sums), then scales by the row's scale and the column's (float32, not rounded): `tokens` says
    so, and the C linears do the same (cpu_kernels.h, W_Q8T). Activations quantized over the whole
    call (`PerTensor`), asymmetric ones or static scales are not read (None: torchao's own linear
    runs them).

    bitsandbytes' 8-bit linear, held for inference (`invariant.bnb8bit.Bnb8bitWeight`), gives its
    own codes (its state's `CB`, one scale a column in `SCB`) and `llm_int8`: the C linears quantize
    each row with its own outliers as bitsandbytes' call of that row alone does (cpu_kernels.h, W_Q8B).

    Read once per weight object and kept while it lives (a tensor put in the place of its values, as
    opposed to values changed in place, is not seen)."""
    return _parts(weight, _INT8_TYPES, _INT8_PARTS, _read_int8_parts)


def _parts(weight: torch.Tensor, types: dict, cache: dict, read):
    """`read(weight)` for a weight of one of `types` (class name -> its library), kept in `cache`
    by id while the weight lives; None for other weights."""
    cls = type(weight)
    if cls.__name__ not in types or not cls.__module__.startswith(types[cls.__name__]):
        return None  # (nor a weak reference to other tensors: one would keep swap_tensors from them)
    entry = cache.get(id(weight))
    if entry is not None and entry[0]() is weight:
        return entry[1]
    got = read(weight)
    key = id(weight)
    cache[key] = (weakref.ref(weight, lambda _, key=key: cache.pop(key, None)), got)
    return got


def _read_int8_parts(weight: torch.Tensor) -> Int8Parts | None:
    """`int8_parts` of a weight of one of `_INT8_TYPES` (which it checked), read from the tensor."""
    if weight.device.type != "cpu" or weight.dtype not in DTYPES:
        return None
    tokens = None
    if type(weight).__module__.startswith("hf_plookup"):  # bitsandbytes' LLM.int8 (invariant.bnb8bit)
        parts = weight.int8_fields()
        if parts is None or not _codes_tensor(parts.values) or parts.values.dtype != torch.int8:
            return None
        q, scale = parts.values, parts.scales
        if (tuple(q.shape) != tuple(weight.shape) or not q.is_contiguous() or scale.dtype != torch.float32
                or scale.numel() != q.shape[0] or not scale.is_contiguous()):
            return None
        return parts
    if type(weight).__name__ == "Int8Tensor":  # torchao
        q, scale = weight.qdata, weight.scale
        if getattr(weight, "act_pre_scale", None) is not None or list(weight.block_size) != [1, q.shape[-1]]:
            return None
        if weight.act_quant_kwargs is not None:
            tokens = _torchao_int8_tokens(weight, scale)
            if tokens is None:
                return None
    else:  # optimum-quanto's WeightQBytesTensor
        q, scale = weight._data, weight._scale
        if weight.qtype.name != "qint8" or weight.axis != 0 or getattr(weight, "activation_qtype", None) is not None:
            return None
    if (not _codes_tensor(q) or q.dtype != torch.int8 or q.dim() != 2 or scale.numel() != q.shape[0]
            or scale.dtype not in DTYPES or tuple(weight.shape) != tuple(q.shape)):
        return None
    return Int8Parts(q, scale.reshape(-1), tokens)


def _torchao_int8_tokens(weight: torch.Tensor, scale: torch.Tensor) -> Int8Tokens | None:
    """The `Int8Tokens` of a torchao `Int8Tensor` whose inputs torchao quantizes per token,
    symmetrically and dynamically (see `int8_parts`), else None."""
    kw = weight.act_quant_kwargs
    if (type(kw).__name__ != "QuantizeTensorToInt8Kwargs" or type(kw.granularity).__name__ != "PerRow"
            or getattr(kw.mapping_type, "name", None) != "SYMMETRIC"
            or getattr(weight, "act_quant_scale", None) is not None or scale.dtype != torch.float32):
        return None
    return Int8Tokens(*((-64, 63) if getattr(kw, "reduce_range", False) else (-128, 127)))


def packed_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of the calls a quantized weight's packed bytes are laid out for (W_Q8 panels pair k
    for bfloat16): float32 for an int8 weight whose inputs are quantized per token (`Int8Parts.tokens`:
    the C linear multiplies their integer codes in float32), else the weight's own dtype."""
    parts = int8_parts(weight)
    return torch.float32 if parts is not None and parts.tokens is not None else weight.dtype


@dataclass(frozen=True)
class Q4Parts:
    """A 4-bit weight as `q4_parts` reads it: `codes()` gives its codes [N, K] (uint8, 0..15; unpacked
    on each call, so not held), `scales` and `shifts` [N, K / group] (the library's own values: of
    the weight's dtype for quanto, bitsandbytes' float32 absmax and zeros for "lut"), `form` and `offset` say how a code becomes its weight (`Q4_FORMS`), and
    `source` is the plain tensor that holds the library's packed codes (its address and version
    counter say whether they changed)."""

    codes: Callable[[], torch.Tensor]
    scales: torch.Tensor
    shifts: torch.Tensor
    group: int
    form: str
    offset: float
    source: torch.Tensor
    lut: torch.Tensor | None = None  # the "lut" form's codebook, 16 float32 values
    bits: int = 4  # 8: codes 0..255 (weight kind W_Q8G, the "sub_mul" form only)
    # what the library does to a call's input first, row by row (torchao's activations quantized
    # and dequantized per token), or None: `linear` applies it; the C layers, which do not, refuse it
    inputs: Callable[[torch.Tensor], torch.Tensor] | None = None


# (hf_plookup's own: a quantized module seen as a linear's weight, invariant.module_weight)
_Q4_TYPES = {"WeightQBitsTensor": "optimum.quanto", "TinyGemmWeightQBitsTensor": "optimum.quanto",
             "IntxUnpackedToInt8Tensor": "torchao", "Int8Tensor": "torchao", "Bnb4bitWeight": "hf_plookup",
             "GptqWeight": "hf_plookup", "GptqDequantWeight": "hf_plookup", "AwqDequantWeight": "hf_plookup",
             "CompressedTensorsWeight": "hf_plookup"}
_Q4_PARTS: dict[int, tuple] = {}  # id(weight) -> (a weak reference to it, its q4_parts), as _INT8_PARTS


def q4_parts(weight: torch.Tensor) -> Q4Parts | None:
    """The `Q4Parts` of a CPU weight quantized to 4 bits by optimum-quanto (qint4 on axis 0, frozen), by
    bitsandbytes (nf4 or fp4, seen as `invariant.bnb4bit.Bnb4bitWeight`), by GPTQ or AWQ
    (gptqmodel's, seen as `invariant.gptq.GptqWeight`, `GptqDequantWeight` or `AwqDequantWeight`) or
    by compressed-tensors (held compressed: `invariant.compressed_tensors.CompressedTensorsWeight`,
    "sub_mul": rnd((code - 8 - zero) * scale); its 8-bit codes too, offset 128 and `bits` 8: the
    weight kind W_Q8G), else None. quanto holds such a weight in one of two forms:

    - `WeightQBitsTensor` (float32 models, and bfloat16 ones whose groups are not 128 values): its
      dequantization is `scale * code - shift`, each op in the weight's dtype ("mul_sub", offset 0);
      its shift must be a float (HF's `QuantoConfig` makes one), not an integer zero point.
    - `TinyGemmWeightQBitsTensor` (bfloat16, groups of 128): torch's int4pack kernels compute
      `(code - 8) * scale + zero` in float32 ("fma", offset 8), scale and zero being the two halves
      of its `_scale_shift`.

    bitsandbytes' value is `codebook[code] * absmax` in float32, rounded to the compute dtype ("lut":
    the scales are the blocks' absmax, the shifts zeros, the group the block). A GPTQ linear of
    gptqmodel (or an AWQ one), once turned into torch's int4pack form, is read as the tinygemm form;
    one that dequantizes on every call (float32) as "sub_mul_f16": fp16(scale * (code - zero))
    (invariant.gptq).

    torchao's weight-only tensors that dequantize before `F.linear` (`dequantize_affine`: the code
    less its zero point in the weight's dtype, exactly, times the scale, rounded to the weight's
    dtype): `IntxUnpackedToInt8Tensor` (`IntxWeightOnlyConfig`, int4 or int8 values one a byte, in
    groups or one scale a row) and a grouped `Int8Tensor` (`Int8WeightOnlyConfig` with
    `PerGroup`), read as "sub_mul" with the zero points as shifts and the scales as they are (a
    bfloat16 weight's may be float32): int4 values as 4-bit codes (offset 8), int8 ones as 8-bit
    codes (offset 128, weight kind W_Q8G). `Int8DynamicActivationIntxWeightConfig`'s are the same
    weights whose inputs torchao first quantizes and dequantizes token by token (asymmetric int8):
    their `inputs` is torchao's own function of that, which `linear` applies.

    Example: a [64, 256] float32 linear quantized by `quantize(m, weights=qint4); freeze(m)` gives
    codes [64, 256], scales and shifts [64, 2] (groups of 128), "mul_sub", offset 0.0. K and the group
    must be even and the group must divide K (the layout pairs values of k in a byte). Read once per
    weight object, as `int8_parts`."""
    return _parts(weight, _Q4_TYPES, _Q4_PARTS, _read_q4_parts)


def _read_q4_parts(weight: torch.Tensor) -> Q4Parts | None:
    if weight.device.type != "cpu" or weight.dtype not in DTYPES or weight.dim() != 2:
        return None
    if type(weight).__module__.startswith("hf_plookup"):  # bitsandbytes' nf4/fp4, GPTQ (invariant.module_weight)
        return weight.q4_fields()
    if type(weight).__module__.startswith("torchao"):
        return _torchao_grouped_parts(weight)
    if getattr(weight.qtype, "name", None) != "qint4" or weight.axis != 0:
        return None
    n, k = weight.shape
    group = weight._group_size or k  # (None: one scale and shift a column, as quanto does where K < 128)
    data = weight._data
    source = getattr(data, "_data", None)
    if not group or group % 2 or k % group or not _codes_tensor(source) or source.dtype != torch.uint8:
        return None
    if type(weight).__name__ == "TinyGemmWeightQBitsTensor":
        ss = weight._scale_shift  # [K / group, N, 2]: scale, zero
        block = int4pack_block()
        if (weight.dtype != torch.bfloat16 or tuple(ss.shape) != (k // group, n, 2) or block is None or n % block
                or tuple(source.shape) != (n, k // 2)):
            return None
        return Q4Parts(lambda: int4pack_codes(source, n, k, block), ss[:, :, 0].t(), ss[:, :, 1].t(), group, "fma",
                       8.0, source)
    scale, shift = weight._scale, weight._shift
    if (not shift.dtype.is_floating_point or scale.dtype != weight.dtype or shift.dtype != weight.dtype
            or scale.numel() != n * (k // group) or shift.numel() != scale.numel()):
        return None
    return Q4Parts(lambda: data.unpack().reshape(n, k), scale.reshape(n, k // group), shift.reshape(n, k // group),
                   group, "mul_sub", 0.0, source)


def _torchao_grouped_parts(weight: torch.Tensor) -> Q4Parts | None:
    """`q4_parts` of torchao's weight-only tensors that dequantize before `F.linear` (see there)."""
    name = type(weight).__name__
    inputs = None
    if name == "IntxUnpackedToInt8Tensor":
        bits = {torch.int4: 4, torch.int8: 8}.get(weight.target_dtype)
        act = weight.activation_quantization
        if act is not None:
            inputs = _torchao_token_inputs(str(getattr(act, "value", act)))
            if inputs is None:
                return None
    else:  # a grouped Int8Tensor (a per-row one is W_Q8: int8_parts)
        bits = 8
        if weight.act_quant_kwargs is not None or getattr(weight, "act_pre_scale", None) is not None:
            return None
    q, scale, zero = weight.qdata, weight.scale, weight.zero_point
    n, k = weight.shape
    block = [int(b) for b in weight.block_size]
    group = block[1] if len(block) == 2 and block[0] == 1 else 0
    if (bits is None or not group or group % 2 or k % group or (name == "Int8Tensor" and group == k)
            or not _codes_tensor(q) or q.dtype != torch.int8 or tuple(q.shape) != (n, k)
            or scale.dtype not in DTYPES or scale.numel() != n * (k // group)
            or (zero is not None and (zero.is_floating_point() or zero.numel() != scale.numel()))):
        return None
    offset = 1 << (bits - 1)
    scales = scale.reshape(n, k // group)
    shifts = torch.zeros(n, k // group) if zero is None else zero.reshape(n, k // group).float()
    if not bool(torch.isfinite(scales).all()):  # (the bf16 tiles round values that cannot be NaN)
        return None
    return Q4Parts(lambda: (q.to(torch.int16) + offset).to(torch.uint8), scales, shifts, group, "sub_mul",
                   float(offset), q, bits=bits, inputs=inputs)


def _torchao_token_inputs(kind: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchao's own per-token quantize-dequantize of a linear's inputs for an activation
    quantization it names `kind` (each row alone: its own minimum, maximum and rounding), else None."""
    if kind != "int8_asym_per_token":
        return None
    try:
        from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
            _apply_int8_act_asym_per_token_quant_dequant as quant_dequant)
    except ImportError:
        return None
    return quant_dequant


@functools.cache
def int4pack_block() -> int | None:
    """The columns of a block of torch's CPU int4pack layout (`torch._convert_weight_to_int4pack_for_cpu`,
    which quanto's tinygemm weights hold) on this machine, or None if its layout is not the one
    `int4pack_codes` reads. torch picks the block by the CPU it runs on (64 columns with AVX-512,
    32 with AVX2), so it is found by packing a probe of known codes."""
    n, k = 128, 4
    codes = (torch.arange(n)[:, None] * 3 + torch.arange(k)[None, :] * 5) % 16
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
    except (RuntimeError, AttributeError):
        return None
    for block in (64, 32, 16, 8):
        if tuple(packed.shape) == (n, k // 2) and torch.equal(int4pack_codes(packed, n, k, block), codes.to(torch.uint8)):
            return block
    return None


def int4pack_codes(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """The codes [n, k] of torch's CPU int4pack layout with blocks of `block` columns: bytes
    [n / block, k, block / 2], the low nibble of byte i column i of the block, the high one column
    block / 2 + i. (quanto's own `unpack` multiplies by a K x K identity, N K^2 work.)"""
    b = packed.reshape(n // block, k, block // 2)
    return torch.cat([b & 15, b >> 4], 2).permute(0, 2, 1).reshape(n, k)


def nibble_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The codes [n, k] of bitsandbytes' flat 4-bit layout: the weight's codes in order, two a byte,
    the first in the high nibble (bytes [0x12, 0x34] are codes 1, 2, 3, 4)."""
    b = packed.reshape(-1)
    return torch.stack([b >> 4, b & 15], 1).reshape(n, k)


def words_codes(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """The codes of `bits` bits (4 or 8) of int32 `words` [R, C], 32 / bits a word from its low bits
    up, as [R * 32 / bits, C] uint8: with 4 bits, code 8r + j of column c is bits 4j .. 4j + 3 of
    words[r, c] (GPTQ's `qweight` holds codes so along K; its `qzeros`, transposed, along N, and
    compressed-tensors' zero points along N).

    Example: the word 0x76543210 gives the codes 0, 1, ..., 7 (with 8 bits: 0x10, 0x32, 0x54, 0x76)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, per, 1)
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(words.shape[0] * per, words.shape[1]).to(torch.uint8)


def row_words_codes(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """The codes of `bits` bits (4 or 8) of int32 `words` [R, C] packed along the rows, 32 / bits a
    word from its low bits up, as [R, C * 32 / bits] uint8: with 4 bits, code 8c + j of row r is bits
    4j .. 4j + 3 of words[r, c] (compressed-tensors' `weight_packed` holds codes so along K). On a
    little-endian machine byte i of a row's bytes then holds codes 2i (low nibble) and 2i + 1, or,
    with 8 bits, code i: split bytes, not words.

    Example: the row [0x76543210] gives the codes 0, 1, ..., 7 (with 8 bits: 0x10, 0x32, 0x54, 0x76)."""
    if sys.byteorder != "little":
        return words_codes(words.t(), bits).t().contiguous()
    b = words.contiguous().view(torch.uint8)
    if bits == 8:
        return b.view(words.shape[0], -1)
    return torch.stack((b & 15, b >> 4), dim=-1).view(words.shape[0], -1)


def row_words(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """The inverse of `row_words_codes`: int32 words [R, C * bits / 32] of codes [R, C]."""
    per = 32 // bits
    if sys.byteorder != "little":
        c = codes.long().view(codes.shape[0], -1, per)
        words = sum(c[:, :, j] << (bits * j) for j in range(per))
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    if bits == 8:
        return codes.to(torch.uint8).contiguous().view(torch.int32)
    c = codes.to(torch.uint8).view(codes.shape[0], -1, 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).contiguous().view(torch.int32)


# AWQ packs 8 columns a word out of order: column j of a word's 8 is in its nibble AWQ_NIBBLE[j]
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_codes(words: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of int32 `words` [R, C] packed by AWQ along the columns, as [R, C * 8] uint8:
    code 8c + j of row r is bits 4i .. 4i + 3 of words[r, c] with i = AWQ_NIBBLE[j] (AWQ's
    `qweight` [K, N / 8] and `qzeros` [K / group, N / 8] hold codes so).

    Example: the word 0x76543210 gives the codes 0, 4, 1, 5, 2, 6, 3, 7."""
    shifts = torch.tensor(AWQ_NIBBLE, dtype=torch.int32) * 4
    return ((words.unsqueeze(2) >> shifts) & 15).reshape(words.shape[0], words.shape[1] * 8).to(torch.uint8)


def _codes_tensor(t) -> bool:
    """A tensor the readers take a library's codes from: a plain one, or one held in the kernels'
    packed bytes (cpu.packed_codes)."""
    return type(t) is torch.Tensor or (type(t).__name__ == "PackedCodes" and _own_packing(t) is not None)


def _quantized(weight: torch.Tensor) -> tuple[int, object]:
    """(W_Q8 or W_Q8T, its `int8_parts`) or (W_Q4, W_Q4K or W_Q8G, its `q4_parts`) for a quantized weight the C linears read,
    else (W_FLOAT, None)."""
    if type(weight) in (torch.Tensor, torch.nn.Parameter):
        return W_FLOAT, None
    parts = int8_parts(weight)
    if parts is not None:
        return (W_Q8B if parts.llm_int8 is not None else W_Q8 if parts.tokens is None else W_Q8T), parts
    q4 = q4_parts(weight)
    return (W_FLOAT, None) if q4 is None else (q4_kind(weight.shape[1], q4.group, q4.bits), q4)


def q4_kind(k: int, group: int, bits: int = 4) -> int:
    """The weight kind of codes of `bits` bits over K = `k` values a column in groups of `group`: W_Q8G
    for 8-bit codes; for 4-bit ones W_Q4K (laid out along k, each group's 16 values a table that
    AVX-512's permutes look 16 codes up in at once: cpu_kernels.h) where K and the group are multiples
    of 32 and the CPU runs level 2 (AVX-512 with BF16: `cpu_level`), else W_Q4. With AVX2 alone, W_Q4's tiles run as
    fast at one row and faster on prompt chunks (docs/results.md, "CPU 4-bit linears along k"), so
    such a CPU keeps W_Q4 (W_Q4K's own tiles there give its bits, for the tests).

    Example: on an AVX-512 CPU q4_kind(2048, 128) is W_Q4K; q4_kind(576, 16) and q4_kind(20, 2) are W_Q4."""
    if bits == 8:
        return W_Q8G
    return W_Q4K if k % Q4K_BLOCK == 0 and group % Q4K_BLOCK == 0 and cpu_level() >= 2 else W_Q4


def code_bits(kind: int) -> int:
    """The bits of a W_Q4 or W_Q4K (4) or W_Q8G (8) weight's codes."""
    return 8 if kind == W_Q8G else 4


def weight_kind(weight: torch.Tensor) -> int:
    """W_Q8 for a weight `int8_parts` reads (W_Q8T where its inputs are quantized per token, W_Q8B for
    bitsandbytes' LLM.int8), W_Q4 or
    W_Q4K (`q4_kind`) for one `q4_parts` reads with 4-bit codes, W_Q8G with 8-bit ones, else W_FLOAT."""
    return _quantized(weight)[0]


def supported(weight: torch.Tensor) -> bool:
    """Whether `linear` takes this weight, the kernels being built (`linear` and `attend` may be
    called once this or `available()` said so): a plain 2-D CPU tensor of `DTYPES` or one
    packed in place (not another tensor subclass, such as a sharded DTensor), or a quantized weight of
    `int8_parts` or `q4_parts`."""
    if not available():
        return False
    if _plain(weight):
        return weight.dtype in DTYPES and weight.dim() == 2
    return weight_kind(weight) != W_FLOAT


def takes_inputs_as_they_are(weight: torch.Tensor) -> bool:
    """Whether `linear` of this weight (`supported`) multiplies its inputs as they are: what the C
    decoder layers, which call the kernel on their own buffers, need (not so for torchao's
    weights whose inputs are quantized per token first: `Q4Parts.inputs`)."""
    kind, parts = _quantized(weight)
    return kind not in Q4_KINDS or parts.inputs is None


def pack_q8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 `values` [N, K] and `scales` [N] in the W_Q8 layout `linear` reads for calls in `dtype`
    (bytes): panels of 8 output columns [P, K2, 8] int8 (K2: K, rounded up to even for bfloat16; zeros
    past N and K), then, from the next 64-byte boundary, P * 8 float32 scales (each rounded to `dtype`
    first; zeros past N).

    Example: values [[1, 2], [3, 4]], scales [0.5, 2] (float32) give the panel bytes
    [[1, 3, 0, 0, 0, 0, 0, 0], [2, 4, 0, 0, 0, 0, 0, 0]], then from byte 64 the floats [0.5, 2, 0, ..., 0]."""
    n, k = values.shape
    p, k2 = -(-n // 8), _q8_k2(k, dtype)
    at = q8_scale_bytes(p, k2)
    out = torch.zeros(at + p * 8 * 4, dtype=torch.uint8)
    with torch.no_grad():
        write_q8_values(out, values, dtype)
        out[at:].view(torch.float32)[:n].copy_(scales.to(dtype).float())
    return out


def pack_q8t(values: torch.Tensor, scales: torch.Tensor, tokens: Int8Tokens) -> torch.Tensor:
    """int8 `values` [N, K] whose inputs are quantized per token (`tokens`), with float32 column
    `scales` [N], in the W_Q8T layout (cpu_kernels.h): `pack_q8`'s bytes for float32 calls with unit
    scales, then P * 8 float32 scales (zeros past N) and the codes' range as two int32.

    Example: values [[1, 2], [3, 4]], scales [0.5, 2], codes in [-128, 127]: the panel bytes of
    `pack_q8`, unit scales from byte 64, [0.5, 2, 0, ..., 0] from byte 96, then -128 and 127."""
    n, p = values.shape[0], -(-values.shape[0] // 8)
    head = pack_q8(values, torch.ones(n), torch.float32)
    tail = torch.zeros(p * 8 + 2, dtype=torch.float32)
    tail[:n] = scales.float()
    tail[p * 8 :].view(torch.int32).copy_(torch.tensor([tokens.qmin, tokens.qmax], dtype=torch.int32))
    return torch.cat([head, tail.view(torch.uint8)])


def pack_q8b(values: torch.Tensor, scales: torch.Tensor, threshold: float) -> torch.Tensor:
    """What the C linears read of an LLM.int8 weight (W_Q8B, cpu_kernels.h `q8b_weight`): not its codes,
    which stay where bitsandbytes keeps them, but a 32-byte record of where they and the float32 column
    `scales` [N] lie, each output's sum of codes (made here, int32 [N]) and the outlier `threshold`.
    The record holds the three tensors (`.parts`), so the memory it names lives as long as it does.

    Example: values [[1, -2], [127, 0]] (int8) give sums [-1, 127]; the record's bytes 0-23 are the
    addresses of values, scales and sums, bytes 24-27 the threshold as float32."""
    sums = values.sum(dim=1, dtype=torch.int32).contiguous()
    record = torch.zeros(4, dtype=torch.int64)
    record[:3] = torch.tensor([values.data_ptr(), scales.data_ptr(), sums.data_ptr()], dtype=torch.int64)
    record.view(torch.float32)[6] = threshold
    record.parts = (values, scales, sums)
    return record


def _q8_k2(k: int, dtype: torch.dtype) -> int:
    """The values of k a W_Q8 panel holds for calls in `dtype` (bfloat16 pairs them: K rounded up to even)."""
    return k + (k & 1) if dtype == torch.bfloat16 else k


def _q8_panels(packed: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The panels [P, K2, 8] int8 of a W_Q8 weight's bytes (`pack_q8`), as a view."""
    p, k2 = -(-n // 8), _q8_k2(k, dtype)
    return packed[: p * k2 * 8].view(torch.int8).view(p, k2, 8)


def write_q8_values(packed: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Write int8 `values` [N, K] into the panels of W_Q8 bytes made for them (`pack_q8`); the
    scales stay."""
    n, k = values.shape
    panels = _q8_panels(packed, n, k, dtype)
    p, k2 = panels.shape[:2]
    panels.copy_(F.pad(values, (0, k2 - k, 0, 8 * p - n)).view(p, 8, k2).permute(0, 2, 1))


def q8_values(packed: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The int8 values [N, K] that W_Q8 bytes made by `pack_q8(values, scales, dtype)` hold (a new
    contiguous tensor)."""
    panels = _q8_panels(packed, n, k, dtype)
    return panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:n, :k].contiguous()


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor, group: int, form: str, offset: float,
            dtype: torch.dtype, lut: torch.Tensor | None = None, bits: int = 4, kind: int | None = None) -> torch.Tensor:
    """4-bit `codes` [N, K] (uint8, 0..15) with `scales` and `shifts` [N, K / group] in the W_Q4 layout
    `linear` reads for calls in `dtype` (bytes): panels of 8 output columns [P, K / 2, 8], byte c of
    pair j holding column c's code at k = 2j in its low nibble and at 2j + 1 in its high one (zeros
    past N); from the next 64-byte boundary a 128-byte header (int32 group, int32 form of `Q4_FORMS`,
    float32 offset, zeros to byte 64, then the 16 float32 values of `lut`, the "lut" form's codebook);
    then [P, K / group, 2, 8] float32: each panel's 8 scales of a group, then its 8 shifts (zeros past
    N). The "mul_sub" and "fma" forms' scales and shifts are rounded to `dtype` first (they are the
    library's values in the weight's dtype); the "lut" form's scales are bitsandbytes' float32 absmax,
    the "sub_mul_f16" form's GPTQ's fp16 scales and integer zeros, and the "sub_mul" form's the
    library's scales (compressed-tensors' in the weight's dtype, torchao's grouped int8 ones float32
    for a bfloat16 weight) and integer zero points, all kept so.

    `bits=8` (weight kind W_Q8G): 8-bit codes (0..255) in panels [P, K, 8], byte c of k column c's code;
    the rest as above; the "sub_mul" form only.

    `kind` (default `q4_kind(K, group, bits)`): W_Q4K lays the 4-bit codes out along k instead
    (cpu_kernels.h): each panel's two halves of 4 columns [2, K / 32, 4, 16] bytes, byte l of a
    column's 16 in block b holding its code at k = 32b + l in the low nibble and at 32b + 16 + l in
    the high one; the rest as above.

    Example: codes [[1, 2], [3, 4]], group 2, scales [[0.5], [2]], shifts [[0], [1]] give the panel
    bytes [0x21, 0x43, 0, 0, 0, 0, 0, 0], then from byte 64 the header [2, form, offset, 0, ...], then
    from byte 192 the floats [0.5, 2, 0, ..., 0, 0, 1, 0, ..., 0]. With bits=8 the panel bytes are
    [1, 3, 0, 0, 0, 0, 0, 0, 2, 4, 0, 0, 0, 0, 0, 0], and the rest the same."""
    n, k = codes.shape
    if k % 2 or group % 2 or k % group or scales.shape != (n, k // group) or shifts.shape != scales.shape:
        raise ValueError(f"pack_q4: codes {tuple(codes.shape)}, group {group}, scales {tuple(scales.shape)}, "
                         f"shifts {tuple(shifts.shape)} do not make a W_Q4 weight (K and the group even, the group dividing K)")
    if (form == "lut") != (lut is not None) or (lut is not None and lut.numel() != 16):
        raise ValueError(f"pack_q4: the form {form!r} takes a codebook of 16 values exactly when it is 'lut'")
    if bits not in (4, 8) or (bits == 8 and form != "sub_mul"):
        raise ValueError(f"pack_q4: codes of {bits} bits in the form {form!r}: 4 bits in any form, or 8 in 'sub_mul'")
    kind = q4_kind(k, group, bits) if kind is None else kind
    if kind != (W_Q8G if bits == 8 else W_Q4) and (kind != W_Q4K or bits != 4 or k % Q4K_BLOCK or group % Q4K_BLOCK):
        raise ValueError(f"pack_q4: kind {kind} for {bits}-bit codes, K {k}, group {group}: W_Q4K needs 4-bit codes, "
                         f"K and the group multiples of {Q4K_BLOCK}")
    p, groups = -(-n // 8), k // group
    at = (p * k * bits + 63) // 64 * 64  # (a panel holds bits bytes a k: 8 columns' codes)
    out = torch.zeros(at + Q4_META_BYTES + p * groups * 16 * 4, dtype=torch.uint8)
    with torch.no_grad():
        write_q4_codes(out, codes, kind)
        head = out[at : at + Q4_META_BYTES].view(torch.int32)
        head[0], head[1] = group, Q4_FORMS[form]
        head[2:3].view(torch.float32)[0] = offset
        if lut is not None:
            head[16:].view(torch.float32).copy_(lut.reshape(16).float())
        sz = torch.stack([scales, shifts], 1)  # [N, 2, groups]
        sz = (sz.float() if form in ("lut", "sub_mul_f16", "sub_mul") else sz.to(dtype).float())
        sz = F.pad(sz, (0, 0, 0, 0, 0, 8 * p - n)).view(p, 8, 2, groups).permute(0, 3, 2, 1)
        out[at + Q4_META_BYTES :].view(torch.float32).view(p, groups, 2, 8).copy_(sz)
    return out


def write_q4_codes(packed: torch.Tensor, codes: torch.Tensor, kind: int = W_Q4) -> None:
    """Write `codes` [N, K] into the panels of W_Q4, W_Q4K or W_Q8G (`kind`) bytes made for them
    (`pack_q4`); the header, scales and shifts stay."""
    n, k = codes.shape
    p = -(-n // 8)
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, 8 * p - n))
    if kind == W_Q8G:
        packed[: p * k * 8].view(p, k, 8).copy_(c.view(p, 8, k).permute(0, 2, 1))
    elif kind == W_Q4K:  # [half, column, block, nibble, l] -> [half, block, column, l]
        c = c.view(2 * p, 4, k // Q4K_BLOCK, 2, 16)
        packed[: p * k * 4].view(2 * p, k // Q4K_BLOCK, 4, 16).copy_((c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3))
    else:
        c = c.view(p, 8, k // 2, 2)
        packed[: p * k * 4].view(p, k // 2, 8).copy_((c[..., 0] | (c[..., 1] << 4)).permute(0, 2, 1))


def q4_codes(packed: torch.Tensor, n: int, k: int, kind: int = W_Q4) -> torch.Tensor:
    """The codes [N, K] (uint8) that W_Q4, W_Q4K or W_Q8G (`kind`) bytes made by `pack_q4` hold (a new
    contiguous tensor)."""
    p = -(-n // 8)
    if kind == W_Q8G:
        return packed[: p * k * 8].view(p, k, 8).permute(0, 2, 1).reshape(8 * p, k)[:n].contiguous()
    if kind == W_Q4K:
        b = packed[: p * k * 4].view(2 * p, k // Q4K_BLOCK, 4, 16).permute(0, 2, 1, 3)  # [half, column, block, l]
        return torch.stack([b & 15, b >> 4], 3).reshape(8 * p, k)[:n].contiguous()
    b = packed[: p * k * 4].view(p, k // 2, 8).permute(0, 2, 1)  # [P, 8, K / 2]
    return torch.stack([b & 15, b >> 4], 3).reshape(8 * p, k)[:n].contiguous()


def pack_reference(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] in the layout `linear` reads: panels of 8 output columns, P = ceil(N / 8) of them,
    zeros past N. float32 and float16: [P, K, 8], element [p, k, c] = weight[8p + c, k]. bfloat16: [P, K2 / 2, 8, 2]
    (K2: K rounded up to even, zeros past K), element [p, j, c, h] = weight[8p + c, 2j + h], so that
    one 32-bit lane holds values k and k + 1 of a column. `out`: a tensor of that shape to write to.
    In torch ops, one thread: the reference `pack` (C, threaded) is tested against.

    Example (float32): weight [[1, 2], [3, 4]] (N = 2, K = 2) packs to shape [1, 2, 8], the one panel
    [[1, 3, 0, 0, 0, 0, 0, 0], [2, 4, 0, 0, 0, 0, 0, 0]]: for each k, the 8 columns side by side."""
    n, k = weight.shape
    p = -(-n // 8)
    with torch.no_grad():
        if weight.dtype == torch.bfloat16:
            k2 = k + (k & 1)
            src = F.pad(weight, (0, k2 - k, 0, 8 * p - n)).view(p, 8, k2 // 2, 2).permute(0, 2, 1, 3)
        else:
            src = F.pad(weight, (0, 0, 0, 8 * p - n)).view(p, 8, k).permute(0, 2, 1)
        if out is None:
            return src.contiguous()
        return out.copy_(src)


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`pack_reference(weight, out)` by the C code (`csrc/pack.c`): one pass over the weight at memory
    speed, on the kernels' threads; the same values in the same places."""
    if _own_packing(weight) is not None:
        weight = weight.unpacked()
    if not available() or not _plain(weight):
        return pack_reference(weight, out)
    w = weight.detach()
    w = w if w.is_contiguous() else w.contiguous()
    if out is None:
        out = torch.empty(packed_shape(w), dtype=w.dtype)
    if out.shape != packed_shape(w) or out.dtype != w.dtype or not out.is_contiguous():
        raise ValueError(f"pack: out {tuple(out.shape)} {out.dtype} is not the packed form of {tuple(w.shape)} {w.dtype}")
    _pack_c(w.data_ptr(), w.shape[0], w.shape[1], w.dtype, out.data_ptr(), 0)
    return out


def _pack_c(w_ptr: int, n: int, k: int, dtype: torch.dtype, packed_ptr: int, unpack: int) -> None:
    # bf16 with K even is fp32's layout with K/2 32-bit pairs (a pair is values 2j, 2j + 1 of a row):
    # moved as 32-bit words, twice as fast as 16-bit ones
    dt = dtype_code(dtype)
    if dtype == torch.bfloat16 and k % 2 == 0:
        dt, k = dtype_code(torch.float32), k // 2
    _LIB.pack_weight(w_ptr, n, k, dt, packed_ptr, unpack, threads())


def unpack(packed: torch.Tensor, n: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The [n, k] weight that `pack` packed into `packed` (a new contiguous tensor, or written into
    `out`). Example: the panel of `pack`'s example unpacks to [[1, 2], [3, 4]]."""
    if out is None:
        out = torch.empty(n, k, dtype=packed.dtype)
    if out.shape != (n, k) or not out.is_contiguous() or out.dtype != packed.dtype:
        raise ValueError(f"unpack: out {tuple(out.shape)} {out.dtype} is not a contiguous [{n}, {k}] {packed.dtype}")
    if available():
        _pack_c(out.data_ptr(), n, k, packed.dtype, packed.contiguous().data_ptr(), 1)
        return out
    p = packed.shape[0]
    if packed.dtype == torch.bfloat16:
        return out.copy_(packed.permute(0, 2, 1, 3).reshape(8 * p, -1)[:n, :k])
    return out.copy_(packed.permute(0, 2, 1).reshape(8 * p, k)[:n])


def packed_rows(packed: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, k] weight packed in `packed` ([*ids.shape, k]): an embedding lookup in a
    table that is also a packed LM head. Example: `packed_rows(pack(w), w.shape[1], torch.tensor([2, 0]))`
    equals `w[[2, 0]]`."""
    p, c = torch.div(ids, 8, rounding_mode="floor"), ids % 8
    if packed.dtype == torch.bfloat16:  # [P, K2/2, 8, 2]: row n is [n // 8, :, n % 8, :]
        rows = packed.permute(0, 2, 1, 3)[p, c].flatten(-2)
        return rows[..., :k] if rows.shape[-1] != k else rows
    return packed.permute(0, 2, 1)[p, c]


def packed_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The shape `pack` gives `weight` (see there)."""
    n, k = weight.shape
    p = -(-n // 8)
    return (p, (k + 1) // 2, 8, 2) if weight.dtype == torch.bfloat16 else (p, k, 8)


def packed_numel(weight: torch.Tensor) -> int:
    """Elements of `pack(weight)`."""
    return int(np.prod(packed_shape(weight)))


# id(weight) -> (a weak reference to it, its address and version counter when packed, the packed copy)
_PACKED: dict[int, tuple] = {}
_PACK_LOCK = threading.Lock()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter (nor in-place changes outside inference)
        return None


def values_of(weight: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds `weight`'s values: an int8 weight's integers (`int8_parts`), a
    4-bit weight's packed codes (`q4_parts`), a PackedWeight's panels, else the weight itself. Its
    address and version counter say whether the values moved or changed."""
    kind, parts = _quantized(weight)
    if kind in (W_Q8, W_Q8T, W_Q8B):
        return parts.values
    if kind in Q4_KINDS:
        return parts.source
    got = _own_packing(weight)
    return weight if got is None else got


def _current(weight: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    entry = _PACKED.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == src.data_ptr() and entry[2] == _version(src):
        return entry[3]
    return None


def _keep(weight: torch.Tensor, src: torch.Tensor, copy: torch.Tensor) -> None:
    key = id(weight)
    _PACKED[key] = (weakref.ref(weight, lambda _, key=key: _PACKED.pop(key, None)), src.data_ptr(), _version(src), copy)


def _pack_any(weight: torch.Tensor) -> torch.Tensor:
    kind, parts = _quantized(weight)
    if kind == W_Q8:
        return pack_q8(parts.values, parts.scales, weight.dtype)
    if kind == W_Q8T:
        return pack_q8t(parts.values, parts.scales, parts.tokens)
    if kind == W_Q8B:
        return pack_q8b(parts.values, parts.scales, parts.llm_int8)
    if kind in Q4_KINDS:
        return pack_q4(parts.codes(), parts.scales, parts.shifts, parts.group, parts.form, parts.offset, weight.dtype,
                       parts.lut, parts.bits, kind)
    return pack(weight)


def packed(weight: torch.Tensor) -> torch.Tensor:
    """`pack(weight)` (for an int8 weight, `pack_q8` of its `int8_parts`; for a 4-bit one, `pack_q4`
    of its `q4_parts`), made once and kept while `weight` lives, its values at the same address and with the same version counter (an in-place
    change, such as `load_state_dict` or merging an adapter, bumps it; a new `.data` moves it): then
    packed again."""
    got = _own_packing(weight)
    if got is not None:  # a PackedWeight: the packed values are the weight itself
        return got
    src = values_of(weight)
    got = _own_packing(src)
    if got is not None:  # codes held in the packed bytes (cpu.packed_codes): those bytes are the weight
        if got.__dict__.get("packed_at") != got._version:
            # codes written in place since (load_state_dict): the scales may have changed with them
            with _PACK_LOCK:
                got.copy_(_pack_any(weight))
                got.packed_at = got._version
        return got
    got = _current(weight, src)
    if got is None:
        with _PACK_LOCK:
            got = _current(weight, src)
            if got is None:
                got = _pack_any(weight)
                _keep(weight, src, got)
    return got


def forget(weight: torch.Tensor) -> None:
    """Drop what was read and packed of `weight` (its codes moved into a new tensor: cpu.packed_codes)."""
    for cache in (_INT8_PARTS, _Q4_PARTS, _PACKED):
        cache.pop(id(weight), None)


def linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x2d, weight, bias)` for x2d [M, K] in weight's dtype (one of `DTYPES`; an int8
    weight's: that of its scales), each row computed as it would be alone, from `packed(weight)`.
    `supported(weight)` must hold."""
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    if x2d.dtype != weight.dtype:
        raise TypeError(f"x is {x2d.dtype}, weight is {weight.dtype}: cpu_kernels.linear needs one dtype")
    kind, parts = _quantized(weight)
    if kind in Q4_KINDS and parts.inputs is not None:  # (row by row, as the library does first)
        x2d = parts.inputs(x2d).to(weight.dtype).contiguous()
    b = None if bias is None else bias.to(weight.dtype).contiguous()
    return _linear_call(x2d, packed(weight), kind, b, weight.shape[0])


def _linear_call(x2d: torch.Tensor, packed_w: torch.Tensor, kind: int, bias: torch.Tensor | None,
                 n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The C `linear` of contiguous x2d [M, K] over packed bytes of `kind`, in x2d's dtype (bias, if
    any, of it too): [M, n], written into `out` (contiguous) where given."""
    m, k = x2d.shape
    out = torch.empty(m, n, dtype=x2d.dtype) if out is None else out
    if m:  # (the kernel reads and writes raw memory: autograd never sees it, as in inference)
        if _LIB.linear(x2d.data_ptr(), m, packed_w.data_ptr(), kind, k, None if bias is None else bias.data_ptr(), n,
                       out.data_ptr(), dtype_code(x2d.dtype), threads()):
            raise MemoryError("cpu_kernels.linear: no memory for the transposed input")
    return out


def screen_pack(head: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int8 screen of a packed float LM head (`pack`'s panels of an [n, k] weight; csrc/head_screen.c):
    its W_Q8 bytes for float32 calls (`pack_q8`'s layout; per output the scale max |w| / 127 and the
    codes rint(w * (127 / max |w|)) in float32) and each output's bound coefficient D [n] (cpu_kernels.h,
    "head screen").
    None where a value of the head is not finite.

    Example: the float32 head [[1, -0.5], [0, 0]] gives codes [[127, -64], [0, 0]] (-63.5 rounds to
    even), scales [1 / 127, 0], and D[1] = 0 (a zero row is its screen exactly)."""
    p = -(-n // 8)
    codes = torch.zeros(q8_scale_bytes(p, k) + p * 8 * 4, dtype=torch.uint8)
    bound = torch.empty(n, dtype=torch.float32)
    if _LIB.screen_pack(head.data_ptr(), n, k, dtype_code(head.dtype), codes.data_ptr(), bound.data_ptr(), threads()):
        return None
    return codes, bound


def q8_scale_bytes(p: int, k2: int) -> int:
    """Where the scales of a W_Q8 weight of `p` panels and `k2` values a column start (`pack_q8`)."""
    return (p * k2 * 8 + 63) // 64 * 64


def screen_pick(x: torch.Tensor, a: torch.Tensor, bound: torch.Tensor, bias: torch.Tensor | None,
                cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's candidates for its first largest exact logit (csrc/head_screen.c `screen_pick`): x [M, K]
    the head's inputs in its dtype, `a` [M, N] the screen's logits (float32), `bound` the screen's D, `bias`
    the head's (its dtype) or None. Returns (cand [M, cap], count [M]): row m's candidates are
    cand[m, :count[m]] in increasing order; count[m] = cap + 1 where more than `cap` are."""
    m = x.shape[0]
    cand, count = torch.empty(m, cap, dtype=torch.int64), torch.empty(m, dtype=torch.int64)
    _LIB.screen_pick(x.data_ptr(), m, x.shape[1], a.data_ptr(), a.shape[1], bound.data_ptr(),
                     None if bias is None else bias.data_ptr(), dtype_code(x.dtype), cap, cand.data_ptr(),
                     count.data_ptr(), threads())
    return cand, count


def screen_exact(x: torch.Tensor, head: torch.Tensor, n: int, bias: torch.Tensor | None, cand: torch.Tensor,
                 count: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit among its candidates (`screen_pick`'s, none over the cap), each
    computed as `linear` computes it from the packed head of `n` outputs: the tokens, int64 [M]."""
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    if _LIB.screen_exact(x.data_ptr(), x.shape[0], x.shape[1], head.data_ptr(), n,
                         None if bias is None else bias.data_ptr(), dtype_code(x.dtype), cand.data_ptr(),
                         count.data_ptr(), cand.shape[1], tokens.data_ptr()):
        raise MemoryError("cpu_kernels.screen_exact: no memory for the widened row")
    return tokens


# the RMSNorm arithmetic `rms_norm` reproduces, r being 1 / sqrt(mean(x^2) + eps) in float32:
# "scale_after" (Llama's and most models'): weight * (x * r) with x * r rounded to x's dtype first;
# "one_plus" (Gemma's): x * r * (1 + weight) in float32, rounded once
RMS_FORMS = {"scale_after": 0, "one_plus": 1}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """RMS normalization of x [..., K] over its last dimension with weight [K] (both of one dtype of
    `DTYPES`, on CPU), each row alone in one fixed order (`RMS_FORMS` names the forms).

    Example (float32): x = [[3, 4]], weight = [1, 1], eps = 0: r = 1 / sqrt(12.5), so
    `rms_norm(x, w, 0.0, "scale_after")` is [[0.8485, 1.1314]], and "one_plus" doubles it."""
    k = weight.shape[-1]
    if x.dtype != weight.dtype or x.dtype not in DTYPES or x.shape[-1] != k or weight.dim() != 1:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    x2d = x.reshape(-1, k)
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    w = weight.contiguous()
    out = torch.empty(x2d.shape, dtype=x.dtype)
    _LIB.rms_norm(x2d.data_ptr(), x2d.shape[0], k, w.data_ptr(), eps, RMS_FORMS[form], out.data_ptr(),
                  dtype_code(x.dtype), threads())
    return out.view(x.shape)


def rms_eps(module: torch.nn.Module) -> float | None:
    """A norm module's epsilon (`variance_epsilon` or `eps`), or None."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def rms_form(module: torch.nn.Module) -> str | None:
    """Which `RMS_FORMS` form `module`'s forward computes, or None. A candidate is a
    module named like a norm, with one 1-D CPU weight of `DTYPES`, an epsilon
    (`variance_epsilon` or `eps`) and a forward of the hidden states alone; its form is the one
    whose output matches the module's own on random rows (to float32 rounding, or the 16-bit dtype's)."""
    weight, eps = getattr(module, "weight", None), rms_eps(module)
    if ("norm" not in type(module).__name__.lower() or not isinstance(weight, torch.nn.Parameter) or eps is None
            or weight.dim() != 1 or weight.device.type != "cpu" or weight.dtype not in DTYPES
            or not available()):
        return None
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return None
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, weight.shape[0], generator=gen) * 3 + 0.5).to(weight.dtype)
    tol = 1e-5 if weight.dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        try:
            ref = type(module).forward(module, x)
        except Exception:  # noqa: BLE001 - a norm whose forward wants other inputs is left alone
            return None
        if not isinstance(ref, torch.Tensor) or ref.shape != x.shape or ref.dtype != x.dtype:
            return None
        for form in RMS_FORMS:
            got = rms_norm(x, weight, eps, form)
            if torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max())):
                return form
    return None


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: np.ndarray, seq: np.ndarray,
           run_lo: np.ndarray, run_hi: np.ndarray, extra_off: np.ndarray, extra: np.ndarray, scale: float,
           softcap: float | None) -> torch.Tensor:
    """Attention of T query tokens over one layer's pages, each query over exactly its keys.

    q [T, H, D] (the cache's dtype, one of `DTYPES`); k_cache [num_blocks, block_size, H_kv,
    D], v_cache the same with Dv values (Dv = D but for multi-head latent attention); kv_slots [B, Lk] int64 flat slot of each cache position of a
    sequence; per token t: its sequence seq[t], the run of cache positions run_lo[t] ..
    run_hi[t] - 1 it reads, then extra[extra_off[t] : extra_off[t + 1]] (a tree node's
    ancestors and itself). Returns [T, H, Dv] in q's dtype.

    Example: one sequence with 3 cached tokens feeding a 2-token chain (positions 3 and 4):
    seq = [0, 0], run_lo = [0, 0], run_hi = [4, 5], extra_off = [0, 0, 0], extra = [].
    """
    t, h, d = q.shape
    h_kv, dv = k_cache.shape[-2], v_cache.shape[-1]
    if (q.dtype != k_cache.dtype or k_cache.dtype not in DTYPES or k_cache.shape[-1] != d or h % h_kv
            or v_cache.dtype != k_cache.dtype or v_cache.shape[:-1] != k_cache.shape[:-1]):
        raise ValueError(f"attend: q {tuple(q.shape)} {q.dtype} does not fit pages {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    q = q.contiguous()
    out = q.new_empty(t, h, dv)
    if t == 0:
        return out
    slots, *per_token = (np.ascontiguousarray(a, dtype=np.int64) for a in (kv_slots, seq, run_lo, run_hi, extra_off, extra))
    failed = _LIB.attend(q.data_ptr(), t, h, d, dv, k_cache.data_ptr(), v_cache.data_ptr(), h_kv, slots.ctypes.data,
                         slots.shape[-1], *(a.ctypes.data for a in per_token), scale, softcap or 0.0, out.data_ptr(),
                         dtype_code(q.dtype), threads())
    if failed:
        raise MemoryError("cpu_kernels.attend: no memory for the attention scores")
    return out
