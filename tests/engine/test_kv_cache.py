"""BlockManager accounting, page layout per layer, and the scheduler's admission rule."""

from __future__ import annotations

import pytest
import torch

from hf_plookup.engine.kv_cache import BlockManager, PagedKVCache, check_cpu_memory, default_num_tokens, layer_specs
from hf_plookup.engine.scheduler import Scheduler
from hf_plookup.engine.sequence import Sequence
from tests.conftest import tiny_model


def test_ensure_trim_free_accounting():
    bm = BlockManager(num_blocks=10, block_size=4)
    bm.ensure(1, 9)  # 3 blocks
    bm.ensure(2, 4)  # 1 block
    assert len(bm.table(1)) == 3 and len(bm.table(2)) == 1 and bm.num_free == 6
    bm.ensure(1, 12)  # still 3
    assert len(bm.table(1)) == 3
    bm.trim(1, 5)  # back to 2
    assert len(bm.table(1)) == 2 and bm.num_free == 7
    assert set(bm.table(1)).isdisjoint(bm.table(2))
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.ensure(2, 4 * 9)
    bm.free_all()
    assert bm.num_free == 10 and not bm.tables
    assert sorted(bm.free_blocks) == list(range(10))


def test_layer_specs_follow_gqa_and_dtype():
    model = tiny_model("qwen3").to(torch.bfloat16)
    specs = layer_specs(model)
    assert len(specs) == 2
    assert all(s.num_kv_heads == 2 and s.head_dim == 16 and s.dtype == torch.bfloat16 for s in specs)
    cache = PagedKVCache(specs, num_blocks=3, block_size=8)
    k, v = cache.layer(1)
    assert k.shape == (3, 8, 2, 16) and v.dtype == torch.bfloat16
    assert default_num_tokens(specs) > 0


def test_bad_cache_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(layer_specs(tiny_model("llama")), num_blocks=2, block_size=0)


def test_scheduler_admits_only_what_can_finish():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_batch_tokens=100, max_num_seqs=8)
    seqs = [Sequence(i, i, prompt_len=5, max_new_tokens=3) for i in range(3)]  # 8 tokens = 2 blocks each
    for s in seqs:
        sched.add(s)
    chunks = sched.schedule()
    assert [c.seq.seq_id for c in chunks] == [0, 1, 2] and all(c.is_prefill for c in chunks)
    bm2 = BlockManager(num_blocks=5, block_size=4)
    sched2 = Scheduler(bm2, max_batch_tokens=100, max_num_seqs=8)
    for s in [Sequence(i, i, prompt_len=5, max_new_tokens=3) for i in range(3)]:
        sched2.add(s)
    assert len(sched2.schedule()) == 2 and len(sched2.waiting) == 1  # the third would not fit


def test_scheduler_prefill_budget_splits_chunks():
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(bm, max_batch_tokens=7, max_num_seqs=8)
    a, b = Sequence(0, 0, 10, 2), Sequence(1, 1, 4, 2)
    sched.add(a)
    sched.add(b)
    chunks = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in chunks] == [(0, 0, 7)]
    a.num_cached = 7
    chunks = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in chunks] == [(0, 7, 3), (1, 0, 4)]


def test_sequence_append_stops_at_eos_and_limit():
    import numpy as np

    hist = np.zeros((1, 20), dtype=np.int64)
    s = Sequence(0, 0, prompt_len=3, max_new_tokens=4)
    assert s.append(hist, [5, 6, 9, 7], frozenset({9})) == 3 and s.finished
    s2 = Sequence(1, 0, prompt_len=3, max_new_tokens=2)
    assert s2.append(hist, [5, 6, 7], frozenset()) == 2 and s2.finished and s2.num_generated == 2


def test_scheduler_aligned_prefill_takes_whole_units():
    """Invariant mode's units (aligned_prefill): a chunk runs to the end of its current unit,
    then takes whole units while the budget holds them; units_per_chunk=1 keeps one unit."""
    def first_step(units_per_chunk):
        bm = BlockManager(num_blocks=400, block_size=4)
        sched = Scheduler(bm, max_batch_tokens=300, max_num_seqs=8, aligned_prefill=128,
                          units_per_chunk=units_per_chunk)
        a, b, c = Sequence(0, 0, 400, 2), Sequence(1, 1, 200, 2), Sequence(2, 2, 50, 2)
        a.num_cached = 100  # (a pooled prefix, or the caller's cache)
        for s in (a, b, c):
            sched.add(s)
        return [(ch.seq.seq_id, ch.start, ch.num_tokens) for ch in sched.schedule()]

    # a: 28 tokens to position 128, then 2 whole units (284 of 300); b's first unit does not fit in 16
    assert first_step(None) == [(0, 100, 284)]
    # one unit each: a to 128, b its first unit, c all of its 50 tokens (28 + 128 + 50 <= 300)
    assert first_step(1) == [(0, 100, 28), (1, 0, 128), (2, 0, 50)]
    with pytest.raises(ValueError, match="units_per_chunk"):
        Scheduler(BlockManager(4, 4), 300, 8, aligned_prefill=128, units_per_chunk=0)


def test_check_cpu_memory_literal():
    """The docstring's case: 28 layers of 8 KV heads of 128 bf16 values, 114,688 bytes a token."""
    from types import SimpleNamespace

    spec = SimpleNamespace(bytes_per_token=lambda: 2 * 8 * 128 * 2)
    specs = [spec] * 28
    gib = 2**30
    check_cpu_memory(specs, 50_000, 0, 16 * gib, available=8 * gib)  # 5.3 GiB: fits
    check_cpu_memory(specs, None, gib, 16 * gib, available=8 * gib)  # sized later from what is left
    with pytest.raises(ValueError, match=r"100000 tokens needs 10.68 GiB, but 8.00 GiB .* take 16.00 GiB.*max_cache_tokens"):
        check_cpu_memory(specs, 100_000, 0, 16 * gib, available=8 * gib)
    with pytest.raises(ValueError, match=r"packing the weights 3.00 GiB more"):
        check_cpu_memory(specs, 50_000, 3 * gib, 16 * gib, available=8 * gib)


def test_wrap_refuses_a_cache_beyond_memory_and_leaves_the_model_as_it_was():
    import hf_plookup
    from hf_plookup.engine.kv_cache import available_memory

    model = tiny_model("llama")
    before = {n: (type(p), p.detach().clone()) for n, p in model.named_parameters()}
    cls = type(model)
    free = available_memory()
    if free is None:
        pytest.skip("no /proc/meminfo here: the check has nothing to read")
    per_token = sum(s.bytes_per_token() for s in layer_specs(model))
    with pytest.raises(ValueError, match="max_cache_tokens"):
        hf_plookup.wrap(model, max_cache_tokens=2 * free // per_token)
    assert type(model) is cls  # not wrapped, and not one weight packed
    assert all(type(p) is before[n][0] and torch.equal(p, before[n][1]) for n, p in model.named_parameters())
