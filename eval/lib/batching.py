"""Token rows in and out of a batch: left padding, batches over cycled prompts, each row's
generated tokens cut at its EOS, and where two outputs part."""

from __future__ import annotations

import torch


def left_pad(rows: list[list[int]], pad_id: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], attention_mask [B, L]) with rows right-aligned (left padding):
    left_pad([[5, 6, 7], [8]], 0) gives ids [[5, 6, 7], [0, 0, 8]] and mask [[1, 1, 1], [0, 0, 1]]."""
    if not rows:
        raise ValueError("left_pad: no rows")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"left_pad: row {i} is empty")
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def batches(items: list, size: int) -> list[list]:
    """Consecutive batches of `size` (the last one shorter): batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]


def workload(prompts: list[list[int]], num_prompts: int, batch_size: int) -> list[list[list[int]]]:
    """Batches of `batch_size` over max(num_prompts, batch_size) prompts, `prompts` cycled:
    workload([[1], [2]], num_prompts=2, batch_size=4) == [[[1], [2], [1], [2]]]."""
    if not prompts:
        raise ValueError("no prompts")
    n = max(num_prompts, batch_size)
    cycled = [prompts[i % len(prompts)] for i in range(n)]
    return batches(cycled, batch_size)


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def pad_id(model, tokenizer) -> int:
    """The tokenizer's pad id, else (no tokenizer: random weights) the config's, else the smallest EOS id, else 0."""
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer is None and getattr(model.config, "pad_token_id", None) is not None:
        return int(model.config.pad_token_id)
    eos = sorted(eos_ids(model))
    return eos[0] if eos else 0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; the shorter length when one is a prefix of the
    other; None when identical: ([1, 2, 3], [1, 5, 3]) -> 1, ([1, 2], [1, 2, 3]) -> 2."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def new_tokens(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's generated tokens, up to and including its first EOS (padding dropped)."""
    out = []
    for row in sequences[:, prompt_width:].tolist():
        cut = len(row)
        for j, t in enumerate(row):
            if t in eos:
                cut = j + 1
                break
        out.append(row[:cut])
    return out
