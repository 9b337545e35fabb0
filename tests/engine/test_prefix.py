"""Prefix caching: the BlockManager's pool (literal cases), and the engine reusing pooled prompt
pages across calls with outputs equal to a run without the pool, never serving stale pages."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
import transformers

import hf_plookup
from hf_plookup.engine.kv_cache import BlockManager
from hf_plookup.outputs import CACHE_FIELD
from tests.conftest import VOCAB, tiny_model, wrap_copy

# tiny pages and chunks so short prompts span several chunk units: 8-token pages, 32-token units
# invariant mode (the pool's condition) on even where "auto" leaves it off (no C kernels)
OPTIONS = dict(max_cache_tokens=2048, block_size=8, max_batch_tokens=32, invariant=True)


# -- the pool (BlockManager) ----------------------------------------------------------------
def test_pool_register_match_and_release():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13])
    h = bm.page_hashes(tokens, 2)
    assert len(h) == 2 and h == bm.page_hashes(tokens.copy(), 2)
    assert bm.page_hashes(np.array([5, 6, 7, 8, 0, 10, 11, 12]), 2)[0] == h[0]  # same first page
    assert bm.page_hashes(np.array([5, 6, 7, 8, 0, 10, 11, 12]), 2)[1] != h[1]  # a chain: prefix differs
    bm.ensure(1, 9)
    first = list(bm.table(1))
    bm.register(1, h)
    assert bm.num_pooled == 2 and bm.num_free == 5
    bm.free(1)  # pooled pages wait, evictable; the third block is free again
    assert bm.num_free == 8 and set(bm.evictable) == set(first[:2])
    assert bm.match(2, h) == 2 and bm.table(2) == first[:2]
    assert not bm.evictable and bm.num_free == 6
    assert bm.match(3, [h[0], b"other"]) == 1  # the longest run
    assert bm.refs[first[0]] == 2
    bm.free(3)
    bm.free(2)
    assert bm.num_free == 8 and bm.num_pooled == 2


def test_pool_match_cut_to_whole_units_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.page_hashes(np.arange(6), 3)
    bm.ensure(1, 6)
    bm.register(1, a)
    bm.free(1)
    assert bm.match(2, a, unit_pages=2) == 2  # three pages pooled, units of two: two matched
    bm.free(2)
    bm.ensure(3, 4)  # the free block, then the least recently used pooled page (the third) is evicted
    assert bm.table(3) == [3, 2] and bm.num_pooled == 2 and bm.num_free == 2  # evictable pages count as free
    assert bm.match(5, a) == 2  # the first two pages are still pooled
    bm.free(5)
    bm.free(3)
    bm.clear_prefixes()
    assert bm.num_pooled == 0 and bm.num_free == 4 and not bm.evictable
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.ensure(4, 10)


def test_match_extends_a_table_as_pages_enter_the_pool():
    """A sequence waiting on another row's prefill takes the pages that row registered since."""
    bm = BlockManager(num_blocks=8, block_size=2)
    h = bm.page_hashes(np.arange(6), 3)
    bm.ensure(1, 6)
    bm.register(1, h[:2])  # row 1 has computed two pages so far
    assert bm.match(2, h) == 2 and bm.table(2) == bm.table(1)[:2]
    bm.register(1, h)  # and now the third
    assert bm.match(2, h) == 3 and bm.table(2) == bm.table(1)
    assert bm.match(2, h) == 3  # nothing further pooled: unchanged
    bm.ensure(3, 2)
    with pytest.raises(ValueError, match="whole units"):
        bm.match(3, h, unit_pages=2)  # one page held, units of two


def test_clear_while_held_frees_on_release():
    bm = BlockManager(num_blocks=3, block_size=2)
    h = bm.page_hashes(np.arange(4), 2)
    bm.ensure(1, 4)
    bm.register(1, h)
    bm.clear_prefixes()
    bm.free(1)
    assert bm.num_free == 3 and bm.num_pooled == 0


# -- the engine -----------------------------------------------------------------------------
def _doc(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (n // 4,), generator=g)
    return torch.cat([phrase, torch.randint(3, VOCAB, (n - n // 4,), generator=g)])


def _ask(doc: torch.Tensor, question: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + question)
    return torch.cat([doc, torch.randint(3, VOCAB, (7,), generator=g)])[None]


def _gen(m, ids, **kw):
    return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, **kw)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_questions_about_one_document_reuse_its_pages(model):
    """Several calls sharing a 150-token document: after the first, the document's whole chunk
    units come from the pool, and every output equals the run without the pool and HF's."""
    on, off = wrap_copy(model, **OPTIONS), wrap_copy(model, prefix_cache=False, **OPTIONS)
    doc = _doc(0, 150)
    for q in range(4):
        ids = _ask(doc, q)
        out = _gen(on, ids, prompt_lookup_num_tokens=4)
        assert torch.equal(out, _gen(off, ids, prompt_lookup_num_tokens=4)) and torch.equal(out, _gen(model, ids))
        s = on.last_stats
        assert s.prefix_cache and s.prompt_tokens == 157
        assert s.cached_prompt_tokens == (0 if q == 0 else 128)  # 4 whole 32-token units of 157
        assert not off.last_stats.prefix_cache and off.last_stats.cached_prompt_tokens == 0
    blocks = on._engine.blocks
    assert blocks.num_free == blocks.num_blocks and blocks.num_pooled > 0 and not blocks.tables


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def test_rows_of_one_call_share_their_beginning(model):
    """Three rows ask about one 150-token document, a fourth about another: the first row
    prefills the document's four whole 32-token units, the other two wait and take them from the
    pool (2 x 128 cached tokens on an empty pool); tokens equal HF's and the run without the pool."""
    doc = _doc(30, 150)
    rows = [_ask(doc, 0)[0], _ask(doc, 1)[0], _ask(_doc(31, 100), 2)[0], _ask(doc, 3)[0]]
    ids, mask = _left_padded(rows)
    on, off = wrap_copy(model, **OPTIONS), wrap_copy(model, prefix_cache=False, **OPTIONS)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    want = model.generate(ids, **kw)
    for k in (None, 4):
        on.clear_prefix_cache()
        got = on.generate(ids, prompt_lookup_num_tokens=k, **kw)
        assert torch.equal(got, want) and torch.equal(got, off.generate(ids, prompt_lookup_num_tokens=k, **kw))
        assert on.last_stats.prompt_tokens == 157 * 3 + 107
        assert on.last_stats.cached_prompt_tokens == 2 * 128, k


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_multi_turn_chat_with_past_key_values(model, name):
    """HF's multi-turn pattern: each turn passes the previous output's cache and the whole
    conversation; tokens equal HF's, and later turns find the earlier prompt in the pool.
    `cache` is the argument's and the output field's name from transformers 5.24 on."""
    if name == "cache" and CACHE_FIELD != "cache":
        pytest.skip(f"transformers {transformers.__version__} names the cache `past_key_values`")
    wrapped = wrap_copy(model, **OPTIONS)
    conv_hf = conv = _doc(3, 70)[None]
    past_hf = past = None
    for turn in range(3):
        ref = model.generate(conv_hf, attention_mask=torch.ones_like(conv_hf), max_new_tokens=10, do_sample=False,
                             return_dict_in_generate=True, **{CACHE_FIELD: past_hf})
        out = wrapped.generate(conv, attention_mask=torch.ones_like(conv), max_new_tokens=10, prompt_lookup_num_tokens=4,
                               return_dict_in_generate=True, **{name: past})
        assert not wrapped.last_stats.delegated
        assert torch.equal(ref.sequences, out.sequences), f"turn {turn}"
        assert getattr(out, CACHE_FIELD).get_seq_length() == getattr(ref, CACHE_FIELD).get_seq_length()
        if turn:
            assert wrapped.last_stats.cached_prompt_tokens >= 64
            assert getattr(out, CACHE_FIELD) is past  # extended in place, as HF does
        user = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(turn))
        conv_hf, past_hf = torch.cat([ref.sequences, user], 1), getattr(ref, CACHE_FIELD)
        conv, past = torch.cat([out.sequences, user], 1), getattr(out, CACHE_FIELD)
    if CACHE_FIELD == "cache":
        with pytest.raises(ValueError, match="either `cache` or `past_key_values`"):
            wrapped.generate(conv, cache=past, past_key_values=past, max_new_tokens=2)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_cache_hf_made_is_read_not_prefilled(model, prefix_cache):
    """A cache from the plain model (nothing of it pooled) for a left-padded batch of two: its
    keys and values are copied into the pages (every attended cached token counts as cached, with
    the pool on or off) and the continuation equals HF's own from that cache."""
    rows = [_doc(40, 30), _doc(41, 21)]
    ids, mask = _left_padded(rows)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    user = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    conv = torch.cat([first.sequences, user], 1)
    conv_mask = torch.cat([mask, torch.ones(2, conv.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    kw = dict(attention_mask=conv_mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    cached = getattr(first, CACHE_FIELD).get_seq_length()  # 30 + 6 - 1 columns
    want = model.generate(conv, **kw, **{CACHE_FIELD: copy.deepcopy(getattr(first, CACHE_FIELD))})
    wrapped = wrap_copy(model, prefix_cache=prefix_cache, **OPTIONS)
    got = wrapped.generate(conv, **kw, **{CACHE_FIELD: copy.deepcopy(getattr(first, CACHE_FIELD))})
    s = wrapped.last_stats
    assert not s.delegated and torch.equal(got.sequences, want.sequences)
    assert s.cached_prompt_tokens == int(conv_mask[:, :cached].sum())  # 35 + 26: pads are not tokens
    assert getattr(got, CACHE_FIELD).get_seq_length() == getattr(want, CACHE_FIELD).get_seq_length()


def _cached_after_change(wrapped, ids, change) -> tuple[int, torch.Tensor]:
    """Pool a prompt, check a repeat hits, `change()`, run again: (tokens from the pool, output)."""
    _gen(wrapped, ids)
    _gen(wrapped, ids)
    assert wrapped.last_stats.cached_prompt_tokens > 0
    change()
    out = _gen(wrapped, ids)
    return wrapped.last_stats.cached_prompt_tokens, out


def test_weights_changed_in_place_empty_the_pool():
    model = tiny_model("llama", seed=5)
    wrapped = wrap_copy(model, **OPTIONS)
    ids = _ask(_doc(1, 100), 0)
    state = {k: v * 1.01 for k, v in model.state_dict().items()}
    cached, out = _cached_after_change(wrapped, ids, lambda: model.load_state_dict(state))
    assert cached == 0 and torch.equal(out, _gen(model, ids))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
        model.model.layers[0].self_attn.k_proj.weight.grad = torch.ones_like(model.model.layers[0].self_attn.k_proj.weight)
        opt.step()

    cached, out = _cached_after_change(wrapped, ids, step)
    assert cached == 0 and torch.equal(out, _gen(model, ids))
    cached, _ = _cached_after_change(wrapped, ids, lambda: wrapped.clear_prefix_cache())
    assert cached == 0


def test_dtype_change_and_rewrap_start_empty():
    model = tiny_model("llama", seed=6)
    wrapped = hf_plookup.wrap(model, **OPTIONS)
    ids = _ask(_doc(2, 100), 0)
    cached, _ = _cached_after_change(wrapped, ids, lambda: wrapped.to(torch.bfloat16))
    assert cached == 0 and wrapped.last_stats.prefix_cache  # bf16 on CPU: invariant, so pooled too
    _gen(wrapped, ids)
    assert wrapped.last_stats.cached_prompt_tokens > 0
    plain = hf_plookup.unwrap(wrapped)
    again = hf_plookup.wrap(plain, **OPTIONS)
    _gen(again, ids)
    assert again.last_stats.cached_prompt_tokens == 0


def test_peft_adapter_switch_enable_disable():
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", seed=7)
    wrapped = wrap_copy(base, **OPTIONS)
    cfg = peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(wrapped, cfg)
    pm.add_adapter("second", peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False))
    ids = _ask(_doc(4, 100), 0)

    def run():
        out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        return wrapped.last_stats.cached_prompt_tokens, out

    run()
    assert run()[0] > 0
    pm.set_adapter("second")
    cached, out = run()
    assert cached == 0
    with pm.disable_adapter():
        cached, out_plain = run()
        assert cached == 0 and torch.equal(out_plain, _gen(base, ids))
    cached, out2 = run()
    assert cached == 0 and torch.equal(out2, out)  # back to "second": recomputed, same tokens


def test_small_cache_evicts_pooled_pages_and_serves_every_request(model):
    """A cache of 40 pages: each call pools about 16, so later calls evict earlier pages."""
    wrapped = wrap_copy(model, max_cache_tokens=320, block_size=8, max_batch_tokens=32)
    for i in range(6):
        ids = _ask(_doc(10 + i % 3, 130), i)
        assert torch.equal(_gen(wrapped, ids, prompt_lookup_num_tokens=3), _gen(model, ids))
    blocks = wrapped._engine.blocks
    assert blocks.num_free == blocks.num_blocks and blocks.num_pooled <= blocks.num_blocks


def test_concurrent_callers_sharing_a_prefix(model):
    wrapped = wrap_copy(model, **OPTIONS)
    doc = _doc(20, 120)
    prompts = [_ask(doc, q) for q in range(6)]
    want = [_gen(model, p) for p in prompts]
    got = [None] * 6

    def call(i):
        got[i] = _gen(wrapped, prompts[i], prompt_lookup_num_tokens=4)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_prefix_cache_option_is_checked():
    with pytest.raises(ValueError, match="prefix_cache"):
        hf_plookup.wrap(tiny_model("llama"), prefix_cache="yes")
