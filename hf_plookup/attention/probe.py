"""Wrap-time probe: does this model's attention really run through `AttentionInterface`, and
what do its keys look like per layer?

A class flag (`_supports_attention_backend`) is not the truth: some models dispatch through
transformers' attention functions without setting it, others set it but keep layers that never
call an attention function (Mamba mixers) or share keys across layers. So the model is run twice
on a few tokens: once as it is, once with a recording attention function registered under its
own name that computes plain causal attention from the arguments it is given. The recording gives
each layer's real key layout (KV heads, head size, dtype, device: from the tensors, not from config
fields the architecture may ignore), and the two outputs must agree, or the model is refused with
the reason. A layer that calls no attention function must be a recurrent mixer whose state
mixers.recurrent keeps per sequence, or mix no tokens at all; a third run feeds the tokens in
pieces as the engine does (a prompt chunk, then one token at a time) and must agree too.

Quantized linears (torchao, bitsandbytes, quanto) round a row differently with another row count
(a GEMV kernel against a dequantize-and-GEMM one; LLM.int8's outlier columns chosen over all rows
of a call), and int8 activations turn one-ulp differences into whole quantization steps. Such a
model's own forward moves its logits by more than the tolerance between calls that compute the
same thing, and so does the engine's. So where a quantized model's outputs differ beyond the
tolerance, the probe first measures that floor with the model's own forward (`_arithmetic_floor`)
and takes a difference within `FLOOR_MARGIN` times it for arithmetic: the model runs, with one
warning and the note `SpecStats.exactness_note` saying that greedy may part from HF's after a
near-tie. A larger difference is still refused, with the floor in the reason.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache

from ..base.dense import softcapped_attention
from ..base.device import input_device
from .positions import given_positions, position_embedders
from ..base.layout import StepRows
from ..mixers.recurrent import RecurrentMixers, mixer_modules, no_mixer_layers
from .registry import engine_attention

logger = logging.getLogger("hf_plookup")

PROBE_IMPLEMENTATION = "hf_plookup_probe"
PROBE_TOKENS = 5  # tokens of the probe input
# a quantized model's outputs may differ from its own forward's by this many times what its own
# forward varies between calls that compute the same thing (`_arithmetic_floor`): room for the
# engine's other call shapes, while a semantic difference (keys shared across layers, positions
# from a cache) is of the logits' own size, far above it (docs/usage.md, "Quantized models")
FLOOR_MARGIN = 3.0


@dataclass(slots=True)
class KeyLayout:
    """What one layer's attention function was handed as keys."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    value_head_dim: int | None = None  # values' head size where it is not the keys' (multi-head latent attention)
    sinks: bool = False  # the layer passes attention sinks (`s_aux`, gpt-oss)


@dataclass(slots=True)
class _Recording:
    layouts: dict[int, KeyLayout] = field(default_factory=dict)  # layer_idx -> layout
    anonymous_calls: int = 0  # calls from modules without an int `layer_idx`
    # the continuation check: each layer's keys/values so far ([1, H_kv, L, D]), which later calls
    # attend over as the paged cache would (None: the whole-input probe)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("hf_plookup_probe", default=None)


def _probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Record the key layout, then plain causal attention (windowed, soft-capped, with sinks as
    asked)."""
    sinks = kwargs.get("s_aux")
    rec = _RECORDING.get()
    idx = getattr(module, "layer_idx", None)
    past = 0
    if rec is not None and rec.kv is not None and isinstance(idx, int):  # a continuation: earlier keys first
        if idx in rec.kv:
            past = rec.kv[idx][0].shape[2]
            key, value = (torch.cat([a, b], 2) for a, b in zip(rec.kv[idx], (key, value)))
        rec.kv[idx] = (key, value)
    elif rec is not None:
        if isinstance(idx, int):
            dv = value.shape[3]
            rec.layouts[idx] = KeyLayout(key.shape[1], key.shape[3], key.dtype, key.device,
                                         dv if dv != key.shape[3] else None, sinks is not None)
        else:
            rec.anonymous_calls += 1
    t = query.shape[2]
    qpos = past + torch.arange(t, device=query.device)
    kpos = torch.arange(key.shape[2], device=query.device)
    visible = kpos[None, :] <= qpos[:, None]  # [T, L] causal
    if sliding_window:
        visible &= kpos[None, :] > qpos[:, None] - sliding_window
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = softcapped_attention(query.float(), key.float(), value.float(), visible, scale, softcap, sinks)  # [1, H, T, D]
    out = out.to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _arch(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    return f"{type(model).__name__} (architecture '{getattr(config, 'model_type', None) or '?'}')"


def _takes_positions(model: torch.nn.Module) -> bool:
    """Whether the model's forward has a `position_ids` parameter (HF's generate then passes them)."""
    return "position_ids" in inspect.signature(model.forward).parameters


def _num_layers(model: torch.nn.Module) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "num_hidden_layers", None)


def fails_in_inference_mode(error: BaseException) -> bool:
    """Whether a probe's refusal came from the model's own forward failing under
    `torch.inference_mode` alone: optimum-quanto's int4 weights raise "Cannot set version_counter
    for inference tensor" there, and run under `torch.no_grad`, as HF's `generate` runs them."""
    cause = error.__cause__
    return isinstance(cause, RuntimeError) and "inference tensor" in str(cause)


def probe_key_layouts(model: torch.nn.Module, atol: float = 1e-3, notes: list[str] | None = None,
                      grad_mode=torch.inference_mode) -> list[KeyLayout | None]:
    """`_probe_key_layouts` under `grad_mode` (torch.inference_mode, or torch.no_grad where the
    model's forward fails in inference mode: `fails_in_inference_mode`)."""
    with grad_mode():
        return _probe_key_layouts(model, atol, notes)


def _probe_key_layouts(model: torch.nn.Module, atol: float = 1e-3,
                       notes: list[str] | None = None) -> list[KeyLayout | None]:
    """One `KeyLayout` per decoder layer, None for a layer without keys (a recurrent mixer's,
    mixers.recurrent, or one that mixes no tokens); `ValueError` naming the architecture and the
    reason when the paged attention and the per-sequence states cannot stand in for the model's own.

    Three forwards on a few tokens: the model as it is (the reference), then with a recording
    attention function (each layer's key layout; the outputs must not change: `_refusal`, a
    diagnosis of what differs), then fed as the engine feeds it (a chunk, then later tokens with
    their position_ids and no cache object: `_continuation_diff`). A quantized model whose outputs
    differ beyond the tolerance but within `FLOOR_MARGIN` times its own forward's variation
    (`_arithmetic_floor`) runs: one warning, and the note appended to `notes` (what
    `SpecStats.exactness_note` reports)."""
    if AttentionInterface._global_mapping.get(PROBE_IMPLEMENTATION) is not _probe_attention:
        AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(PROBE_TOKENS) * 7 + 3) % vocab  # a few distinct tokens
    ids = ids[None].to(input_device(model))  # [1, PROBE_TOKENS]
    # HF's generate hands position_ids to every forward that takes them, counted from 0 (Roberta's
    # embeddings would count from their padding index without them): the reference does the same
    pos = {"position_ids": torch.arange(PROBE_TOKENS, device=ids.device)[None]} if _takes_positions(model) else {}
    try:
        reference = model(input_ids=ids, use_cache=False, **pos).logits.float()
    except Exception as e:  # a forward that cannot run on plain input_ids at all
        raise ValueError(f"hf_plookup cannot run {_arch(model)}: its own forward on {PROBE_TOKENS} tokens failed "
                         f"({type(e).__name__}: {e})") from e
    rec = _Recording()
    token = _RECORDING.set(rec)
    try:
        with engine_attention(model, PROBE_IMPLEMENTATION):
            probed = model(input_ids=ids, attention_mask=None, use_cache=False, **pos).logits.float()
    except Exception as e:  # e.g. an attention path that needs the mask transformers builds
        raise _failed_probe(model, rec, e) from (None if not rec.layouts and not rec.anonymous_calls else e)
    finally:
        _RECORDING.reset(token)
    mixers = mixer_modules(model)  # recurrent mixers: their layers keep a state, not keys
    n = _checked_layers(model, rec, mixers)
    tol = atol if reference.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32 else 5e-2
    scale = max(float(reference.abs().max()), 1.0)
    floor: _Floor | None = None  # measured once a quantized model's outputs differ beyond tol
    diff = float((reference - probed).abs().max())
    if not diff <= tol * scale:  # the probe's outputs are not the model's own
        floor = _floor_of(model, ids, pos, reference)
        if floor is None or not floor.covers(diff):
            raise _refusal(model, ids, pos, probed, diff, tol * scale, floor)
    _check_continuation(model, ids, pos, reference, mixers, tol * scale, floor, diff, notes)
    return [rec.layouts.get(i) for i in range(n)]


def _check_continuation(model, ids, pos, reference, mixers, limit: float, floor, diff: float,
                        notes: list[str] | None) -> None:
    """The probe's third forward: the tokens fed as the engine feeds them must give the model's own
    outputs within `limit`, or within the quantized arithmetic's floor (measured here if the whole
    forward did not need it already); a model accepted on the floor gets its warning and note."""
    # recurrent mixers compute a prompt chunk (a chunked scan) and single tokens (a recurrence step)
    # differently, so HF's own generate rounds differently from one whole forward: the pieces are
    # compared with HF fed the same pieces through its own cache
    cont = _continuation_diff(model, ids, _cached_reference(model, ids, pos) if mixers else reference, mixers)
    if not cont <= limit:
        floor = floor or _floor_of(model, ids, pos, reference)
        if floor is None or not floor.covers(cont):
            raise ValueError(f"hf_plookup cannot run {_arch(model)}: fed the way the engine feeds later tokens (their "
                             "position_ids and the earlier tokens' keys, no cache object), its outputs change (max "
                             f"logit difference {cont:.3g}"
                             + ("" if floor is None else f", {floor.beyond()}, so not its quantized kernels' rounding")
                             + "): it takes positions or state from somewhere else, such as its own cache's length")
    if floor is not None:  # accepted on the floor: the quantized kernels' arithmetic, not the model's semantics
        note = floor.note(model, max(diff, cont))
        logger.warning(f"hf_plookup: {note}")
        if notes is not None:
            notes.append(note)


@dataclass(slots=True)
class _Floor:
    """How far a quantized model's own forward moves its logits between calls that compute the
    same thing (`_arithmetic_floor`), and what the engine's differences are judged against."""

    value: float  # the largest max-logit difference of the model's own forward
    cause: str  # "rows" (fed in calls of other row counts) or "rounding" (its input moved by one ulp)
    quantizer: str  # what quantized it (HF's quant_method, or the quantized weights' type)

    def covers(self, diff: float) -> bool:
        """Whether `diff` (beyond the tolerance) is the quantized arithmetic: within FLOOR_MARGIN
        times how far the model's own forward varies. That variation may itself be within the
        tolerance (a bf16 model's one-ulp draws are a spread whose largest can still fall below
        what the engine's other kernels move), and a semantic difference is of the logits' own
        size either way.

        Example: a floor of 1.09 under a tolerance of 1.25 covers 1.84 and not 3.3."""
        return diff <= FLOOR_MARGIN * self.value

    def _varies(self) -> str:
        if self.cause == "rows":
            return ("its own forward, fed the same tokens in calls of other row counts through its own cache, changes "
                    f"its logits by up to {self.value:.3g}")
        return f"its own forward changes its logits by up to {self.value:.3g} when its input moves by one ulp"

    def beyond(self) -> str:
        """Why a difference above the floor is not the quantized arithmetic (for a refusal)."""
        return f"more than {FLOOR_MARGIN:g} times what its {self.quantizer} quantization explains ({self._varies()})"

    def note(self, model: torch.nn.Module, diff: float) -> str:
        """The warning and `SpecStats.exactness_note` of a model accepted on the floor."""
        how = ("its quantized kernels round a row differently with another row count" if self.cause == "rows" else
               "its quantized layers magnify one-ulp differences, such as the engine's attention rounding apart "
               "from its own kernel's")
        return (f"{_arch(model)} ({self.quantizer} quantization) runs with logits up to {diff:.3g} apart from its "
                f"own forward's, as {self._varies()}: {how}. Greedy output may part from HF's greedy after a "
                "near-tie (two tokens' logits closer than that); sampling draws from logits that differ as much")


# packages whose tensor subclasses or modules hold quantized weights (their top-level names)
QUANTIZER_PACKAGES = frozenset({"torchao", "optimum", "bitsandbytes", "hqq", "awq", "auto_gptq", "gptqmodel",
                                "compressed_tensors", "fbgemm_gpu"})


def _quantizer(model: torch.nn.Module) -> str | None:
    """What quantized the model's weights, None where they are plain float tensors: HF's quantizer
    (`from_pretrained(..., quantization_config=...)`: its quant_method), else the type of the
    first weight that is an integer tensor or comes from a quantization package (torchao's
    `quantize_` tensor subclasses, quanto's QLinear, bitsandbytes' Int8Params / Params4bit); the
    package's own packed weights (cpu.packed_weight) are no quantization."""
    if getattr(model, "hf_quantizer", None) is not None:
        config = getattr(model.config, "quantization_config", None)
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        return str(getattr(method, "value", method) or type(model.hf_quantizer).__name__)
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor):
            continue
        if (not w.is_floating_point() or type(w).__module__.split(".")[0] in QUANTIZER_PACKAGES
                or type(module).__module__.split(".")[0] in QUANTIZER_PACKAGES):
            return type(w).__name__ if type(w) not in (torch.Tensor, torch.nn.Parameter) else type(module).__name__
    return None


def _floor_of(model: torch.nn.Module, ids: torch.Tensor, pos: dict, reference: torch.Tensor) -> _Floor | None:
    """The floor of a quantized model (`_arithmetic_floor`); None for any other: its differences
    are judged against the tolerance alone, as before."""
    quantizer = _quantizer(model)
    if quantizer is None:
        return None
    value, cause = _arithmetic_floor(model, ids, pos, reference)
    return _Floor(value, cause, quantizer)


def _arithmetic_floor(model: torch.nn.Module, ids: torch.Tensor, pos: dict,
                      reference: torch.Tensor) -> tuple[float, str]:
    """How far the model's own forward, under its own attention, moves its logits from
    `reference` (one call of the probe tokens) between calls that compute the same thing: the
    tokens fed in the continuation's pieces and one token per call through its own cache (as HF's
    generate feeds them), and calls with its embeddings' outputs moved by one ulp, the size of the
    differences another attention kernel's rounding makes: every other element, the odd ones or the
    even ones, up or down. One such move is one draw of a spread with a long tail (a bf16 model's
    four can differ several times over: docs/measurements/cpu-xeon-2026-11-30-q4-avx512/NOTES.md),
    so the largest of the four is taken. Returns the
    largest and "rows" or "rounding", whichever gave it."""
    one_per_call = tuple((i, i + 1) for i in range(PROBE_TOKENS))
    rows = max(float((reference - _cached_reference(model, ids, pos, pieces)).abs().max())
               for pieces in (_pieces(), one_per_call))
    rounding = 0.0
    for parity in (1, 0):
        for toward in (float("inf"), float("-inf")):
            def nudge(module, args, out, parity=parity, toward=toward):  # every other element one ulp
                if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                    return None
                moved = torch.nextafter(out, torch.tensor(toward, device=out.device, dtype=out.dtype).expand_as(out))
                picked = (torch.arange(out.numel(), device=out.device) % 2 == parity).view(out.shape)
                return torch.where(picked, moved, out)

            handle = model.get_input_embeddings().register_forward_hook(nudge)
            try:
                nudged = model(input_ids=ids, use_cache=False, **pos).logits.float()
                rounding = max(rounding, float((reference - nudged).abs().max()))
            except Exception:  # noqa: BLE001 - a model the nudge cannot run on: the row counts stand
                pass
            finally:
                handle.remove()
    return (rows, "rows") if rows >= rounding else (rounding, "rounding")


def _failed_probe(model: torch.nn.Module, rec: _Recording, error: Exception) -> ValueError:
    """The refusal when the recording forward raised `error`."""
    if not rec.layouts and not rec.anonymous_calls:
        # it failed before any layer called the attention function: its attention does not go
        # through AttentionInterface (Falcon computes scores itself and then adds a mask that is
        # None here); the error it raised says nothing useful
        return ValueError(f"hf_plookup cannot run {_arch(model)}: its attention layers compute attention "
                          "themselves instead of calling a function through transformers' AttentionInterface "
                          "(a probe forward failed before any layer called one), so the paged KV cache cannot "
                          "be plugged in")
    return ValueError(f"hf_plookup cannot run {_arch(model)}: a probe forward with attention through "
                      f"AttentionInterface and no mask failed ({type(error).__name__}: {error})")


def _checked_layers(model: torch.nn.Module, rec: _Recording, mixers) -> int:
    """The number of decoder layers, once every layer is seen to call the attention function with
    an integer `layer_idx`, keep a recurrent state or mix no tokens; else the refusal."""
    if not rec.layouts and not mixers:
        raise ValueError(f"hf_plookup cannot run {_arch(model)}: none of its layers calls an attention function "
                         "through transformers' AttentionInterface or keeps a recurrent state in HF's cache (a "
                         "model-specific attention path), so the paged KV cache cannot be plugged in")
    if rec.anonymous_calls:
        raise ValueError(f"hf_plookup cannot run {_arch(model)}: some attention modules have no integer `layer_idx`, "
                         "so their keys cannot be given pages")
    n = _num_layers(model)
    n = n if n is not None else max([*rec.layouts, *mixers]) + 1
    missing = sorted(set(range(n)) - set(rec.layouts) - set(mixers) - no_mixer_layers(model))
    if missing or not set(rec.layouts) <= set(range(n)):
        raise ValueError(f"hf_plookup cannot run {_arch(model)}: layers {missing or sorted(rec.layouts)} do not call "
                         "an attention function and keep no recurrent state through HF's cache API")
    return n


def _refusal(model: torch.nn.Module, ids: torch.Tensor, pos: dict, probed: torch.Tensor, diff: float,
             tol: float, floor: _Floor | None = None) -> ValueError:
    """Why the probe's outputs differ from the model's own (max logit difference `diff` above
    `tol`, and beyond a quantized model's `floor`), as best known: attention both ways, a
    configured kernel other than eager that the paged attention does not match, or attention the
    paged cache does not reproduce."""
    beyond = "" if floor is None else f", {floor.beyond()}"
    if any(getattr(m, "is_causal", None) is False for m in model.modules()):
        return ValueError(f"hf_plookup cannot run {_arch(model)}: its attention layers attend both ways "
                          "(is_causal=False), not only to earlier tokens as a generating model does; a BERT-style "
                          "model generates as a decoder with is_decoder=True in its config")
    own = model.config._attn_implementation
    if isinstance(own, str) and own != "eager":
        # its configured kernel may be what differs: transformers before 5.2x ran Gemma 2 on sdpa by
        # default, which drops the attention softcap that the paged attention (and eager) applies
        try:
            with engine_attention(model, "eager"):
                eager = model(input_ids=ids, use_cache=False, **pos).logits.float()
        except Exception:  # noqa: BLE001 - a model without an eager path: the message below stands
            eager = None
        if eager is not None and float((eager - probed).abs().max()) <= tol:
            return ValueError(f"hf_plookup cannot run {_arch(model)} with attn_implementation={own!r}: its "
                              f"outputs differ from its eager attention's (max logit difference {diff:.3g}{beyond}), whose "
                              "arithmetic the paged cache reproduces; load the model with attn_implementation='eager'")
    return ValueError(f"hf_plookup cannot run {_arch(model)}: its outputs change when its attention runs through "
                      f"AttentionInterface (max logit difference {diff:.3g}{beyond}); it attends in a way the paged cache "
                      "does not reproduce (e.g. keys shared across layers)")


def _pieces() -> tuple[tuple[int, int], ...]:
    """How the continuation check cuts the probe tokens: a prompt chunk, then one token at a time."""
    split = PROBE_TOKENS - 2
    return (0, split), (split, split + 1), (split + 1, PROBE_TOKENS)


def _cached_reference(model: torch.nn.Module, ids: torch.Tensor, pos: dict,
                      pieces: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """The logits HF's generate computes for the probe tokens fed in `pieces` (default
    `_pieces()`) through its own cache; the whole-input forward's where the model cannot be fed so."""
    params = inspect.signature(model.forward).parameters
    name = next((n for n in ("cache", "past_key_values", "cache_params") if n in params), None)
    parts = []
    try:
        cache = DynamicCache(config=model.config)
        for lo, hi in pieces or _pieces():
            extra = {"position_ids": pos["position_ids"][:, lo:hi]} if pos else {}
            parts.append(model(input_ids=ids[:, lo:hi], **{name: cache}, use_cache=True, **extra).logits.float())
    except Exception:
        return model(input_ids=ids, use_cache=False, **pos).logits.float()
    return torch.cat(parts, 1)


def _continuation_diff(model: torch.nn.Module, ids: torch.Tensor, reference: torch.Tensor,
                       mixers: dict[int, torch.nn.Module]) -> float:
    """The probe tokens fed as the engine feeds them, a prompt chunk then later tokens: each call
    with `position_ids`, no mask and no cache object, attention over the keys recorded so far,
    recurrent mixers resuming their states (mixers.recurrent). Returns the largest logit
    difference from the whole-input forward."""
    rec = _Recording(kv={})
    token = _RECORDING.set(rec)
    embedders = position_embedders(model)  # models counting positions from their cache (attention.positions)
    recurrent = RecurrentMixers(model, mixers)
    parts = []
    try:
        with engine_attention(model, PROBE_IMPLEMENTATION):
            for lo, hi in _pieces():
                pos = torch.arange(lo, hi, device=ids.device)
                rows = StepRows(np.zeros(1, np.int64), np.array([lo]), np.array([hi - lo]), np.array([0, hi - lo]),
                                np.array([lo == 0]))
                with given_positions(embedders, pos), recurrent.active(rows):
                    parts.append(model(input_ids=ids[:, lo:hi], position_ids=pos[None], attention_mask=None,
                                       use_cache=False).logits.float())
    except Exception:  # a model that cannot be fed in pieces this way
        return float("inf")
    finally:
        _RECORDING.reset(token)
        recurrent.states.clear()
    return float((reference - torch.cat(parts, 1)).abs().max())
