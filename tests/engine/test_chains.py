"""engine.chains and the batch's compiled helpers, each against the plain functions it stands for:
the drafts' chances (acceptance_estimate, chain_chances), the walk and the appended tokens
(accept_paths, Sequence.append), the counts (SpecStats.count_verify, count_emitted), the drafts
stored in the batch (store_drafts)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_plookup.drafting.tree import acceptance_estimate
from hf_plookup.drafting.verify import accept_paths, chain_parents
from hf_plookup.engine.batch import store_drafts
from hf_plookup.engine.chains import accept_chains, chain_chances_of, count_chain_rows
from hf_plookup.engine.sequence import Sequence
from hf_plookup.engine.widths import chain_chances
from hf_plookup.stats import SpecStats


def test_chain_chances_of_literal_and_against_the_plain_functions():
    n_accepted, n_rejected = np.array([0, 6, 100]), np.array([0, 2, 1])
    got = chain_chances_of(n_accepted, n_rejected, np.array([1]), 3)
    assert got[0] == pytest.approx([9.2 / 12, (9.2 / 12) ** 2, (9.2 / 12) ** 3])
    rng = np.random.default_rng(0)
    for _ in range(50):
        acc, rej = rng.integers(0, 200, 16), rng.integers(0, 200, 16)
        rows = rng.permutation(16)[: rng.integers(0, 16)]
        k = int(rng.integers(1, 9))
        want = chain_chances(acceptance_estimate(acc[rows], rej[rows]), k)
        np.testing.assert_allclose(chain_chances_of(acc, rej, rows, k), want, rtol=1e-15, atol=0)


def _reference(targets, n_pos, rows, drafts, history, seqs, eos):
    """accept_paths on chains, then Sequence.append, row by row (what Batch._commit does)."""
    offsets = np.cumsum(n_pos) - n_pos
    k = drafts.shape[1]
    accepted, paths, final = accept_paths(targets, offsets, n_pos - 1, drafts[rows],
                                          np.tile(chain_parents(k), (len(rows), 1)))
    emitted = []
    for i, seq in enumerate(seqs):
        tokens = [int(drafts[rows[i], p - 1]) for p in paths[i, : accepted[i]]] + [int(final[i])]
        emitted.append(seq.append(history, tokens, eos))
    return accepted, np.array(emitted), np.array([s.finished for s in seqs])


def _run(scores, given, n_pos, rows, drafts, history, seqs, eos, n_acc, n_rej):
    out = [np.empty(len(rows), dtype=np.int64), np.empty(len(rows), dtype=np.int64), np.empty(len(rows), dtype=bool)]
    accept_chains(scores, given, n_pos, rows, drafts, history, np.array([s.num_tokens for s in seqs]),
                  np.array([s.remaining for s in seqs]), np.array(sorted(eos), dtype=np.int64), n_acc, n_rej, *out)
    return out


def test_accept_chains_literal():
    """Row 1 fed drafts [5, 6, 7] and its positions emit 5, 6, 9, 8: two accepted, then 9; row 0
    fed none and emits 4, its stop token."""
    history = np.zeros((2, 12), dtype=np.int64)
    drafts = np.array([[-1, -1, -1], [5, 6, 7]])
    seqs = [Sequence(0, 0, 3, 10), Sequence(1, 1, 4, 10)]
    targets = np.array([[4], [5], [6], [9], [8]])
    n_acc, n_rej = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    accepted, emitted, finished = _run(targets, True, np.array([1, 4]), np.array([0, 1]), drafts, history, seqs,
                                       frozenset({4}), n_acc, n_rej)
    assert accepted.tolist() == [0, 2] and emitted.tolist() == [1, 3] and finished.tolist() == [True, False]
    assert history[0, 3] == 4 and history[1, 4:7].tolist() == [5, 6, 9]
    assert n_acc.tolist() == [0, 2] and n_rej.tolist() == [0, 1]  # row 1 rejected its third draft


@pytest.mark.parametrize("given", [True, False])
def test_accept_chains_against_accept_paths_and_append(given):
    rng = np.random.default_rng(1 + given)
    for _ in range(200):
        b, k, v = int(rng.integers(1, 9)), int(rng.integers(1, 6)), 6
        rows = rng.permutation(b + 2)[:b]
        drafts = rng.integers(0, v, (b + 2, k))
        n_pos = rng.integers(1, k + 2, b)
        seqs = [Sequence(i, int(r), int(rng.integers(1, 5)), int(rng.integers(1, 8))) for i, r in enumerate(rows)]
        for s in seqs:
            s.num_tokens += int(rng.integers(0, s.max_new_tokens))
        logits = rng.normal(size=(int(n_pos.sum()), v)).astype(np.float32)
        logits[rng.random(len(logits)) < 0.5, 0] = 9.0  # ties and repeats: argmax takes the first
        logits[:, 1] = logits[:, 0]
        targets = logits.argmax(axis=-1)
        eos = frozenset(rng.choice(v, int(rng.integers(0, 3)), replace=False).tolist())
        history = rng.integers(0, v, (b + 2, 30))
        ref_seqs = [Sequence(s.seq_id, s.row, s.prompt_len, s.max_new_tokens, s.num_tokens) for s in seqs]
        ref_history = history.copy()
        want = _reference(targets, n_pos, rows, drafts, ref_history, ref_seqs, eos)
        n_acc, n_rej = np.zeros(b + 2, dtype=np.int64), np.zeros(b + 2, dtype=np.int64)
        scores = targets[:, None] if given else logits
        got = _run(scores, given, n_pos, rows, drafts, history, seqs, eos, n_acc, n_rej)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(history, ref_history)
        np.testing.assert_array_equal(n_acc[rows], want[0])
        np.testing.assert_array_equal(n_rej[rows], want[0] < n_pos - 1)


def test_count_chain_rows_literal_and_against_spec_stats():
    got, want = SpecStats(), SpecStats()
    got.resize(4)
    want.resize(4)
    count_chain_rows(got, np.array([5, 3]), np.array([2, 0]), np.array([3, 1]))
    assert (got.drafted, got.accepted, got.verify_steps, got.row_steps, got.new_tokens) == (6, 2, 2, 2, 4)
    assert got.accepted_hist == [1, 0, 1, 0, 0]
    assert got.drafted_per_position == [2, 2, 1, 1] and got.accepted_per_position == [1, 1, 0, 0]
    rng = np.random.default_rng(3)
    for k in (0, 1, 4, 8):
        got, want = SpecStats(), SpecStats()
        got.resize(k)
        want.resize(k)
        for _ in range(20):
            n = int(rng.integers(1, 70))
            n_pos = rng.integers(1, k + 2, n)
            accepted = np.array([rng.integers(0, m) for m in n_pos])
            emitted = accepted + 1 - (rng.random(n) < 0.2) * accepted
            count_chain_rows(got, n_pos, accepted, emitted)
            for m, a, e in zip(n_pos.tolist(), accepted.tolist(), emitted.tolist()):
                want.count_verify(m - 1, a, m - 1)
                want.count_emitted(e)
        assert got == want


def test_store_drafts_literal():
    history = np.zeros((2, 8), dtype=np.int64)
    batch_drafts, batch_num = np.full((2, 3), -1, dtype=np.int64), np.zeros(2, dtype=np.int64)
    num = np.array([3])
    store_drafts(history, np.array([1]), np.array([3]), np.array([[7, 8, 9]]), num, 2, batch_drafts, batch_num)
    assert num.tolist() == [2] and batch_num.tolist() == [0, 2]
    assert batch_drafts.tolist() == [[-1, -1, -1], [7, 8, 9]]
    assert history[1].tolist() == [0, 0, 0, 7, 8, 0, 0, 0] and not history[0].any()
