"""drafting.memory: earlier calls' outputs as a source of candidate trees, bounded, kept per wrapped
model, changing no token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_plookup.drafting.memory import DraftMemory
from tests.conftest import tiny_model, wrap_copy


def test_memory_keeps_the_newest_rows_within_its_capacity():
    m = DraftMemory(5)
    m.add(np.array([1, 2, 3]))
    m.add(np.array([4, 5, 6]))  # the docstring's example: 6 tokens would exceed 5
    assert [d.tolist() for d in m.docs()] == [[4, 5, 6]] and len(m) == 3
    m.add(np.arange(10, 20))  # longer than the capacity: its last 5 tokens
    assert [d.tolist() for d in m.docs()] == [[15, 16, 17, 18, 19]]
    m.add(np.array([7]))  # a single token continues nothing: not kept
    assert len(m) == 5
    none = DraftMemory(0)
    none.add(np.arange(4))
    assert none.docs() == [] and len(none) == 0


def test_a_second_call_drafts_what_the_first_generated():
    """The same prompt twice: its own text holds little of its continuation, the first call's output
    holds all of it. With the memory the second call accepts far more drafts; the tokens are HF
    greedy's every time; without the memory both calls draft alike."""
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(11))
    ref = model.generate(ids, do_sample=False, max_new_tokens=32, eos_token_id=None)
    kw = dict(max_new_tokens=32, eos_token_id=None, prompt_lookup_num_tokens=6, prompt_lookup_tree_nodes=12)
    runs = {}
    for cap in (0, 4096):
        w = wrap_copy(model, max_cache_tokens=4096, draft_memory_tokens=cap)
        stats = []
        for _ in range(2):
            assert torch.equal(w.generate(ids, **kw), ref)
            stats.append(w.last_stats)
        runs[cap] = stats
        assert len(w._engine.memory) == (0 if cap == 0 else 2 * 32)
    without, with_memory = runs[0], runs[4096]
    assert without[0].tokens_per_forward == without[1].tokens_per_forward == with_memory[0].tokens_per_forward
    assert with_memory[0].memory_tokens == 0 and with_memory[1].memory_tokens == 32
    assert with_memory[1].tokens_per_forward > max(2.0, without[1].tokens_per_forward)
    assert with_memory[1].drafter == "ngram-tree"


def test_memory_option_checked():
    model = tiny_model("llama")
    for bad in (-1, 1.5, True, None, "8"):
        with pytest.raises(ValueError, match="draft_memory_tokens"):
            wrap_copy(model, draft_memory_tokens=bad)
