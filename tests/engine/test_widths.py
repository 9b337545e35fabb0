"""engine.widths: the width of uniform verify steps from measured step costs, on literal cases, and
in the engine (its static-buffer step path, run on CPU: the one CUDA graphs replay)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_plookup.steps.graphs import GraphRunner, batch_bucket, dummy_layout, pad_layout
from hf_plookup.engine.widths import (StepCosts, candidate_widths, chain_chances, choose_width, expected_tokens,
                                     expected_tokens_by_width)
from tests.conftest import left_padded, tiny_model, wrap_copy


def test_candidates_and_expected_tokens():
    assert candidate_widths(8) == (1, 5, 9) and candidate_widths(4) == (1, 3, 5) and candidate_widths(2) == (1, 3)
    assert candidate_widths(1) == (1, 2)
    assert candidate_widths(8, nodes=16) == (1, 5, 9, 17) and candidate_widths(4, nodes=4) == (1, 3, 5)
    with pytest.raises(ValueError, match="k must be >= 1"):
        candidate_widths(0)
    with pytest.raises(ValueError, match="nodes must be >= 0"):
        candidate_widths(4, nodes=-1)
    assert np.allclose(chain_chances(np.array([0.5]), 3), [[0.5, 0.25, 0.125]])
    chances = chain_chances(np.array([0.5, 0.8]), 4)
    assert expected_tokens(chances, np.array([4, 1]), 3) == pytest.approx(3.55)
    assert expected_tokens(chances, np.array([4, 1]), 1) == pytest.approx(2.0)  # plain decoding
    # a tree's nodes, best first, by their own chances (not powers of one rate)
    tree = np.array([[0.6, 0.3, 0.3, 0.1, 0.0]])
    assert expected_tokens(tree, np.array([4]), 3) == pytest.approx(1.9)
    assert expected_tokens(tree, np.array([4]), 17) == pytest.approx(2.3)


def test_expected_tokens_by_width_is_expected_tokens_of_each_width():
    chances = chain_chances(np.array([0.5, 0.8]), 4)
    assert expected_tokens_by_width(chances, np.array([4, 1]), 3) == pytest.approx([2.0, 3.3, 3.55])
    tree = np.array([[0.6, 0.3, 0.3, 0.1, 0.0]])
    assert expected_tokens_by_width(tree, np.array([4]), 7)[[2, 6]] == pytest.approx([1.9, 2.3])
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, k, widest = int(rng.integers(0, 70)), int(rng.integers(1, 17)), int(rng.integers(1, 20))
        chances, drafts = rng.random((b, k)), rng.integers(0, k + 1, b)
        want = [expected_tokens(chances, drafts, w) for w in range(1, widest + 1)]
        assert np.allclose(expected_tokens_by_width(chances, drafts, widest), want, rtol=1e-12, atol=1e-12)


def test_step_costs_follow_their_steps():
    c = StepCosts(weight=0.5)
    assert c.get(5, 16) is None
    c.record(5, 16, 4.0)
    c.record(5, 16, 2.0)
    assert c.get(5, 16) == pytest.approx(3.0) and c.get(5, 1) is None
    given = StepCosts.given({(1, 1): 3e-3, (5, 1): 4e-3})
    given.record(5, 1, 1.0)  # given costs stay as given
    assert given.get(5, 1) == 4e-3 and given.get(9, 1) is None
    with pytest.raises(ValueError, match="weight"):
        StepCosts(weight=0.0)


def test_choose_width():
    c = StepCosts()
    one_row = dict(chances=chain_chances(np.array([0.5]), 8), drafts=np.array([8]))
    assert choose_width(c, 1, (1, 5, 9), **one_row) == 9  # nothing measured: the widest first
    c.record(9, 1, 4.8e-3)
    assert choose_width(c, 1, (1, 5, 9), **one_row) == 5  # then the next one not yet measured
    c.record(5, 1, 3.6e-3)
    c.record(1, 1, 3.0e-3)
    assert choose_width(c, 1, (1, 5, 9), **one_row) == 5  # 0.54 tokens a ms against 0.33 and 0.42
    assert choose_width(c, 1, (1, 5, 9), chain_chances(np.array([0.95]), 8), np.array([8])) == 9  # a row that copies
    assert choose_width(c, 1, (1, 5, 9), chain_chances(np.array([0.5]), 8), np.array([0])) == 1  # no drafts: plain decoding
    flat = StepCosts()
    for q in (1, 5, 9):
        flat.record(q, 1, 3.0e-3)
    assert choose_width(flat, 1, (1, 5, 9), chain_chances(np.array([0.9]), 8), np.array([6])) == 9  # width 9 holds 6 drafts
    # a tree of 16 nodes: width 17 pays where its step costs little more than 9 tokens' and the
    # nodes past the eighth are likely enough, and not where it costs half as much again
    tree = np.concatenate([np.full(8, 0.5), np.full(8, 0.3)])[None, :]
    for q, s in ((1, 3.0e-3), (5, 3.5e-3), (9, 3.6e-3)):
        flat.record(q, 2, s)
    flat.record(17, 2, 3.8e-3)
    assert choose_width(flat, 2, (1, 5, 9, 17), tree, np.array([16])) == 17  # 7.4 / 3.8 against 5 / 3.6
    flat.record(17, 4, 5.4e-3)
    for q, s in ((1, 3.0e-3), (5, 3.5e-3), (9, 3.6e-3)):
        flat.record(q, 4, s)
    assert choose_width(flat, 4, (1, 5, 9, 17), tree, np.array([16])) == 9
    assert choose_width(c, 16, (1, 5, 9), **one_row) == 9  # another bucket: measured apart


def _engine_with_widths(model, costs=None):
    w = wrap_copy(model, max_cache_tokens=4096, block_size=16, pad_drafts=True)
    eng = w._engine
    eng._graphs = GraphRunner(w, eng.cache(), "sdpa", eng.options.max_num_seqs, capture=False)
    eng.width_policy = True
    if costs is not None:
        eng.step_costs = costs
    return w


@pytest.mark.parametrize("batch", [1, 3])
def test_engine_steps_take_the_chosen_width_and_stay_exact(batch):
    model = tiny_model("llama")
    ids, mask = left_padded(batch, seed=7)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    kw = dict(attention_mask=mask, max_new_tokens=24, prompt_lookup_num_tokens=8)

    w = _engine_with_widths(model)  # nothing measured: each width is tried, then judged
    assert torch.equal(w.generate(ids, **kw), ref)
    measured = {q for q, b in w._engine.step_costs.seconds if b == batch_bucket(batch)}
    assert len(measured) >= 2 and measured <= {1, 5, 9}
    assert w._engine.acceptance["tree"].fed.sum() == 0  # chains take their rows' rates: nothing counted

    # costs given, which the run's own steps leave alone, so they decide alone
    bb = batch_bucket(batch)
    wide_is_dear = StepCosts.given({(1, bb): 1.0, (5, bb): 100.0, (9, bb): 100.0})
    w = _engine_with_widths(model, wide_is_dear)
    assert torch.equal(w.generate(ids, **kw), ref)
    assert w.last_stats.drafted == 0 and w.last_stats.decode_steps_by_path == {"static": w.last_stats.decode_steps}

    wide_is_cheap = StepCosts.given({(q, bb): 1.0 for q in (1, 5, 9)})
    w = _engine_with_widths(model, wide_is_cheap)
    assert torch.equal(w.generate(ids, **kw), ref)
    plain = wrap_copy(model, max_cache_tokens=4096, block_size=16, pad_drafts=True)
    plain.generate(ids, **kw)
    # wide steps cost no more: every step feeds all its rows' drafts, as without the policy
    assert w.last_stats.drafted == plain.last_stats.drafted > 0
    assert {key[0] for key in w._engine._graphs.graphs} <= {1, 5, 9}


@pytest.mark.parametrize("nodes", [0, 16])
def test_a_bucket_builds_every_width_of_the_call_at_once(nodes):
    """The first step in a (batch bucket, context bucket) builds that bucket's step at each width the
    call chooses among (captured together on CUDA), so later steps, whichever width their timings
    pick, find theirs built; a call without drafts builds only its own width."""
    model = tiny_model("llama")
    ids, mask = left_padded(3, seed=5)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    w = _engine_with_widths(model)
    out = w.generate(ids, attention_mask=mask, max_new_tokens=24, prompt_lookup_num_tokens=8,
                     prompt_lookup_tree_nodes=nodes or None)
    assert torch.equal(out, ref)
    graphs = w._engine._graphs
    buckets = {key[1:] for key in graphs.graphs}
    assert len(buckets) >= 2  # the batch bucket shrank or the context crossed a bucket
    widths = candidate_widths(8, nodes)
    assert graphs.widths == widths and sorted(graphs.graphs) == sorted((q, *b) for q in widths for b in buckets)
    built = len(graphs.graphs)
    w.generate(ids, attention_mask=mask, max_new_tokens=24)  # plain decoding: its own width, 1, alone
    assert graphs.widths == () and all(key[0] == 1 for key in list(graphs.graphs)[built:])


def test_trees_take_widths_wider_than_a_page_and_stay_exact():
    """Candidate trees of 16 nodes (17 tokens a row, pages of 8) on the static-buffer step path:
    each width up to the whole tree is tried and judged like a chain's, the steps stay on the
    padded path (dummy rows wrap in the scratch page), and the tokens are HF greedy's."""
    model = tiny_model("llama")
    ids, mask = left_padded(3, seed=11)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    w = wrap_copy(model, max_cache_tokens=4096, block_size=8, pad_drafts=True)
    eng = w._engine
    eng._graphs = GraphRunner(w, eng.cache(), "sdpa", eng.options.max_num_seqs, capture=False)
    eng.width_policy = True
    out = w.generate(ids, attention_mask=mask, max_new_tokens=24, prompt_lookup_num_tokens=8,
                     prompt_lookup_tree_nodes=16)
    assert torch.equal(out, ref)
    s = w.last_stats
    assert s.decode_steps_by_path == {"static": s.decode_steps} and s.eager_reasons == {}
    assert {q for q, _ in eng.step_costs.seconds} <= {1, 5, 9, 17} and 17 in {key[0] for key in eng._graphs.graphs}
    assert all(key[3] for key in eng._graphs.graphs if key[0] > 1)  # drafts fed as trees
    assert eng.acceptance["tree"].fed.sum() == s.drafted > 0  # every fed node's outcome counted


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_a_bucket_of_dummy_rows_runs_and_writes_only_the_scratch_page(invariant, tree):
    """What a width's capture runs before any step of that width (its warm-up forward): the model
    on a bucket of dummy rows only gives logits for every slot and leaves every page but the
    scratch page as it was."""
    model = tiny_model("llama")
    w = wrap_copy(model, max_cache_tokens=256, block_size=16, pad_drafts=True, invariant=invariant)
    eng = w._engine
    cache = eng.cache()
    runner = GraphRunner(w, cache, "sdpa", eng.options.max_num_seqs, capture=False, invariant=eng.invariant)
    for k in cache.keys + cache.values:
        k.normal_()
    before = [t[: cache.scratch_block].clone() for t in cache.keys + cache.values]
    padded = pad_layout(dummy_layout(5, tree), 4, 64, cache.block_size, cache.scratch_block)
    logits = runner._forward(runner._static(padded))
    assert logits.shape == (4 * 5, model.config.vocab_size) and torch.isfinite(logits).all()
    assert all(torch.equal(t[: cache.scratch_block], b) for t, b in zip(cache.keys + cache.values, before))
