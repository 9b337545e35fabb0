"""`return_dict_in_generate` outputs as HF's (hf_plookup/outputs.py): scores and logits of rows
that finished early (HF's pad-token steps), `compute_transition_scores`, `past_key_values`
built from the pages, and `generate(..., past_key_values=cache)` continuing a conversation."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import VOCAB, copy_batch, copy_model, left_padded, tiny_model, wrap_copy

NEW = 20


@pytest.fixture(scope="module")
def copy_setup():
    model = copy_model()
    return model, wrap_copy(model, max_cache_tokens=8192, block_size=8)


@pytest.fixture(scope="module")
def llama_setup():
    model = tiny_model("llama", seed=3)
    return model, wrap_copy(model, max_cache_tokens=8192, block_size=8)


def _eos_at(model, ids, mask, where):
    """EOS tokens that end rows at different steps: row r's greedy token at step s for (r, s) in `where`."""
    w = ids.shape[1]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return [int(free[r, w + s]) for r, s in where]


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("k", [None, 4])
def test_scores_of_finished_rows_and_transition_scores_equal_hf(copy_setup, batch, k):
    model, wrapped = copy_setup
    ids, mask, _ = copy_batch(model, batch)
    w = ids.shape[1]
    eos = _eos_at(model, ids, mask, [(0, 4), (batch - 1, 9)])
    kw = dict(max_new_tokens=NEW, eos_token_id=eos, do_sample=False, return_dict_in_generate=True,
              output_scores=True, output_logits=True, repetition_penalty=1.05, suppress_tokens=[3, 4])
    ref = model.generate(ids, attention_mask=mask, **kw)
    out = wrapped.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=k, **kw)
    assert not wrapped.last_stats.delegated
    assert torch.equal(out.sequences, ref.sequences)
    if batch > 1:
        ends = [(ref.sequences[b, w:-1].unsqueeze(-1) == torch.tensor(eos)).any().item() for b in range(batch)]
        assert any(ends), "setup: a row finishes before the batch ends"
    assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
    for t, (a, b) in enumerate(zip(out.scores, ref.scores)):  # every row, finished ones included
        assert torch.equal(torch.isinf(a), torch.isinf(b)), t
        torch.testing.assert_close(a[torch.isfinite(b)], b[torch.isfinite(b)], atol=1e-4, rtol=1e-4)
    for t, (a, b) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"logits step {t}")
    for norm in (False, True):
        ta = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=norm)
        tb = model.compute_transition_scores(ref.sequences, ref.scores, normalize_logits=norm)
        torch.testing.assert_close(ta, tb, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [None, 4])
def test_past_key_values_equal_hf_on_token_positions(llama_setup, k):
    model, wrapped = llama_setup
    ids, mask = left_padded(3, seed=5)
    w = ids.shape[1]
    eos = _eos_at(model, ids, mask, [(1, 3)])
    kw = dict(max_new_tokens=12, eos_token_id=eos, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, attention_mask=mask, **kw)
    out = wrapped.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=k, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    total = ref.sequences.shape[1]
    ends = [w + next((i + 1 for i, t in enumerate(ref.sequences[b, w:].tolist()) if t in eos), total - w)
            for b in range(3)]
    assert min(ends) < total, "setup: a row finishes early"
    pa, pb = out.past_key_values, ref.past_key_values
    assert type(pa) is type(pb) is DynamicCache and len(pa.layers) == len(pb.layers)
    assert pa.get_seq_length() == pb.get_seq_length() == total - 1
    for la, lb in zip(pa.layers, pb.layers):
        assert type(la) is type(lb)
        assert la.keys.shape == lb.keys.shape and la.values.shape == lb.values.shape
        for b in range(3):
            # HF's KV of real tokens: attended prompt columns, generated columns before the row's last token
            real = torch.cat([mask[b].bool(), torch.arange(w, total - 1) < ends[b] - 1])
            for got, want in ((la.keys, lb.keys), (la.values, lb.values)):
                torch.testing.assert_close(got[b][:, real], want[b][:, real], atol=1e-5, rtol=1e-5)
                assert not got[b][:, ~real].any(), "pad positions hold zeros"


def test_past_key_values_sliding_window_layers_like_hf(copy_setup):
    model, wrapped = copy_setup
    ids, mask, _ = copy_batch(model, 2)
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(ids, attention_mask=mask, **kw)
    out = wrapped.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=4, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for la, lb in zip(out.past_key_values.layers, ref.past_key_values.layers):
        assert type(la) is type(lb) and la.keys.shape == lb.keys.shape
        assert la.get_seq_length() == lb.get_seq_length()
        torch.testing.assert_close(la.keys[1], lb.keys[1], atol=1e-5, rtol=1e-5)  # row 1: no padding


def test_no_cache_without_use_cache(llama_setup):
    model, wrapped = llama_setup
    ids, mask = left_padded(2)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, use_cache=False)
    assert model.generate(ids, attention_mask=mask, **kw).past_key_values is None
    assert wrapped.generate(ids, attention_mask=mask, **kw).past_key_values is None


def test_two_turn_continuation_equals_hf(llama_setup):
    """HF's multi-turn pattern: one DynamicCache passed to every turn, extended in place."""
    model, wrapped = llama_setup
    g = torch.Generator().manual_seed(7)
    phrase = torch.randint(3, VOCAB, (1, 10), generator=g)
    turn1 = torch.cat([phrase, phrase, phrase[:, :4]], dim=1)
    user2 = torch.cat([phrase[:, 2:8], phrase[:, 2:5]], dim=1)
    results = {}
    for name, m in (("hf", model), ("ours", wrapped)):
        cache = DynamicCache()
        out1 = m.generate(turn1, attention_mask=torch.ones_like(turn1), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, past_key_values=cache, **({"prompt_lookup_num_tokens": 4} if m is wrapped else {}))
        assert cache.get_seq_length() == out1.shape[1] - 1  # extended in place: every token but the last
        turn2 = torch.cat([out1, user2], dim=1)
        out2 = m.generate(turn2, attention_mask=torch.ones_like(turn2), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, past_key_values=cache, **({"prompt_lookup_num_tokens": 4} if m is wrapped else {}))
        if m is wrapped:
            assert not wrapped.last_stats.delegated
        results[name] = (out1, out2, cache)
    (h1, h2, hc), (o1, o2, oc) = results["hf"], results["ours"]
    assert torch.equal(o1, h1) and torch.equal(o2, h2)
    assert oc.get_seq_length() == hc.get_seq_length() == h2.shape[1] - 1
    for la, lb in zip(oc.layers, hc.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la.values, lb.values, atol=1e-5, rtol=1e-5)
    # HF continues from our cache as from its own
    cache = DynamicCache()
    o1 = wrapped.generate(turn1, max_new_tokens=8, do_sample=False, eos_token_id=None, past_key_values=cache)
    assert torch.equal(model.generate(torch.cat([o1, user2], 1), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      past_key_values=cache), h2)


def test_past_key_values_longer_than_input_is_value_error(llama_setup):
    model, wrapped = llama_setup
    ids, _ = left_padded(1)
    cache = DynamicCache()
    out = wrapped.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, past_key_values=cache)
    with pytest.raises(ValueError, match="past_key_values"):
        wrapped.generate(out[:, :3], max_new_tokens=4, past_key_values=cache)
