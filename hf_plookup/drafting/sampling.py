"""Logits processing per verified position: HF's own `LogitsProcessorList` (penalties, bans,
length rules, warpers) applied to each position with the context it would have had in HF's
loop, i.e. the row as HF lays it out (input row as given + generated tokens) plus drafts[:j]."""

from __future__ import annotations

import copy

import numpy as np
import torch
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# processors whose output depends on the scores alone, never on the tokens before them: a
# candidate tree's nodes (whose histories differ by branch) can be processed with them
HISTORY_FREE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                EpsilonLogitsWarper, EtaLogitsWarper)


def history_free(processors: LogitsProcessorList | None) -> bool:
    """True when no processor looks at the tokens (none given, or only HF's warpers)."""
    return all(type(p) in HISTORY_FREE for p in processors or ())

# processor attributes that hold one entry per batch row (HF's repetition penalty keeps each
# row's padding length there); they are sliced to the rows of each call
_PER_ROW_ATTRS = ("prompt_ignore_length",)


# HF's logits processors whose one effect is to set some tokens' scores to -inf, which tokens
# depending on the row's length alone, never on the scores: under them a greedy token is the argmax
# of the logits with those tokens taken out (engine.batch.Batch.argmax_request)
BAN_ONLY = ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "SuppressTokensLogitsProcessor",
            "SuppressTokensAtBeginLogitsProcessor")


def bans_only(processors: LogitsProcessorList) -> bool:
    """Whether every processor is one of HF's `BAN_ONLY` ones (`min_length`, `min_new_tokens`,
    `suppress_tokens`, `begin_suppress_tokens`)."""
    return all(type(p).__name__ in BAN_ONLY and type(p).__module__.startswith("transformers.") for p in processors)


def _for_rows(processors: LogitsProcessorList, rows: np.ndarray, batch: int) -> LogitsProcessorList:
    """The processors as they apply to batch rows `rows` ([n] int64)."""
    out = LogitsProcessorList()
    for proc in processors:
        for attr in _PER_ROW_ATTRS:
            value = getattr(proc, attr, None)
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == batch:
                proc = copy.copy(proc)
                setattr(proc, attr, value[torch.from_numpy(rows).to(value.device)])
        ngrams = getattr(proc, "generated_ngrams", None)
        if isinstance(ngrams, list) and len(ngrams) == batch and getattr(proc, "batch_size", None) == batch:
            # HF's encoder n-gram ban keeps each input row's n-grams and maps a scored row to its
            # input row as row // (rows scored / batch): give it one entry per scored row
            proc = copy.copy(proc)
            proc.generated_ngrams, proc.batch_size = [ngrams[r] for r in rows], len(rows)
        out.append(proc)
    return out


def rows_by_length(hf_rows: np.ndarray, rows: np.ndarray, lengths: np.ndarray, device):
    """Group positions by context length: yields (idx [n] positions, ids [n, length] tokens of
    their rows, sel [n] the same indices as a tensor on `device`). HF processors and stopping
    criteria need a rectangular `input_ids`, so the work is one call per distinct length."""
    for length in np.unique(lengths):
        idx = np.flatnonzero(lengths == length)
        ids = torch.from_numpy(hf_rows[rows[idx], :length]).to(device)
        yield idx, ids, torch.from_numpy(idx).to(device)


def process_scores(
    processors: LogitsProcessorList,
    logits: torch.Tensor,  # [N, V] raw logits of the verified positions
    rows: np.ndarray,  # [N] int64 row of `hf_rows` each position belongs to
    lengths: np.ndarray,  # [N] int64 context length of each position
    hf_rows: np.ndarray,  # [B, L] int64 token rows in HF's layout
) -> torch.Tensor:
    """Processed scores `[N, V]` in fp32. Positions with equal context length are processed in
    one call (HF processors need a rectangular `input_ids`), so the work is one call per distinct
    length, not per token."""
    scores = logits.float()
    if not processors:
        return scores
    out = torch.empty_like(scores)
    for idx, ids, sel in rows_by_length(hf_rows, rows, lengths, logits.device):
        out[sel] = _for_rows(processors, rows[idx], hf_rows.shape[0])(ids, scores[sel].clone())
    return out
