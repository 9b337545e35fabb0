"""Several threads calling `generate` on one wrapped model: every call gets HF greedy's tokens,
its own stats, and no block stays in use."""

from __future__ import annotations

import threading

import torch

import hf_plookup
from tests.conftest import left_padded, tiny_model


def test_threads_get_hf_greedy_tokens_and_their_own_stats():
    model = tiny_model("llama")
    wrapped = hf_plookup.wrap(model, max_cache_tokens=512, block_size=8)  # small: rows of a call wait for blocks
    calls = []  # (thread, call) -> (input_ids, mask, max_new_tokens)
    for t in range(3):
        for c in range(5):
            ids, mask = left_padded(2 + (c % 2), seed=10 * t + c)
            calls.append((t, c, ids, mask, 6 + 4 * c))
    expected = {(t, c): model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
                for t, c, ids, mask, n in calls}
    results, stats, errors = {}, {}, []
    start = threading.Barrier(3)

    def client(t):
        try:
            start.wait()
            for tt, c, ids, mask, n in calls:
                if tt == t:
                    results[t, c] = wrapped.generate(ids, attention_mask=mask, max_new_tokens=n, prompt_lookup_num_tokens=4)
                    stats[t, c] = wrapped.last_stats  # this thread's call, whatever the others did meanwhile
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)
    for key, ref in expected.items():
        assert torch.equal(results[key], ref), key
        assert stats[key].num_sequences == ref.shape[0], key
    assert len({id(s) for s in stats.values()}) == len(stats)
    blocks = wrapped._engine.blocks
    assert blocks.num_free == blocks.num_blocks
    assert wrapped.last_stats is None  # the main thread made no call
