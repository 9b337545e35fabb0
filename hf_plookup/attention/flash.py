"""flash-attn backend: write K/V into the pages, then flash-attn's paged kernels read them.

- uniform steps (every sequence feeds the same number of tokens: verify steps, padded drafts,
  plain decode): `flash_attn_with_kvcache` on `q [B, Tq, H, D]` with `cache_seqlens` and
  `block_table`; capturable in CUDA graphs (no host-side lengths).
- packed steps (prefill chunks, unpadded drafts): `flash_attn_varlen_func` with
  `cu_seqlens_q`, `cu_seqlens_k` (cumulative context lengths) and `block_table`.

Both align the causal mask to the bottom right (query i of a sequence with `Lq` queries and
`Lk` keys sees keys up to `Lk - Lq + i`), which is where our queries sit: the last `Lq`
positions of their context. flash-attn's window `(left, right)` lets query position p see keys
in `[p - left, p + right]`; HF's `sliding_window = w` lets it see the `w` keys `> p - w`, so
`left = w - 1`. FA2's paged kernels need `block_size % 256 == 0` and fp16/bf16 tensors.

`flash_attn` is imported when a step runs, never at module import.
"""

from __future__ import annotations

import importlib.util

import torch

from .metadata import AttentionMetadata
from .sdpa import write_and_pack

FLASH_BLOCK_MULTIPLE = 256  # FA2: "Paged KV cache block size must be divisible by 256"
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_unavailable_reason(devices: list[torch.device], dtypes: list[torch.dtype]) -> str | None:
    """Why the flash backend cannot run on these devices and dtypes; None when it can."""
    if importlib.util.find_spec("flash_attn") is None:
        return "the `flash_attn` package is not installed (pip install flash-attn)"
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # a wheel built for another torch/CUDA fails here
        return f"`import flash_attn` failed ({type(e).__name__}: {e})"
    bad = sorted({str(d) for d in devices if d.type != "cuda"})
    if bad:
        return f"flash-attn runs on CUDA only, the model is on {', '.join(bad)}"
    bad_dt = sorted({str(t) for t in dtypes if t not in FLASH_DTYPES})
    if bad_dt:
        return f"flash-attn needs float16 or bfloat16 weights, the model is {', '.join(bad_dt)}"
    return None


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """HF's `sliding_window` (a query sees that many keys, itself included) as flash-attn's (left, right)."""
    return (sliding_window - 1, 0) if sliding_window else (-1, -1)


def flash_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D] after RoPE
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    meta: AttentionMetadata,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Returns `[1, T, H, D]`."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    q, k_cache, v_cache = write_and_pack(meta, module.layer_idx, query, key, value)  # q [T, H, D]
    h, t, d = query.shape[1], query.shape[2], query.shape[3]
    kw = dict(
        softmax_scale=scaling if scaling is not None else d**-0.5,
        causal=True,
        window_size=window_size(sliding_window),
        softcap=float(softcap) if softcap else 0.0,
        block_table=meta.block_tables,
    )
    if meta.uniform:
        q = q.reshape(meta.num_seqs, meta.max_query_len, h, d)  # [B, Tq, H, D]
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=meta.cache_seqlens, **kw)
    else:
        out = flash_attn_varlen_func(
            q.contiguous(), k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
            meta.max_query_len, meta.max_context_len, **kw,
        )  # [T, H, D]
    return out.reshape(1, t, h, d).to(query.dtype)
