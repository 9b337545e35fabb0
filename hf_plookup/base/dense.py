"""Dense attention over keys already in `[B, H_kv, L, D]` form: the one place that chooses between
SDPA and the explicit form (SDPA has no softcap and no sink argument)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softcapped_attention(q, k, v, mask, scaling: float, softcap: float | None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain attention (q [B, H, Tq, D], k/v [B, H_kv, Lk, D], mask broadcastable to
    [B, H, Tq, Lk], True = attend) with tanh logit soft-capping when `softcap` is given, and
    attention sinks when `sinks` [H] is: one more logit per head in the softmax's denominator
    that no value goes with (gpt-oss), so a query may attend to nothing much."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.float(), sink], -1), dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None, is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Tq, D] over k/v [B, H_kv, Lk, D] -> [B, H, Tq, Dv]. `mask`: boolean (True = attend),
    or None for none (`is_causal`: the queries are the last Tq of the Lk keys, each seeing those
    before it). With `softcap` or `sinks` [H], the explicit form; otherwise SDPA (GQA without
    copying keys)."""
    if softcap or sinks is not None:
        if mask is None:
            n, L = q.shape[2], k.shape[2]
            mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
        return softcapped_attention(q, k, v, mask, scale, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
