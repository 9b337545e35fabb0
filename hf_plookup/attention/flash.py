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

FlashAttention-4 (`flash_attn4`; the `flash-attn-4` wheel with `nvidia-cutlass-dsl`, package
`flash_attn.cute`): one call, `flash_attn_varlen_func` with `page_table` (our block tables) and
`seqused_k` (keys per sequence; FA4 takes no `cu_seqlens_k` with a page table): `q [B, Tq, H, D]`
for uniform steps, packed `q [T, H, D]` with `cu_seqlens_q` otherwise. Its paged kernels run on
Hopper and Blackwell (compute capability 9.x and 10.x) and take any page size; a page of 128
tokens (its key tile for head sizes up to 128) lets it load pages with TMA, hence the default.
Same mask alignment and window convention as FA2.

`flash_attn` / `flash_attn.cute` are imported when a step runs, never at module import.
"""

from __future__ import annotations

import importlib.util

import torch

from .metadata import AttentionMetadata
from .pages import write_and_pack

FLASH_BLOCK_MULTIPLE = 256  # FA2: "Paged KV cache block size must be divisible by 256"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH4_BLOCK_SIZE = 128  # FA4 on Hopper: its key tile for head size <= 128 (pages then load with TMA)
FLASH4_ARCHS = (9, 10)  # compute capability majors with FA4 paged kernels (Hopper, Blackwell datacenter)


def _device_and_dtype_reason(name: str, devices: list[torch.device], dtypes: list[torch.dtype]) -> str | None:
    bad = sorted({str(d) for d in devices if d.type != "cuda"})
    if bad:
        return f"{name} runs on CUDA only, the model is on {', '.join(bad)}"
    bad_dt = sorted({str(t) for t in dtypes if t not in FLASH_DTYPES})
    if bad_dt:
        return f"{name} needs float16 or bfloat16 weights, the model is {', '.join(bad_dt)}"
    return None


def flash_unavailable_reason(devices: list[torch.device], dtypes: list[torch.dtype]) -> str | None:
    """Why the flash backend cannot run on these devices and dtypes; None when it can."""
    if importlib.util.find_spec("flash_attn") is None:
        return "the `flash_attn` package is not installed (pip install flash-attn)"
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except Exception as e:  # a wheel built for another torch/CUDA; or FA4 alone (a bare `flash_attn.cute`)
        return f"flash-attn 2's kernels do not import ({type(e).__name__}: {e})"
    return _device_and_dtype_reason("flash-attn", devices, dtypes)


def flash4_unavailable_reason(devices: list[torch.device], dtypes: list[torch.dtype]) -> str | None:
    """Why the FlashAttention-4 backend cannot run on these devices and dtypes; None when it can."""
    try:
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no `flash_attn` package at all
        found = False
    if not found:
        return "the `flash-attn-4` package is not installed (pip install flash-attn-4 nvidia-cutlass-dsl)"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # a missing CUTLASS DSL, or a build for another CUDA
        return f"`import flash_attn.cute` failed ({type(e).__name__}: {e})"
    reason = _device_and_dtype_reason("FlashAttention-4", devices, dtypes)
    if reason is None:
        majors = sorted({torch.cuda.get_device_capability(d)[0] for d in devices})
        if any(m not in FLASH4_ARCHS for m in majors):
            reason = (f"FlashAttention-4's paged kernels run on compute capability {FLASH4_ARCHS[0]}.x-"
                      f"{FLASH4_ARCHS[-1]}.x (Hopper, Blackwell), this GPU is {majors[-1]}.x")
    return reason


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """HF's `sliding_window` (a query sees that many keys, itself included) as flash-attn's (left, right)."""
    return (sliding_window - 1, 0) if sliding_window else (-1, -1)


def _write_and_prepare(module, query, key, value, meta, scaling, sliding_window, softcap):
    """Write the step's K/V; return the queries (`[B, Tq, H, D]` for uniform steps, else packed
    `[T, H, D]`), the layer's pages and the keyword arguments FA2 and FA4 share."""
    q, k_cache, v_cache = write_and_pack(meta, module.layer_idx, query, key, value)  # q [T, H, D]
    h, d = query.shape[1], query.shape[3]
    if meta.uniform:
        q = q.reshape(meta.num_seqs, meta.max_query_len, h, d)
    kw = dict(
        softmax_scale=scaling if scaling is not None else d**-0.5,
        causal=True,
        window_size=window_size(sliding_window),
        softcap=float(softcap) if softcap else 0.0,
    )
    return q.contiguous(), k_cache, v_cache, kw


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
    """FA2 over the pages. Returns `[1, T, H, D]`."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    q, k_cache, v_cache, kw = _write_and_prepare(module, query, key, value, meta, scaling, sliding_window, softcap)
    if meta.uniform:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=meta.cache_seqlens,
                                      block_table=meta.block_tables, **kw)
    else:
        out = flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_query_len,
                                     meta.max_context_len, block_table=meta.block_tables, **kw)  # [T, H, D]
    return out.reshape(1, query.shape[2], query.shape[1], query.shape[3]).to(query.dtype)  # [1, T, H, D]


def flash4_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D] after RoPE
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    meta: AttentionMetadata,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """FlashAttention-4 over the pages (one varlen call with a page table). Returns `[1, T, H, D]`."""
    from flash_attn.cute import flash_attn_varlen_func

    q, k_cache, v_cache, kw = _write_and_prepare(module, query, key, value, meta, scaling, sliding_window, softcap)
    if not meta.uniform:
        kw.update(cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_query_len)
    out, _ = flash_attn_varlen_func(q, k_cache, v_cache, page_table=meta.block_tables, seqused_k=meta.cache_seqlens,
                                    **kw)
    return out.reshape(1, query.shape[2], query.shape[1], query.shape[3]).to(query.dtype)  # [1, T, H, D]
