"""Several threads calling `generate` on one wrapped model: every call gets HF greedy's tokens,
its own stats, and no block stays in use."""

from __future__ import annotations

import threading

import torch

import hf_plookup
from tests.conftest import left_padded, tiny_model, wrap_copy


def test_threads_get_hf_greedy_tokens_and_their_own_stats():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=512, block_size=8)  # small: rows of a call wait for blocks
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


class _WatchedLock:
    """The engine's loop lock, calling `on_blocked` when a thread asks for it while a loop holds it."""

    def __init__(self, lock, on_blocked):
        self._lock, self._on_blocked = lock, on_blocked

    def __enter__(self):
        if self._lock.locked():
            self._on_blocked()
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


class _WatchedList(list):
    """The engine's list of calls waiting to join its loop, calling `on_append` for each."""

    def __init__(self, on_append):
        super().__init__()
        self._on_append = on_append

    def append(self, item):
        super().append(item)
        self._on_append()


def _joined_pair(join_calls: bool, fail_after_join: bool = False):
    """Call A starts; its first forward waits until call B (another thread) has arrived at the
    engine, so B provably arrives while A's loop runs: B either joins it (queued in the engine's
    pending calls) or waits for it (asks for the loop lock while A's loop holds it). Returns
    (model, wrapped, inputs, results, stats, errors, forwards, arrivals): arrivals lists how B
    arrived during A's first forward, "joined" or "waited"."""
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=1024, block_size=8, join_calls=join_calls)
    engine = wrapped._engine
    started, b_arrived = threading.Event(), threading.Event()
    forwards, arrived, arrivals = [], [], []
    engine._pending = _WatchedList(lambda: (arrived.append("joined"), b_arrived.set()))
    engine._loop_lock = _WatchedLock(engine._loop_lock, lambda: (arrived.append("waited"), b_arrived.set()))

    def hook(module, args, kwargs):
        forwards.append(1)
        if not started.is_set():
            started.set()
            b_arrived.wait(60)  # a safety net: what is checked is what arrived meanwhile
            arrivals.extend(arrived)  # B arrived while A's loop ran its first forward
        elif fail_after_join and len(forwards) == 4:
            raise RuntimeError("boom in a forward")

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    inputs = {"A": left_padded(2, seed=1), "B": left_padded(3, seed=2)}
    results, stats, errors = {}, {}, {}

    def client(name, n):
        ids, mask = inputs[name]
        try:
            results[name] = wrapped.generate(ids, attention_mask=mask, max_new_tokens=n, prompt_lookup_num_tokens=4)
            stats[name] = wrapped.last_stats
        except BaseException as e:  # checked by the caller
            errors[name] = e

    a = threading.Thread(target=client, args=("A", 12))
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=client, args=("B", 20))
    b.start()
    a.join(120)
    b.join(120)
    handle.remove()
    assert not a.is_alive() and not b.is_alive()
    return model, wrapped, inputs, results, stats, errors, len(forwards), arrivals


def test_a_call_arriving_mid_loop_joins_it():
    model, wrapped, inputs, results, stats, errors, forwards, arrivals = _joined_pair(join_calls=True)
    assert not errors, errors
    assert arrivals == ["joined"]
    for name, n in (("A", 12), ("B", 20)):
        ids, mask = inputs[name]
        assert torch.equal(results[name], model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False))
    assert stats["A"].num_sequences == 2 and stats["B"].num_sequences == 3
    # shared forwards are counted by both calls: fewer model forwards ran than the calls counted
    assert forwards < stats["A"].forwards + stats["B"].forwards
    assert wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks


def test_join_calls_false_runs_calls_one_after_another():
    model, wrapped, inputs, results, stats, errors, forwards, arrivals = _joined_pair(join_calls=False)
    assert not errors, errors
    assert arrivals == ["waited"]  # B came while A's loop ran, and waited for it to end
    assert forwards == stats["A"].forwards + stats["B"].forwards
    ids, mask = inputs["B"]
    assert torch.equal(results["B"], model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))


def test_an_error_in_a_joined_loop_reaches_every_caller_and_frees_the_cache():
    model, wrapped, inputs, _, _, errors, _, arrivals = _joined_pair(join_calls=True, fail_after_join=True)
    assert arrivals == ["joined"]
    assert isinstance(errors.get("A"), RuntimeError) and "boom" in str(errors["A"])
    assert isinstance(errors.get("B"), RuntimeError) and "joined failed" in str(errors["B"])
    blocks = wrapped._engine.blocks
    assert blocks.num_free == blocks.num_blocks and wrapped._engine._batch is None and not wrapped._engine._pending
    ids, mask = inputs["B"]  # the next call runs normally
    assert torch.equal(wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=4),
                       model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
