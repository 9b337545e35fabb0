"""The engine against HF `generate` (greedy, fp32): token-identical outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_plookup
from tests.conftest import ARCHS, EOS, PAD, RECURRENT_ARCHS, left_padded, tiny_model, wrap_copy


def _both(model, wrapped, ids, mask, **kw):
    """HF plain greedy vs hf_plookup (with the prompt-lookup arguments only on our side)."""
    hf_kw = {k: v for k, v in kw.items() if k not in ("prompt_lookup_num_tokens", "max_matching_ngram_size")}
    ref = model.generate(ids, attention_mask=mask, do_sample=False, **hf_kw)
    out = wrapped.generate(ids, attention_mask=mask, **kw)
    return ref, out


@pytest.fixture(scope="module", params=sorted(ARCHS | RECURRENT_ARCHS))
def arch_pair(request):
    model = tiny_model(request.param)
    return request.param, model, wrap_copy(model, max_cache_tokens=4096, block_size=8), {}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", [None, 1, 4, 10])
def test_identical_to_hf_greedy(arch_pair, batch, k):
    arch, model, wrapped, refs = arch_pair
    ids, mask = left_padded(batch, seed=batch + 7)
    if batch not in refs:  # HF's greedy of these prompts, made once for every k
        refs[batch] = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)
    ref = refs[batch]
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=40, prompt_lookup_num_tokens=k)
    assert torch.equal(ref, out), f"{arch} batch={batch} k={k}"
    stats = wrapped.last_stats
    assert stats.new_tokens >= batch
    assert stats.accepted <= stats.drafted
    if not k:
        assert stats.drafted == 0 and stats.tokens_per_forward == 1.0
    assert wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks


def _copy_setup(window: int = 4, k: int = 4):
    """A sliding-window model sees only its last few tokens, so after `P + G + P` (G = its own
    greedy continuation of P) it continues with G again: drafts copied from the first G are
    accepted, which makes acceptance testable on a random model."""
    model = tiny_model("mistral", sliding_window=window)
    g = torch.Generator().manual_seed(3)
    p = torch.randint(3, 96, (1, 10), generator=g)
    cont = model.generate(p, max_new_tokens=24, do_sample=False, eos_token_id=None)[:, 10:]
    return model, torch.cat([p, cont, p], dim=1), cont


def test_drafts_accepted_on_repeats():
    model, prompt, _ = _copy_setup()
    wrapped = wrap_copy(model, max_cache_tokens=2048, block_size=4)
    ids = prompt.repeat(3, 1)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD, 0  # unequal lengths
    ref, out = _both(model, wrapped, ids, mask, max_new_tokens=20, eos_token_id=None, prompt_lookup_num_tokens=4)
    assert torch.equal(ref, out)
    s = wrapped.last_stats
    assert s.accepted >= 20, s.as_dict()
    assert s.tokens_per_forward > 1.5
    assert s.acceptance_per_position[0] > 0.5
    # no CUDA graphs nor compiled steps on a CPU engine: every decode step runs the model eagerly
    assert s.decode_steps_by_path == {"eager": s.forwards - s.prefill_forwards} and s.eager_reasons == {}


def test_eos_inside_accepted_drafts():
    model, prompt, cont = _copy_setup()
    eos = int(cont[0, 6])  # a token the drafts will carry a few positions in
    wrapped = wrap_copy(model, max_cache_tokens=2048, block_size=4)
    ref, out = _both(model, wrapped, prompt, None, max_new_tokens=20, eos_token_id=eos, prompt_lookup_num_tokens=10)
    assert torch.equal(ref, out)
    assert out[0, -1].item() == eos and out.shape[1] < prompt.shape[1] + 20


def test_rows_finish_at_different_steps_padded_like_hf():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(6, seed=11)
    # an EOS list: two frequent tokens of the tiny model's outputs, so rows stop at different steps
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    toks, counts = torch.unique(free[:, ids.shape[1] :], return_counts=True)
    eos = [int(t) for t in toks[counts.argsort(descending=True)[:2]]]
    ref, out = _both(model, wrapped, ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=PAD, prompt_lookup_num_tokens=4)
    assert torch.equal(ref, out)
    lengths = {int((row[ids.shape[1] :] != PAD).sum()) for row in out}
    assert len(lengths) > 1, "rows should finish at different steps"


def test_long_prompts_span_blocks_and_prefill_chunks():
    model = tiny_model("qwen2")
    wrapped = wrap_copy(model, max_cache_tokens=4096, block_size=4, max_batch_tokens=24)
    ids, mask = left_padded(3, seed=5, period=17, repeats=5.3, pad_step=7)  # ~90 tokens, 23 blocks
    ref, out = _both(model, wrapped, ids, mask, max_new_tokens=25, prompt_lookup_num_tokens=4)
    assert torch.equal(ref, out)
    assert wrapped.last_stats.prefill_forwards >= 10


def test_cache_smaller_than_batch_admits_as_rows_finish():
    model = tiny_model("llama")
    ids, mask = left_padded(5, seed=2)
    need = ids.shape[1] + 20
    wrapped = wrap_copy(model, num_blocks=2 * (-(-need // 8)) + 1, block_size=8)  # room for 2 rows
    ref, out = _both(model, wrapped, ids, mask, max_new_tokens=20, prompt_lookup_num_tokens=3)
    assert torch.equal(ref, out)
    assert wrapped._engine.blocks.num_free == wrapped._engine.blocks.num_blocks


def test_right_padding_warns_and_generates(caplog):
    """HF warns on right padding and generates; so do we. (HF then predicts the first token from
    the pad column's logits; we generate from the attended tokens, i.e. what left padding gives.)"""
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(3, seed=4)
    right_ids = torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(ids, mask)])
    right_mask = mask.flip(1)
    with caplog.at_level("WARNING", logger="hf_plookup"):
        out = wrapped.generate(right_ids, attention_mask=right_mask, max_new_tokens=15, prompt_lookup_num_tokens=4)
    assert "right-padding" in caplog.text
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
    assert torch.equal(out[:, : ids.shape[1]], right_ids)
    assert torch.equal(out[:, ids.shape[1] :], ref[:, ids.shape[1] :])


def test_length_and_eos_from_generation_config():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(2, seed=9)
    for kw in ({"max_length": ids.shape[1] + 7}, {}, {"max_new_tokens": 12, "eos_token_id": [EOS, 5]}):
        ref, out = _both(model, wrapped, ids, mask, prompt_lookup_num_tokens=2, **kw)
        assert torch.equal(ref, out), kw


def test_no_attention_mask_infers_it_like_hf():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, _ = left_padded(3, seed=6)
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    out = wrapped.generate(ids, max_new_tokens=10, prompt_lookup_num_tokens=4)
    assert torch.equal(ref, out)


def test_return_dict_carries_stats():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(2)
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=4, return_dict_in_generate=True)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out, hf_plookup.PlookupGenerateOutput)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats is wrapped.last_stats and out.stats.num_sequences == 2 and out.stats.k == 4
    assert out.stats.wall_time > 0 and out.stats.forwards >= 1


def test_batch_prompt_lookup_beyond_hf():
    """HF refuses prompt lookup for batch > 1; we run it, and equal HF greedy row by row."""
    model = tiny_model("qwen3")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(4, seed=12)
    with pytest.raises(ValueError):
        model.generate(ids, attention_mask=mask, max_new_tokens=5, prompt_lookup_num_tokens=4)
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=12, prompt_lookup_num_tokens=4)
    for i in range(4):
        row = ids[i : i + 1, mask[i].bool()]
        ref = model.generate(row, max_new_tokens=12, prompt_lookup_num_tokens=4, do_sample=False)
        got = out[i, ids.shape[1] :]
        assert torch.equal(ref[0, row.shape[1] :], got[: ref.shape[1] - row.shape[1]])


def test_numpy_history_unaffected_by_int32_inputs():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(2)
    out = wrapped.generate(ids.to(torch.int32), attention_mask=mask, max_new_tokens=6)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out.dtype == torch.int32 and np.array_equal(out.numpy(), ref.numpy())
