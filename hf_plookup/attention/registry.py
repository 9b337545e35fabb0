"""The "hf_plookup" attention implementation: registration and the switch around engine forwards."""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

from .metadata import current_metadata
from .sdpa import sdpa_paged_attention

ATTN_IMPLEMENTATION = "hf_plookup"
BACKENDS = {"sdpa": sdpa_paged_attention}


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
    """Entry point called by the HF model's attention modules during an engine forward."""
    meta = current_metadata()
    out = BACKENDS[meta.backend](
        module, query, key, value, meta, scaling=scaling, sliding_window=sliding_window, softcap=softcap
    )
    return out, None


def register() -> None:
    """Register the implementation with transformers (idempotent; done by `wrap`, not at import)."""
    if AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is not paged_attention_forward:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, at wrap time, a model whose attention does not dispatch through AttentionInterface."""
    if not getattr(type(model), "_supports_attention_backend", False):
        arch = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise ValueError(
            f"hf_plookup cannot run {type(model).__name__} (architecture '{arch}'): its attention does not go "
            "through transformers' AttentionInterface, so the paged KV cache cannot be plugged in"
        )


@contextlib.contextmanager
def engine_attention(model: torch.nn.Module):
    """Switch `model` to the hf_plookup attention for one forward; always restore the previous one."""
    config = model.config
    previous = {"": config._attn_implementation}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            previous[name] = sub._attn_implementation
    config._attn_implementation = ATTN_IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = previous
