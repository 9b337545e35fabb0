"""One request of a `generate` call: its tokens, cache state and stop state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList


@dataclass(slots=True)
class DecodeConfig:
    """How a call picks tokens and when its rows stop (resolved from HF arguments)."""

    max_new_tokens: int
    eos_token_ids: frozenset[int]
    k: int = 0  # prompt_lookup_num_tokens (0: no drafts)
    max_ngram: int = 2  # max_matching_ngram_size
    tree_nodes: int = 0  # prompt_lookup_tree_nodes: draft nodes per candidate tree (0: one chain of k)
    cross_rows: bool = False  # draft_cross_rows: the call's other rows are drafting sources (trees)
    corpus: tuple[np.ndarray, ...] | None = None  # draft_corpus as token arrays: sources for every row (trees)
    recycled: int = 0  # draft_recycled: the model's best-ranked successors drafted per token (trees)
    do_sample: bool = False
    processors: LogitsProcessorList | None = None  # HF processors and warpers, per position
    stopping: StoppingCriteriaList | None = None  # criteria beyond EOS and length
    streamer: object | None = None  # HF streamer protocol: put(tensor), end()
    output_scores: bool = False
    output_logits: bool = False
    hf_input_ids: np.ndarray | None = None  # [B, W] int64 input rows as given (processors see these)
    pad_token_id: int | None = None  # what HF writes after a row's end (stopping criteria see it)
    keep_kv: bool = False  # copy each row's keys/values out of the pages when it finishes (past_key_values)
    # the caller's past_key_values, per row: the cache columns of its first n prompt tokens [n] and
    # per cache layer (K [H_kv, W, D], V [H_kv, W, Dv]); copied into its pages instead of prefilled
    # (generation.caller_kv)
    prompt_kv: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.k < 0 or self.max_ngram < 1 or self.tree_nodes < 0:
            raise ValueError("k and tree_nodes must be >= 0 and max_ngram >= 1")
        if (self.processors or self.stopping) and self.hf_input_ids is None:
            raise ValueError("processors and stopping criteria need hf_input_ids")

    @property
    def needs_hf_rows(self) -> bool:
        return bool(self.processors) or bool(self.stopping)


@dataclass(slots=True)
class Sequence:
    """Row `row` of the batch. Its tokens live in the engine's history buffer row `row`
    (`history[row, :num_tokens]`: prompt without padding, then generated tokens)."""

    seq_id: int
    row: int
    prompt_len: int
    max_new_tokens: int
    num_tokens: int = 0  # prompt + generated so far
    num_cached: int = 0  # tokens whose K/V are in the pages
    finished: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"row {self.row}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_tokens == 0:
            self.num_tokens = self.prompt_len

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.num_generated

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prompt_len

    @property
    def max_tokens(self) -> int:
        """Most tokens this sequence can ever hold in the cache (its worst-case reservation)."""
        return self.prompt_len + self.max_new_tokens

    def append(self, history: np.ndarray, tokens, eos: frozenset[int]) -> int:
        """Append accepted tokens one by one, stopping at EOS or the length limit.
        Returns how many were appended. `history`: [B, L] int64."""
        n = 0
        for t in tokens:
            history[self.row, self.num_tokens] = t
            self.num_tokens += 1
            n += 1
            if t in eos or self.remaining <= 0:
                self.finished = True
                break
        return n
