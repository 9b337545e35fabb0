"""NgramProposer against a literal plain-Python reference, plus hand-written cases (among them
where the vote of the longest matches departs from HF's most-recent-match rule)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_plookup.drafting.ngram import (
    CHAIN_CANDIDATES,
    CHAIN_SCAN,
    RECENT_WEIGHT,
    RECENT_WINDOW,
    SHORT_WEIGHT,
    NgramProposer,
    match_cap,
    propose_batch,
    vote,
)


def reference_row(tokens, k, max_ngram, min_ngram, max_draft):
    """Literal spec: every earlier occurrence of the last token with its match length (up to
    match_cap(max_ngram), at least min_ngram), newest first, the newest CHAIN_SCAN of them; the
    CHAIN_CANDIDATES longest vote
    (`vote`), in recency order; the draft follows, token by token, the continuation with the most
    votes among the voters that agree with it so far (ties: the newest voter's), capped."""
    t = list(tokens)
    n = len(t)
    cap = min(k, max_draft)
    if cap <= 0 or n < 2:
        return []
    longest = match_cap(max_ngram)
    cands = []  # (continuation start, match length), newest first, among CHAIN_SCAN occurrences
    walked = 0
    for c in range(n - 1, 0, -1):
        if t[c - 1] == t[-1] and walked < CHAIN_SCAN:
            walked += 1
            m = 1
            while m < min(longest, c) and t[c - 1 - m] == t[n - 1 - m]:
                m += 1
            if m >= min_ngram:
                cands.append((c, m))
    if not cands:
        return []
    best = max(m for _, m in cands)
    chosen = sorted(sorted(range(len(cands)), key=lambda i: -cands[i][1])[:CHAIN_CANDIDATES])
    voters = [cands[i] for i in chosen]
    draft = []
    while len(draft) < cap:
        d = len(draft)
        sums = {}  # token -> votes, in the order the voters (newest first) name it
        for c, m in voters:
            if c + d < n:
                w = vote(SHORT_WEIGHT, best - m, c - 1, n - RECENT_WINDOW, RECENT_WEIGHT)
                sums[t[c + d]] = sums.get(t[c + d], 0.0) + w
        if not sums:
            break
        tok = max(sums, key=lambda x: sums[x])  # the first of the heaviest
        draft.append(tok)
        voters = [(c, m) for c, m in voters if c + d < n and t[c + d] == tok]
    return draft


def reference(history, lengths, k, max_ngram, min_ngram, max_drafts):
    out = [reference_row(history[b, :lengths[b]], k, max_ngram, min_ngram, max_drafts[b])
           for b in range(len(lengths))]
    drafts = np.full((len(lengths), k), -1, dtype=np.int64)
    for b, d in enumerate(out):
        drafts[b, :len(d)] = d
    return drafts, np.array([len(d) for d in out], dtype=np.int64)


_PROPOSERS = {}


def proposer(k, max_ngram, min_ngram=1):
    key = (k, max_ngram, min_ngram)
    if key not in _PROPOSERS:
        _PROPOSERS[key] = NgramProposer(k, max_ngram, min_ngram)
    return _PROPOSERS[key]


def check(history, lengths, k, max_ngram, min_ngram, max_drafts):
    p = proposer(k, max_ngram, min_ngram)
    drafts, num = p.propose(history, lengths, max_drafts)
    ref_drafts, ref_num = reference(history, lengths, k, max_ngram, min_ngram, max_drafts)
    np.testing.assert_array_equal(num, ref_num)
    np.testing.assert_array_equal(drafts, ref_drafts)
    assert drafts.dtype == np.int64 and num.dtype == np.int64


@st.composite
def batches(draw, repetitive):
    bsz = draw(st.integers(1, 6))
    k = draw(st.integers(1, 10))
    max_ngram = draw(st.integers(1, 4))
    min_ngram = draw(st.integers(1, max_ngram))
    width = draw(st.integers(1, 40))
    rows, lengths = [], []
    for _ in range(bsz):
        n_len = draw(st.integers(0, width))
        if repetitive:
            phrase = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
            row = (phrase * (width // len(phrase) + 1))[:width]
            for pos in draw(st.lists(st.integers(0, width - 1), max_size=4)):
                row[pos] = draw(st.integers(0, 50))  # noise
        else:
            row = draw(st.lists(st.integers(0, 4), min_size=width, max_size=width))
        garbage = draw(st.integers(0, 4))
        rows.append(row[:n_len] + [garbage] * (width - n_len))  # tail is garbage
        lengths.append(n_len)
    max_drafts = draw(st.lists(st.integers(0, 12), min_size=bsz, max_size=bsz))
    return (np.array(rows, dtype=np.int64), np.array(lengths, dtype=np.int64),
            k, max_ngram, min_ngram, np.array(max_drafts, dtype=np.int64))


_SETTINGS = settings(max_examples=300, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(batches(repetitive=False))
def test_matches_reference_random(case):
    check(*case)


@_SETTINGS
@given(batches(repetitive=True))
def test_matches_reference_repetitive(case):
    check(*case)


def one(tokens, k=4, max_ngram=2, min_ngram=1, max_draft=None):
    p = proposer(k, max_ngram, min_ngram)
    hist = np.array([tokens], dtype=np.int64)
    md = None if max_draft is None else np.array([max_draft], dtype=np.int64)
    drafts, num = p.propose(hist, np.array([len(tokens)], dtype=np.int64), md)
    return drafts[0].tolist(), int(num[0])


def test_most_recent_match_not_earliest():
    # suffix [1, 2] occurs at 0 (-> 3, 4) and at 4 (-> 7, 8): one vote each, the later one wins.
    assert one([1, 2, 3, 4, 1, 2, 7, 8, 1, 2], k=2) == ([7, 8], 2)


def test_longest_ngram_preferred_over_more_recent_shorter():
    # bigram [5, 2] matches at 0 (-> 9); unigram [2] matches more recently at 4 (-> 6).
    assert one([5, 2, 9, 1, 2, 6, 5, 2], k=1, max_ngram=2) == ([9], 1)
    # max_ngram only raises the match cap (match_cap): a smaller one still measures the bigram
    assert one([5, 2, 9, 1, 2, 6, 5, 2], k=1, max_ngram=1) == ([9], 1)


def test_match_measured_past_max_ngram():
    # `7 1 2` matches three suffix tokens at 0-2 (-> 5); `8 1 2` only two, more recently (-> 6):
    # HF's rule with max_ngram 2 sees two equal bigrams and takes the newest (6)
    assert one([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], k=1, max_ngram=2) == ([5], 1)


def test_most_votes_win_over_the_most_recent():
    # the module docstring's example: `1 2` followed twice by `3 1`, most recently by `4 1`
    assert one([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], k=2) == ([3, 1], 2)
    # the vote is per token: after `3`, the voters that drafted it vote again
    assert one([1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3, 6, 1, 2, 4, 1, 2], k=3) == ([3, 6, 1], 3)


def test_recent_occurrences_vote_more():
    # `1 2` followed by 10 four times long ago, by 11 once among the last RECENT_WINDOW tokens:
    # 4 votes to 3; three times long ago: 3 to 3, and the tie goes to the newest (11)
    filler = list(range(100, 140))
    assert one([1, 2, 10] * 4 + filler + [1, 2, 11, 1, 2], k=1) == ([10], 1)
    assert one([1, 2, 10] * 3 + filler + [1, 2, 11, 1, 2], k=1) == ([11], 1)


def test_only_the_newest_chain_scan_occurrences_are_read():
    # `7 8 9 1 2` matches five suffix tokens at the row's start, but after CHAIN_SCAN later `2`s
    # (each matching one token) the scan stops before it
    for fill, want in ((CHAIN_SCAN - 1, 5), (CHAIN_SCAN, 6)):
        assert one([7, 8, 9, 1, 2, 5] + [9, 2, 6] * fill + [7, 8, 9, 1, 2], k=1) == ([want], 1)


def test_shorter_matches_continue_where_the_longest_ends():
    # `0 0 0`: the longest match (ending at 1) is followed by one token before the row ends; the
    # shorter one (ending at 0) goes on for a second draft
    assert one([0, 0, 0], k=2) == ([0, 0], 2)


def test_no_match_gives_zero_and_minus_one_fill():
    assert one([1, 2, 3, 4, 5], k=3) == ([-1, -1, -1], 0)
    assert one([7], k=2) == ([-1, -1], 0)
    assert one([], k=2) == ([-1, -1], 0)
    # min_ngram excludes the unigram match.
    assert one([3, 1, 2, 3], k=2, max_ngram=2, min_ngram=2) == ([-1, -1], 0)


def test_capped_by_max_drafts():
    toks = [1, 2, 3, 4, 5, 6, 1, 2]
    assert one(toks, k=4) == ([3, 4, 5, 6], 4)
    assert one(toks, k=4, max_draft=2) == ([3, 4, -1, -1], 2)
    assert one(toks, k=4, max_draft=0) == ([-1, -1, -1, -1], 0)
    assert one(toks, k=4, max_draft=9) == ([3, 4, 5, 6], 4)


def test_continuation_truncated_at_end_and_may_overlap_suffix():
    assert one([8, 1, 2, 9, 1, 2], k=5) == ([9, 1, 2, -1, -1], 3)
    # the longest match (ending at 2) has one token after it, the next (ending at 1) two and the
    # shortest (ending at 0) three: each draft is voted by the voters left
    assert one([5, 5, 5, 5], k=4, max_ngram=2) == ([5, 5, 5, -1], 3)


def test_garbage_past_length_ignored_and_batch_rows_independent():
    p = proposer(3, 2)
    hist = np.array([[1, 2, 3, 1, 2, 7, 7],
                     [4, 4, 4, 4, 4, 4, 4],
                     [9, 8, 9, 0, 0, 0, 0]], dtype=np.int64)  # [3, 7]
    drafts, num = p.propose(hist, np.array([5, 0, 3]), np.array([3, 3, 3]))
    assert num.tolist() == [3, 0, 2]
    assert drafts.tolist() == [[3, 1, 2], [-1, -1, -1], [8, 9, -1]]


@pytest.mark.parametrize("batch", [3, 40])  # the serial and the parallel kernel
def test_rows_read_in_place_equal_their_copy(batch):
    """`rows`: the drafts of some rows of a larger history, read where they are, are those of
    the same rows copied out."""
    p = proposer(4, 2)
    rng = np.random.default_rng(batch)
    history = rng.integers(0, 4, size=(2 * batch + 1, 50)).astype(np.int64)
    rows = rng.permutation(len(history))[:batch]
    lengths = rng.integers(2, 51, size=batch)
    cap = rng.integers(0, 6, size=batch)
    got = p.propose(history, lengths, cap, rows=rows)
    want = p.propose(history[rows], lengths, cap)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[1].sum() > 0
    h = np.array([[5, 5, 5, 5, 5, 5], [7, 1, 2, 1, 2, 1]])
    assert [a.tolist() for a in p.propose(h, np.array([6]), rows=np.array([1]))] == [[[2, 1, 2, 1]], [4]]
    with pytest.raises(ValueError, match="rows must be"):
        p.propose(h, np.array([6]), rows=np.array([2]))


def test_out_buffers_written_and_views_returned():
    p = proposer(2, 2)
    d_buf = np.full((5, 2), 123, dtype=np.int64)  # [>=B, k]
    n_buf = np.full(5, 123, dtype=np.int64)  # [>=B]
    hist = np.array([[1, 2, 3, 1, 2], [6, 7, 8, 9, 0]], dtype=np.int64)
    drafts, num = p.propose(hist, np.array([5, 5]), out=(d_buf, n_buf))
    assert np.shares_memory(drafts, d_buf) and np.shares_memory(num, n_buf)
    assert drafts.shape == (2, 2) and num.shape == (2,)
    assert d_buf[:2].tolist() == [[3, 1], [-1, -1]] and n_buf[:2].tolist() == [2, 0]
    assert d_buf[2:].tolist() == [[123, 123]] * 3 and n_buf[2:].tolist() == [123] * 3
    with pytest.raises(ValueError, match="out"):
        p.propose(hist, np.array([5, 5]), out=(np.empty((1, 2), np.int64), n_buf))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(k=0), ValueError, "prompt_lookup_num_tokens"),
    (dict(k=2.0), TypeError, "prompt_lookup_num_tokens"),
    (dict(k=True), TypeError, "prompt_lookup_num_tokens"),
    (dict(k=2, max_ngram=0), ValueError, "max_matching_ngram_size"),
    (dict(k=2, max_ngram="3"), TypeError, "max_matching_ngram_size"),
    (dict(k=2, max_ngram=False), TypeError, "max_matching_ngram_size"),
    (dict(k=2, min_ngram=0), ValueError, "min_ngram"),
    (dict(k=2, max_ngram=2, min_ngram=3), ValueError, "max_matching_ngram_size"),
])
def test_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        NgramProposer(**kwargs)


def test_bad_propose_inputs():
    p = proposer(2, 2)
    with pytest.raises(ValueError, match="lengths"):
        p.propose(np.zeros((2, 4), np.int64), np.array([5, 1]))
    with pytest.raises(ValueError, match="max_drafts"):
        p.propose(np.zeros((2, 4), np.int64), np.array([4, 1]), np.array([1]))


def test_compiled_parallel_and_cached():
    assert propose_batch.targetoptions.get("parallel")
    assert propose_batch._cache is not None and type(propose_batch._cache).__name__ != "NullCache"


@pytest.mark.parametrize("batch", [31, 32, 70])
@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_and_serial_kernels_agree_with_reference(batch, parallel):
    """Either kernel, asked for, gives the reference's drafts."""
    rng = np.random.default_rng(batch)
    history = rng.integers(0, 5, size=(batch, 60)).astype(np.int64)
    lengths = rng.integers(0, 61, size=batch).astype(np.int64)
    max_drafts = rng.integers(0, 8, size=batch).astype(np.int64)
    p = proposer(6, 3, 1)
    drafts, num = p.propose(history, lengths, max_drafts, parallel=parallel)
    ref_drafts, ref_num = reference(history, lengths, 6, 3, 1, max_drafts)
    np.testing.assert_array_equal(num, ref_num)
    np.testing.assert_array_equal(drafts, ref_drafts)


def test_parallel_search_needs_rows_and_tokens():
    """The parallel kernel takes batches of PARALLEL_MIN_BATCH rows or more holding
    PARALLEL_MIN_TOKENS tokens or more; smaller searches stay on one thread."""
    from hf_plookup.drafting.ngram import PARALLEL_MIN_BATCH, PARALLEL_MIN_TOKENS, parallel_search

    assert (PARALLEL_MIN_BATCH, PARALLEL_MIN_TOKENS) == (32, 1 << 17)
    assert not parallel_search(np.full(64, 400))  # 25,600 tokens
    assert parallel_search(np.full(64, 4096))  # 262,144 tokens
    assert not parallel_search(np.full(31, 8192))  # too few rows, however long
    assert parallel_search(np.full(32, 4096)) and not parallel_search(np.full(32, 4095))
    assert not parallel_search(np.zeros(0, dtype=np.int64))
