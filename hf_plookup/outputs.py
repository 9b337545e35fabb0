"""What `generate` returns, laid out as HF lays it out: `sequences` (input rows as given, then
the new tokens, shorter rows padded), and with `return_dict_in_generate` the per-step `scores`
and `logits` (rows that finished earlier included, as HF computes them on pad tokens) and
`past_key_values` (`cache` from transformers 5.24 on: a `DynamicCache` built from the engine's
pages)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import numpy as np
import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .drafting.sampling import process_scores
from .stats import SpecStats


# transformers 5.24 renamed `generate`'s `past_key_values` (argument and output field) to `cache`
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"


@dataclass
class PlookupGenerateOutput(GenerateDecoderOnlyOutput):
    """HF's decoder-only output plus the call's `SpecStats`."""

    stats: SpecStats | None = None


def layout(input_ids: torch.Tensor, new_tokens, pad_token_id: int | None) -> torch.Tensor:
    """HF's `sequences` [B, W + T]: input rows as given, then generated tokens, shorter rows
    padded with `pad_token_id`."""
    b = input_ids.shape[0]
    width = max(len(t) for t in new_tokens)
    if pad_token_id is None and any(len(t) != width for t in new_tokens):
        raise RuntimeError("rows finished at different lengths but there is no pad_token_id")
    out = torch.full((b, width), pad_token_id if pad_token_id is not None else 0, dtype=input_ids.dtype)
    for i, t in enumerate(new_tokens):
        out[i, : len(t)] = torch.from_numpy(t).to(input_ids.dtype)
    return torch.cat([input_ids, out.to(input_ids.device)], dim=1)


def tail_logits(
    model: torch.nn.Module,
    sequences: torch.Tensor,  # [B, W + T] HF's output rows
    attention_mask: torch.Tensor,  # [B, W] the call's input mask
    steps: list[int],  # per row, how many steps it generated (n_b <= T)
    exclusive=contextlib.nullcontext,  # context that holds the model (no engine loop running)
) -> dict[int, torch.Tensor]:
    """HF's logits of the steps after a row finished ({row: [T - n_b, V]}, rows with n_b < T):
    HF keeps feeding such a row pad tokens until the batch ends and records what the model
    says about them. One dense forward of those rows over `sequences[:, :-1]` (pads attended,
    left padding masked, positions from the mask as HF makes them) gives the same numbers."""
    width, total = attention_mask.shape[1], sequences.shape[1] - attention_mask.shape[1]
    rows = [b for b, n in enumerate(steps) if n < total]
    if not rows:
        return {}
    idx = torch.tensor(rows, device=sequences.device)
    ids = sequences[idx, :-1]  # [R, W + T - 1]
    mask = torch.cat([attention_mask[idx], attention_mask.new_ones(len(rows), total - 1)], dim=1)
    pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    first = width + min(steps[b] for b in rows) - 1  # the first column whose logits are needed
    with exclusive(), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                       logits_to_keep=ids.shape[1] - first).logits  # [R, W + T - 1 - first, V]
    # step t is predicted at column W + t - 1
    return {b: logits[i, width + steps[b] - 1 - first :].float() for i, b in enumerate(rows)}


def per_step(
    per_row: list[list[torch.Tensor]],  # per row, [V] per step it generated
    tails: dict[int, torch.Tensor],  # per row that finished early, [T - n_b, V] of the steps after
    device,
) -> tuple[torch.Tensor, ...]:
    """HF's tuple over steps of [B, V]."""
    rows = [torch.cat([torch.stack(r), tails[b].to(r[0].device)]) if b in tails else torch.stack(r)
            for b, r in enumerate(per_row)]
    return tuple(torch.stack(rows, dim=1).to(device).unbind(0))


def tail_scores(processors, tails: dict[int, torch.Tensor], sequences: torch.Tensor, width: int,
                steps: list[int]) -> dict[int, torch.Tensor]:
    """The processed scores of the tail logits (HF's processors with each row's history)."""
    if not tails or not processors:
        return {b: t.clone() for b, t in tails.items()}
    rows = np.concatenate([np.full(len(t), b) for b, t in tails.items()])
    lengths = np.concatenate([width + steps[b] + np.arange(len(t)) for b, t in tails.items()])
    logits = torch.cat(list(tails.values()))
    scores = process_scores(processors, logits, rows, lengths, sequences.cpu().numpy())
    out, at = {}, 0
    for b, t in tails.items():
        out[b], at = scores[at : at + len(t)], at + len(t)
    return out


def kv_cache(
    config,
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]],  # per row, per layer (K, V) [H_kv, n_b, D] from the pages
    attention_mask: torch.Tensor,  # [B, W] the call's input mask
    steps: list[int],  # per row, tokens generated
    length: int,  # HF's cache length: W + T - 1
) -> DynamicCache:
    """HF's `past_key_values`: every token but the last, [B, H_kv, W + T - 1, D] per layer
    (sliding-window layers keep their window, as HF's `DynamicCache` does). A row's keys and
    values sit at its token columns (attended prompt columns, then its generated ones); columns
    HF fills with the KV of pad tokens (left padding, the steps after an early-finished row's
    end, which HF feeds pads) hold zeros."""
    mask = attention_mask.bool().cpu()
    width = mask.shape[1]
    layers = []
    for li, (k0, v0) in enumerate(kv[0]):
        h, d = k0.shape[0], k0.shape[-1]
        k = k0.new_zeros(len(kv), h, length, d)
        v = v0.new_zeros(len(kv), h, length, v0.shape[-1])
        for b, row in enumerate(kv):
            cols = torch.cat([torch.nonzero(mask[b]).view(-1), width + torch.arange(steps[b])])
            n = min(row[li][0].shape[1], int(mask[b].sum()) + steps[b] - 1)
            cols = cols[:n].to(k.device)
            k[b, :, cols] = row[li][0][:, :n]
            v[b, :, cols] = row[li][1][:, :n]
        layers.append((k, v))
    return DynamicCache(ddp_cache_data=layers, config=config.get_text_config(decoder=True))


def refill(cache: DynamicCache, new: DynamicCache) -> DynamicCache:
    """Make the caller's cache hold `new`'s content, in place (HF extends the cache it was given)."""
    cache.layers = new.layers
    return cache


def assemble(model, request, result, stats: SpecStats, exclusive=contextlib.nullcontext):
    """`generate`'s return value for an engine call: `sequences`, or with
    `return_dict_in_generate` a `PlookupGenerateOutput`."""
    sequences = layout(request.input_ids, result.new_tokens, request.pad_token_id)
    user_cache = request.past_key_values
    if not request.return_dict and user_cache is None:
        return sequences
    steps = [len(t) for t in result.new_tokens]
    width = request.input_ids.shape[1]
    mask = request.attention_mask
    cache = None
    if result.kv is not None:
        cache = kv_cache(model.config, result.kv, mask, steps, sequences.shape[1] - 1)
        if user_cache is not None:
            cache = refill(user_cache, cache)
    if not request.return_dict:
        return sequences
    scores = logits = None
    if result.scores is not None or result.logits is not None:
        tails = tail_logits(model, sequences, mask, steps, exclusive)
        if result.logits is not None:
            logits = per_step(result.logits, tails, sequences.device)
        if result.scores is not None:
            scores = per_step(result.scores, tail_scores(request.decode.processors, tails, sequences, width, steps),
                              sequences.device)
    return PlookupGenerateOutput(sequences=sequences, scores=scores, logits=logits, stats=stats, **{CACHE_FIELD: cache})
