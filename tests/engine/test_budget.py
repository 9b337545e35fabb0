"""engine.budget: how many drafts eager steps feed, from measured step costs and the acceptance of
drafts by score, on literal cases and in the engine (costs given by hand, so that nothing here
depends on how fast this machine runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_plookup.engine.budget import FIXED_TOKENS, PRIOR_SLOPE, Acceptance, DraftBudget, FedCosts, choose_drafts, fed_bucket
from tests.conftest import left_padded, tiny_model, wrap_copy


def test_fed_buckets():
    assert [fed_bucket(n) for n in (1, 9, 16, 17, 24, 25, 128, 129, 160, 161, 512, 513, 600, 641)] == \
        [1, 9, 16, 17, 17, 25, 121, 129, 129, 161, 481, 513, 513, 641]


def test_fed_costs_interpolate_and_extrapolate_by_the_prior_shape():
    c = FedCosts()
    assert c.seconds(np.array([1, 5])).tolist() == [FIXED_TOKENS + 1, FIXED_TOKENS + 5]  # nothing measured: the shape
    c = FedCosts.given({1: 10.0, 5: 14.0})
    got = c.seconds(np.array([1, 3, 5, 9]))
    assert got[:3].tolist() == pytest.approx([10.0, 12.0, 14.0])
    assert got[3] == pytest.approx(14.0 * (FIXED_TOKENS + 9) / (FIXED_TOKENS + 5))  # past the measured counts
    c.record(3, 99.0)  # given costs: a step recorded later changes nothing
    assert c.seconds(np.array([3])).tolist() == pytest.approx([12.0]) and 3 not in c.steps
    assert FedCosts.given({1: 0.02, 5: 0.024}).seconds(np.array([3])).tolist() == pytest.approx([0.022])  # the docstring's
    r = FedCosts(keep=3)
    for n, t in ((3, 1.0), (3, 4.0), (3, 50.0), (3, 3.0), (5, 1.0), (5, 2.0), (7, 9.0)):  # 50: held up
        r.record(n, t)
    xs, ys = r.points()
    # the fastest of the last 3 at 3 tokens; 5 tokens never cheaper; 7 measured once, not yet counted
    assert xs.tolist() == [3.0, 5.0] and ys.tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="keep"):
        FedCosts(keep=0)


def test_acceptance_prior_counts_and_monotone_chances():
    a = Acceptance()
    assert a.chances(np.array([0.5]))[0] == pytest.approx(PRIOR_SLOPE * 0.625)  # the docstring's example
    a.record(np.full(8, 0.5), np.array([True] + [False] * 7))
    assert a.chances(np.array([0.5]))[0] == pytest.approx(0.25)
    # a bin that fared worse than the one below it takes that one's chance: a higher score never means less
    a.record(np.full(400, 0.9), np.zeros(400, dtype=bool))
    low = a.chances(np.array([0.5]))[0]
    assert a.chances(np.array([0.9]))[0] == low
    assert a.chances(np.array([0.0, 0.02, 1.0])).shape == (3,)


def test_choose_drafts_literal_cases():
    step = FedCosts.given({1: 10.0, 2: 11.0, 3: 12.0, 4: 16.0})
    assert choose_drafts(np.array([[0.6, 0.3, 0.1]]), np.array([3]), step).tolist() == [2]  # the docstring's example
    assert choose_drafts(np.array([[0.6, 0.3, 0.1]]), np.array([0]), step).tolist() == [0]  # nothing offered
    assert choose_drafts(np.array([[0.05, 0.01, 0.0]]), np.array([3]), step).tolist() == [0]  # nothing pays
    flat = FedCosts.given({1: 10.0, 8: 10.0})
    assert choose_drafts(np.array([[0.6, 0.3, 0.1]]), np.array([3]), flat).tolist() == [3]  # free: all of them
    # two rows: the most likely nodes of the batch, each row a prefix of its own
    two = FedCosts.given({2: 10.0, 3: 10.5, 4: 11.0, 5: 11.5, 6: 20.0})
    got = choose_drafts(np.array([[0.9, 0.2, 0.1], [0.5, 0.4, 0.0]]), np.array([3, 2]), two)
    assert got.tolist() == [1, 2]  # 0.9, 0.5 and 0.4: 3.8 tokens in 11.5, more a second than any other count
    assert choose_drafts(np.zeros((0, 3)), np.zeros(0, dtype=np.int64), two).tolist() == []


def _tiny_copying():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 96, (2, 12), generator=g)
    cont = model.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None)[:, 12:]
    ids = torch.cat([ids, cont, ids[:, :6]], dim=1)  # the rows repeat their own continuation
    return model, ids


@pytest.mark.parametrize("kind, extra", [
    ("tree", {}),                                  # the default under the budget: 2k nodes
    ("tree", {"prompt_lookup_tree_nodes": 8}),
    ("chain", {"repetition_penalty": 1.2}),        # a processor that reads the tokens: chains
])
def test_engine_feeds_by_the_budget_and_stays_exact(kind, extra):
    """Wide steps dear feed nothing, free ones feed every draft (as a min score of 0 does), and the
    tokens are HF greedy's either way; the fed drafts are counted by score."""
    model, ids = _tiny_copying()
    hf = {k: v for k, v in extra.items() if k != "prompt_lookup_tree_nodes"}
    ref = model.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None, **hf)
    kw = dict(max_new_tokens=24, eos_token_id=None, prompt_lookup_num_tokens=6, **extra)

    dear = wrap_copy(model, max_cache_tokens=4096, tree_min_score=None)
    dear._engine.budget.costs = FedCosts.given({2: 1.0, 3: 100.0})
    assert torch.equal(dear.generate(ids, **kw), ref)
    assert dear.last_stats.drafted == 0 and dear._engine.budget.acceptance[kind].fed.sum() == 0
    assert dear.last_stats.drafter == ("ngram-tree" if kind == "tree" else "ngram")

    free = wrap_copy(model, max_cache_tokens=4096, tree_min_score=None)
    free._engine.budget.costs = FedCosts.given({2: 1.0, 26: 1.0})
    assert torch.equal(free.generate(ids, **kw), ref)
    every = wrap_copy(model, max_cache_tokens=4096, tree_min_score=0.0)
    assert every._engine.budget is None
    every.generate(ids, **{"prompt_lookup_tree_nodes": 12, **kw} if kind == "tree" else kw)
    s = free.last_stats
    assert s.drafted == every.last_stats.drafted > 0 and s.accepted > 0
    acc = free._engine.budget.acceptance[kind]
    assert acc.fed.sum() == s.drafted and acc.accepted.sum() == s.accepted


def test_budget_is_kept_across_calls_and_off_where_asked():
    model, ids = _tiny_copying()
    w = wrap_copy(model, max_cache_tokens=4096, tree_min_score=None)
    budget = w._engine.budget
    assert isinstance(budget, DraftBudget)
    kw = dict(max_new_tokens=16, eos_token_id=None, prompt_lookup_num_tokens=4)
    w.generate(ids, **kw)
    measured, fed = dict(budget.costs.steps), budget.acceptance["tree"].fed.sum()
    assert measured and fed == w.last_stats.drafted  # the decode steps were timed, their drafts counted
    w.generate(ids, **kw)
    assert w._engine.budget is budget and set(budget.costs.steps) >= set(measured)
    assert budget.acceptance["tree"].fed.sum() == fed + w.last_stats.drafted
    assert wrap_copy(model, tree_min_score=0.2)._engine.budget is None
    ids1, mask = left_padded(1)
    w.generate(ids1, attention_mask=mask, max_new_tokens=4)  # no drafting: nothing recorded, nothing fails
