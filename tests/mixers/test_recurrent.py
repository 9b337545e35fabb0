"""Recurrent mixers' per-sequence states (mixers.recurrent): snapshots, rollback of rejected
drafts against HF's own incremental decoding, and what the engine does with hybrid models."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import hf_plookup
from hf_plookup.base.layout import StepRows
from hf_plookup.mixers.recurrent import RecurrentMixers, SequenceStates, _State, mixer_modules
from tests.conftest import PAD, left_padded, tiny_model, wrap_copy


def test_snapshots_resume_the_committed_length_and_drop_the_rest():
    states = SequenceStates()
    marks = {n: _State(layer=f"after {n}") for n in (11, 12, 13, 14)}  # a row verified positions 10..13
    for n, s in marks.items():
        states.keep(seq_id=7, layer_idx=0, count=n, state=s)
    states.keep(seq_id=8, layer_idx=0, count=5, state=_State(layer="other row"))
    assert len(states) == 5 and states.held(7, 0) == [11, 12, 13, 14]
    assert states.resume(7, 0, 12) is marks[12]  # one draft accepted: the row holds 12 tokens
    assert len(states) == 1  # 11, 13, 14 dropped with it; the other row keeps its own
    with pytest.raises(RuntimeError, match="no recurrent state of sequence 7 in layer 0 after 13 tokens"):
        states.resume(7, 0, 13)
    fresh = states.resume(8, 0, 0)  # a sequence (re)started from its first token
    assert fresh.linear is None and not any(fresh.layer.has_previous_state.values())
    assert len(states) == 0


def _hf_incremental(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """HF's generate path for one row: the prompt in one forward, then one token per forward
    through its cache. [L, V] logits."""
    params = inspect.signature(type(model).forward).parameters  # the cache's name differs by version
    name = next(n for n in ("cache", "past_key_values", "cache_params") if n in params)
    cache = {name: DynamicCache(config=model.config)}
    out = [model(ids[None, :prompt], **cache, use_cache=True).logits[0]]
    for t in range(prompt, len(ids)):
        out.append(model(ids[None, t : t + 1], **cache, use_cache=True).logits[0])
    return torch.cat(out)


def test_rejected_drafts_roll_back_exactly():
    """Two rows packed into each forward (Mamba: no attention, so the model runs without pages),
    each verifying its next tokens followed by junk drafts; after every step a row keeps only its
    real tokens. The logits of every real token equal HF's token-by-token decoding, so the junk's
    states never leak into a later step."""
    model = tiny_model("mamba")
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, 96, (40,), generator=g) for _ in range(2)]
    prompt = 6
    with torch.inference_mode():
        ref = [_hf_incremental(model, r, prompt) for r in rows]
        mixers = RecurrentMixers(model)
        count = [0, 0]
        rng = np.random.default_rng(0)
        while max(count) + 4 <= 40:  # each step feeds at most 4 tokens of a row
            fed, kept, prefill = [], [], []
            for i, r in enumerate(rows):
                if count[i] == 0:
                    fed.append(r[:prompt]), kept.append(prompt), prefill.append(True)
                    continue
                m = int(rng.integers(1, 5))  # the last token and m - 1 drafts
                a = int(rng.integers(0, m))  # drafts accepted: the real tokens run up to a, junk after
                junk = torch.randint(3, 96, (m - a - 1,), generator=g)
                fed.append(torch.cat([r[count[i] : count[i] + a + 1], junk])), kept.append(a + 1), prefill.append(False)
            lengths = np.array([len(f) for f in fed])
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            step = StepRows(np.array([10, 20]), np.array(count), lengths, offsets, np.array(prefill))
            with mixers.active(step):
                logits = model(torch.cat(fed)[None], use_cache=False).logits[0]
            for i in range(2):
                # a state after each fed token (after a prompt chunk: its end), until the next step resumes one
                first = count[i] + (len(fed[i]) if prefill[i] else 1)
                for layer in mixer_modules(model):
                    assert mixers.states.held((10, 20)[i], layer) == list(range(first, count[i] + len(fed[i]) + 1))
                got = logits[offsets[i] : offsets[i] + kept[i]]
                want = ref[i][count[i] : count[i] + kept[i]]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
                assert torch.equal(got.argmax(-1), want.argmax(-1))
                count[i] += kept[i]


@pytest.fixture(scope="module")
def hybrid():
    model = tiny_model("qwen3_next")
    return model, wrap_copy(model, max_cache_tokens=2048, block_size=8)


def test_hybrid_engine_drafts_chains_in_eager_steps_without_prefix_pool(hybrid):
    model, wrapped = hybrid
    eng = wrapped._engine
    assert sorted(eng.mixers.mixers) == [0] and eng.specs[0].num_kv_heads == 0 and eng.specs[1].num_kv_heads == 2
    assert not eng.prefix_cache and not eng.use_compile
    ids, mask = left_padded(3, seed=5)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=24, prompt_lookup_num_tokens=4,
                           prompt_lookup_tree_nodes=12)  # trees asked for: a chain is drafted
    assert torch.equal(out, ref)
    s = wrapped.last_stats
    assert s.drafter == "ngram" and s.drafted > 0 and not s.delegated
    assert len(eng.mixers.states) == 0  # the loop's states go with it
    padded = wrap_copy(model, max_cache_tokens=2048, block_size=8, pad_drafts=True)  # padded draft positions
    assert torch.equal(padded.generate(ids, attention_mask=mask, max_new_tokens=24, prompt_lookup_num_tokens=4), ref)


def test_hybrid_options_that_cannot_hold_states_are_refused(hybrid):
    model, _ = hybrid
    with pytest.raises(ValueError, match="prefix_cache=True cannot run: this model's recurrent mixers"):
        wrap_copy(model, prefix_cache=True)
    with pytest.raises(ValueError, match="compile=True cannot run: its recurrent mixers run row by row"):
        wrap_copy(model, compile=True)


def test_hybrid_cache_in_or_out_goes_to_hf(hybrid):
    """HF's cache of a hybrid model holds each recurrent layer's state, which pages do not: a
    call that returns or continues a cache is HF's own."""
    model, wrapped = hybrid
    ids, mask = left_padded(2, seed=6)
    kw = dict(attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True)
    ref = model.generate(ids, do_sample=False, **kw)
    out = wrapped.generate(ids, prompt_lookup_num_tokens=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    s = wrapped.last_stats
    assert s.delegated and "recurrent mixers" in s.delegated_reason


@pytest.mark.parametrize("arch", ["falcon_h1", "lfm2"])
def test_hybrid_invariant_drafts_and_batch_change_no_logit(arch):
    """Invariant mode: a verify step runs its tokens one by one through the mixers, as plain
    decoding does, so drafts and batching change no logit; tokens are HF's. (`use_cache=False`:
    logits without a cache out stay on the engine.)"""
    hf = tiny_model(arch)
    model = wrap_copy(hf, invariant=True, max_batch_tokens=16)
    ids, mask = left_padded(3, seed=9)
    kw = dict(max_new_tokens=16, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True, use_cache=False)

    def logits(ids, mask, **extra):
        out = torch.stack(model.generate(ids, attention_mask=mask, **kw, **extra).logits, 1)
        assert model.last_stats.invariant and not model.last_stats.delegated
        return out

    plain = logits(ids, mask)
    assert torch.equal(logits(ids, mask, prompt_lookup_num_tokens=4), plain)
    assert model.last_stats.drafted > 0
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD)
    assert torch.equal(ref[:, ids.shape[1]:], plain.argmax(-1))
    alone = logits(ids[2:, 6:], mask[2:, 6:], prompt_lookup_num_tokens=4)  # row 2 without its 6 pads
    assert torch.equal(alone[0], plain[2, : alone.shape[1]])


def test_minimax_lightning_attention_unpadded():
    """MiniMax keeps its lightning-attention state in its own cache class (`get_linear_cache`).
    Unpadded rows only: HF's own padded prefill of MiniMax does not compute a row as it does alone."""
    model = tiny_model("minimax", head_dim=16, layer_types=["linear_attention", "full_attention"],
                       num_local_experts=4)
    wrapped = wrap_copy(model, max_cache_tokens=1024)
    ids, _ = left_padded(1, seed=3)
    ref = model.generate(ids, do_sample=False, max_new_tokens=30)
    assert torch.equal(wrapped.generate(ids, max_new_tokens=30, prompt_lookup_num_tokens=4), ref)
    assert not wrapped.last_stats.delegated


def test_state_space_model_runs_padded_rows_without_pages():
    """Mamba: no attention layer, so no pages and no positions; a padded row computes as alone."""
    model = tiny_model("mamba")
    wrapped = wrap_copy(model, max_cache_tokens=1024)
    assert all(s.num_kv_heads == 0 for s in wrapped._engine.specs)
    assert all(k.numel() == 0 for k in wrapped._engine.cache().keys)
    ids, mask = left_padded(3, seed=2)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert torch.equal(wrapped.generate(ids, attention_mask=mask, max_new_tokens=20, prompt_lookup_num_tokens=4), ref)
    assert not wrapped.last_stats.delegated


def test_hybrid_wrap_and_generate_through_the_public_api():
    """`hf_plookup.wrap` on a hybrid model is the model itself; `unwrap` restores its forwards."""
    model = tiny_model("nemotron_h")
    forwards = {i: m.__dict__.get("forward") for i, m in mixer_modules(model).items()}
    wrapped = hf_plookup.wrap(model, max_cache_tokens=1024)
    assert isinstance(wrapped, type(tiny_model("nemotron_h")))
    ids, mask = left_padded(2, seed=8)
    wrapped.generate(ids, attention_mask=mask, max_new_tokens=6, prompt_lookup_num_tokens=2)
    assert {i: m.__dict__.get("forward") for i, m in mixer_modules(model).items()} == forwards
