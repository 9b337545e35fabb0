"""The "hf_plookup" attention implementation: registration and the switch around engine forwards."""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os

import torch
from transformers import AttentionInterface

from .flash import (
    FLASH4_BLOCK_SIZE,
    FLASH_BLOCK_MULTIPLE,
    flash4_paged_attention,
    flash4_unavailable_reason,
    flash_paged_attention,
    flash_unavailable_reason,
)
from .metadata import current_metadata
from .ops import compiled_paged_attention
from .sdpa import sdpa_paged_attention

ATTN_IMPLEMENTATION = "hf_plookup"


def triton_paged_attention(*args, **kwargs):
    """The Triton backend, imported on first use (CPU installs need not have triton)."""
    from .triton import triton_paged_attention as fn

    return fn(*args, **kwargs)


BACKENDS = {"sdpa": sdpa_paged_attention, "flash_attn": flash_paged_attention, "triton": triton_paged_attention,
            "flash_attn4": flash4_paged_attention}
BACKEND_CHOICES = ("auto", *BACKENDS)  # what `attn_backend` accepts
# backends whose attention takes a candidate tree's mask (AttentionMetadata.tree_mask)
TREE_BACKENDS = ("sdpa", "triton")

DEFAULT_BLOCK_SIZE = {"sdpa": 16, "flash_attn": FLASH_BLOCK_MULTIPLE, "triton": 16, "flash_attn4": FLASH4_BLOCK_SIZE}


def triton_unavailable_reason(devices: list[torch.device]) -> str | None:
    """Why the Triton backend cannot run on these devices; None when it can (CUDA, or any device
    under the Triton interpreter, TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return "the `triton` package is not installed"
    if os.environ.get("TRITON_INTERPRET") != "1":
        bad = sorted({str(d) for d in devices if d.type != "cuda"})
        if bad:
            return f"Triton kernels run on CUDA (or under TRITON_INTERPRET=1), the model is on {', '.join(bad)}"
    return None


def resolve_backend(requested: str, devices: list[torch.device], dtypes: list[torch.dtype],
                    sdpa_only: str | None = None) -> str:
    """The backend that will run: "auto" is flash_attn when it can run here (flash_attn imports,
    CUDA, fp16/bf16), else sdpa (flash_attn4 and triton are chosen by name). `sdpa_only`: why
    only sdpa can run this model (values of another head size than the keys, as in multi-head
    latent attention; attention sinks), else None. Asking for a backend where it cannot run is a
    ValueError."""
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"attn_backend must be one of {BACKEND_CHOICES}, got {requested!r}")
    if requested == "sdpa" or (requested == "auto" and sdpa_only):
        return "sdpa"
    if sdpa_only:
        raise ValueError(f"attn_backend={requested!r} cannot run this model: {sdpa_only}; "
                         "use attn_backend='sdpa' or 'auto'")
    if requested == "triton":
        reason = triton_unavailable_reason(devices)
        if reason is not None:
            raise ValueError(f"attn_backend='triton' cannot run: {reason}; use attn_backend='sdpa' or 'auto'")
        return "triton"
    if requested == "flash_attn4":
        reason = flash4_unavailable_reason(devices, dtypes)
        if reason is not None:
            raise ValueError(f"attn_backend='flash_attn4' cannot run: {reason}; use attn_backend='sdpa' or 'auto'")
        return "flash_attn4"
    reason = flash_unavailable_reason(devices, dtypes)
    if requested == "flash_attn" and reason is not None:
        raise ValueError(f"attn_backend='flash_attn' cannot run: {reason}; use attn_backend='sdpa' or 'auto'")
    return "flash_attn" if reason is None else "sdpa"


def resolve_block_size(backend: str, block_size: int | None) -> int:
    """`block_size` for `backend`: its default when None; flash_attn's paged kernels need multiples of 256."""
    if block_size is None:
        return DEFAULT_BLOCK_SIZE[backend]
    if backend == "triton" and (block_size < 2 or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two >= 2 with attn_backend 'triton', got {block_size}")
    if backend == "flash_attn" and block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"block_size must be a multiple of {FLASH_BLOCK_MULTIPLE} with attn_backend 'flash_attn' "
            f"(flash-attn's paged kernels), got {block_size}"
        )
    return block_size


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: torch.Tensor | None,  # always None: HF builds no mask for this implementation
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Entry point called by the HF model's attention modules during an engine forward. `s_aux`
    in `kwargs`: gpt-oss's attention sinks [H], taken by the sdpa backend only (resolve_backend)."""
    meta = current_metadata()
    record = None if torch.compiler.is_compiling() else _RECORD.get()  # (dynamo cannot trace ContextVar.get)
    if record is not None:
        record[getattr(module, "layer_idx", None)] = {"scale": scaling, "window": sliding_window or None, "softcap": softcap,
                                    "sinks": kwargs.get("s_aux") is not None}
    fn = compiled_paged_attention if torch.compiler.is_compiling() else BACKENDS[meta.backend]
    sinks = kwargs.get("s_aux")
    extra = {"sinks": sinks} if sinks is not None else {}
    out = fn(
        module, query, key, value, meta, scaling=scaling, sliding_window=sliding_window, softcap=softcap, **extra
    )
    return out, None


_RECORD: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hf_plookup_record_attention", default=None)


@contextlib.contextmanager
def record_attention():
    """Record, for the forwards run inside, the arguments each attention module passes:
    {layer_idx: {"scale", "window", "softcap", "sinks"}} (steps.c_layers runs layers from them)."""
    record: dict[int, dict] = {}
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def register() -> None:
    """Register the implementation with transformers (idempotent; done by `wrap`, not at import)."""
    if AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is not paged_attention_forward:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@contextlib.contextmanager
def engine_attention(model: torch.nn.Module, name: str = ATTN_IMPLEMENTATION):
    """Switch `model` to the attention implementation `name` (the hf_plookup one by default) for
    one forward; always restore the previous one."""
    config = model.config
    previous = {"": config._attn_implementation}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            previous[key] = sub._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
