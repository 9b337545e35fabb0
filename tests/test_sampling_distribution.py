"""Sampling with prompt-lookup drafts keeps HF's sampling distribution exactly.

A tiny Llama with an 8-token vocabulary makes the exact distribution of the first four sampled
tokens enumerable: the model is run on the prompt plus every prefix of up to three tokens, HF's
own logits processors are applied (checked against the scores HF's `generate` samples from), and
the joint probability of (t1, t2, t3, t4) is the product of the conditionals. hf_plookup then
samples the prompt repeated N times as one batch and a chi-square goodness-of-fit test compares
the counts of the 8**4 outcomes with the exact probabilities (cells with expected count < 5 pooled,
Monte Carlo p-value); besides, no drawn outcome may have probability 0 (top-k/top-p/min-p filtered).

The prompt contains every token, so the n-gram proposer always has drafts: the first token comes
from the prefill, the next step verifies up to two drafts (and samples a bonus token when both are
accepted). Each case fixes the seed, so a run is deterministic; a correct sampler fails a case
with probability < 1e-3 (over seeds). `test_chi_square_rejects_wrong_samplers` shows, by simulating
plausible wrong samplers over the same exact probabilities and drafts, that the test has the power
to catch them.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_plookup
from hf_plookup.drafting.ngram import NgramProposer
from tests.conftest import tiny_model, wrap_copy

V = 8  # vocabulary size of the model under test (PAD, EOS, BOS = 0, 1, 2 are ordinary tokens here)
PROMPT = [3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5]  # every token occurs: drafts always exist
NEW = 4  # sampled tokens per row; the test covers their joint distribution
N = 1000  # rows sampled per case (one batched generate call)
ALPHA = 1e-3  # a correct sampler fails a case with this probability
K = 4  # prompt_lookup_num_tokens
MAX_NGRAM = 2  # max_matching_ngram_size (HF's default)


class LengthBias(LogitsProcessor):
    """A user processor that looks at the history's length: +bias on token (len % vocab)."""

    def __init__(self, bias: float = 2.0):
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[:, input_ids.shape[1] % scores.shape[1]] += self.bias
        return scores


# case -> generate() kwargs (besides do_sample=True)
CASES = {
    "temperature_0.7": dict(temperature=0.7),
    "temperature_1.3": dict(temperature=1.3),
    "top_k_3": dict(top_k=3),
    "top_p_0.8": dict(top_p=0.8),
    "min_p_0.2": dict(min_p=0.2),
    "repetition_penalty_1.5": dict(repetition_penalty=1.5),
    "user_processor_length": dict(logits_processor=LogitsProcessorList([LengthBias()])),
    "combined": dict(temperature=0.8, top_k=4, top_p=0.9, repetition_penalty=1.2),
}


def _kwargs(case: str) -> dict:
    kw = dict(CASES[case])
    if "logits_processor" in kw:  # a fresh processor object per call
        kw["logits_processor"] = LogitsProcessorList([LengthBias()])
    return kw


def _processors(case: str) -> LogitsProcessorList:
    """HF's processor list for the case, in `_get_logits_processor`'s order: repetition penalty,
    user processors, then the sampling warpers temperature, top-k, top-p, min-p."""
    kw = CASES[case]
    procs = LogitsProcessorList()
    if kw.get("repetition_penalty", 1.0) != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]))
    procs.extend(kw.get("logits_processor", []))
    if kw.get("temperature", 1.0) != 1.0:
        procs.append(TemperatureLogitsWarper(kw["temperature"]))
    procs.append(TopKLogitsWarper(kw.get("top_k", 50)))  # HF's default top_k=50 (a no-op for V=8)
    if kw.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(kw["top_p"]))
    if kw.get("min_p") is not None:
        procs.append(MinPLogitsWarper(kw["min_p"]))
    return procs


@functools.lru_cache(maxsize=1)
def _model():
    return tiny_model("llama", vocab_size=V, seed=1)


def _prefix_inputs(depth: int) -> torch.Tensor:
    """[V**depth, len(PROMPT) + depth]: the prompt followed by every prefix of `depth` tokens,
    in row-major order (row index = np.ravel_multi_index(prefix, (V,) * depth))."""
    pre = torch.tensor(list(itertools.product(range(V), repeat=depth)), dtype=torch.long).reshape(V**depth, depth)
    return torch.cat([torch.tensor([PROMPT]).repeat(V**depth, 1), pre], dim=1)


@functools.lru_cache(maxsize=1)
def _raw_logits() -> tuple[torch.Tensor, ...]:
    """Raw next-token logits after the prompt plus each prefix: depth d -> [V**d, V] float32."""
    model = _model()
    with torch.no_grad():
        return tuple(model(_prefix_inputs(d)).logits[:, -1].float() for d in range(NEW))


@functools.lru_cache(maxsize=None)
def _exact(case: str) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(joint [V]*NEW, probs[d] [V]*(d+1), raw[d] [V]*(d+1)): the exact sampling distribution."""
    raw = _raw_logits()
    procs = _processors(case)
    probs = [
        procs(_prefix_inputs(d), raw[d].clone()).softmax(-1).double().numpy().reshape((V,) * (d + 1))
        for d in range(NEW)
    ]
    joint = probs[0]
    for p in probs[1:]:
        joint = joint[..., None] * p
    return joint, probs, [r.double().numpy().reshape((V,) * (d + 1)) for d, r in enumerate(raw)]


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df >= stat): the regularized upper incomplete gamma Q(df/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)))


def pool_cells(expected: np.ndarray, min_expected: float = 5.0) -> np.ndarray:
    """Group id per cell [C]: cells with expected count >= `min_expected` alone, the others
    pooled into one group (grown from the smallest cell up until it reaches `min_expected`)."""
    order = np.argsort(expected, kind="stable")
    n_small = int((expected < min_expected).sum())
    while 0 < n_small < len(order) and expected[order[:n_small]].sum() < min_expected:
        n_small += 1
    group = np.empty(len(expected), dtype=np.int64)
    group[order[n_small:]] = np.arange(len(order) - n_small)
    group[order[:n_small]] = len(order) - n_small
    return group


def chi_square_test(counts: np.ndarray, probs: np.ndarray, draws: int = 4000, seed: int = 0) -> tuple[float, int, float, float]:
    """Pearson goodness of fit of `counts` to `probs` (same shape), cells with expected count < 5
    pooled. Returns (statistic, df, asymptotic p-value, Monte Carlo p-value).

    With 8**4 cells, most of them tiny, the asymptotic chi-square tail is too light (measured:
    0.13-0.23% of correct samplers below p = 1e-3), so decisions use the Monte Carlo p-value
    (1 + #{null statistics >= observed}) / (draws + 1), whose false-rejection rate is at most the
    threshold by construction; the null statistics come from multinomial draws of the pooled cells.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    group = pool_cells(probs * n)
    e = np.bincount(group, weights=probs * n)
    c = np.bincount(group, weights=counts, minlength=len(e))
    stat = float(((c - e) ** 2 / e).sum())
    df = len(e) - 1
    null = np.random.default_rng(seed).multinomial(int(n), e / e.sum(), size=draws)  # [draws, groups]
    null_stats = ((null - e) ** 2 / e).sum(axis=1)
    p_mc = (1 + int((null_stats >= stat - 1e-9).sum())) / (draws + 1)
    return stat, df, chi2_sf(stat, df), p_mc


def outcome_counts(tokens: np.ndarray) -> np.ndarray:
    """tokens [N, NEW] -> counts [V]*NEW of each outcome."""
    idx = np.ravel_multi_index(tokens.T, (V,) * NEW)
    return np.bincount(idx, minlength=V**NEW).reshape((V,) * NEW)


def check_distribution(tokens: np.ndarray, joint: np.ndarray) -> tuple[float, int]:
    """(Monte Carlo p-value of the fit, number of drawn outcomes that have probability 0)."""
    counts = outcome_counts(tokens)
    impossible = int(counts[joint == 0].sum())
    return chi_square_test(counts, joint)[3], impossible


# ------------------------------------------------------------------------------------------
# A reference speculative sampler over the exact probabilities, right and wrong variants
# ------------------------------------------------------------------------------------------


def simulate(case: str, n: int, seed: int, bug: str | None = None) -> np.ndarray:
    """Sample [n, NEW] tokens the way the engine schedules them (first token from the prefill,
    then steps verifying the proposer's drafts, capped at the tokens still to generate minus
    one, plus a bonus), with the exact conditionals of `case`. `bug` picks a wrong variant:

    - "resample_with_draft": on rejection, sample from p instead of p without the draft;
    - "accept_if_possible": accept a draft whenever p(draft) > 0;
    - "mask_then_warp": on rejection, set the draft's raw logit to -inf, then process/warp
      (top-k/top-p/min-p then keep a token the true distribution excludes);
    - "stale_history": processors of every position in a step see the step's starting history
      (not history + drafts[:j]).
    """
    _, probs, raw = _exact(case)
    procs = _processors(case)
    proposer = NgramProposer(K, MAX_NGRAM)
    rng = np.random.default_rng(seed)
    drafts_cache: dict[tuple, list[int]] = {}

    @functools.cache
    def processed(prefix: tuple, history_len: int, mask: int | None = None) -> np.ndarray:
        logits = torch.from_numpy(raw[len(prefix)][prefix]).float().clone()[None]
        if mask is not None:
            logits[0, mask] = -float("inf")
        ids = torch.tensor([PROMPT + list(prefix[:history_len])])
        return procs(ids, logits).softmax(-1)[0].double().numpy()

    def dist(prefix: tuple, start: int) -> np.ndarray:
        if bug == "stale_history":
            return processed(prefix, start)
        return probs[len(prefix)][prefix]

    def draw(p: np.ndarray) -> int:
        cdf = np.cumsum(p)
        return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), V - 1)

    out = np.zeros((n, NEW), dtype=np.int64)
    for i in range(n):
        gen: list[int] = []
        first = True
        while len(gen) < NEW:
            start = len(gen)
            if first:
                drafts, first = [], False
            else:
                key = tuple(gen)
                if key not in drafts_cache:
                    hist = np.array([PROMPT + gen], dtype=np.int64)
                    d, nd = proposer.propose(hist, np.array([hist.shape[1]]), np.array([NEW - len(gen) - 1]))
                    drafts_cache[key] = [int(x) for x in d[0, : nd[0]]]
                drafts = drafts_cache[key]
            rejected = False
            for d in drafts:
                p = dist(tuple(gen), start)
                if bug == "accept_if_possible" and p[d] > 0:
                    gen.append(d)
                    continue
                if bug != "accept_if_possible" and rng.random() < p[d]:
                    gen.append(d)
                    continue
                if bug in ("resample_with_draft", "accept_if_possible"):
                    gen.append(draw(p))
                elif bug == "mask_then_warp":
                    gen.append(draw(processed(tuple(gen), len(gen), mask=d)))
                else:
                    residual = p.copy()
                    residual[d] = 0.0
                    gen.append(draw(residual) if residual.sum() > 0 else d)
                rejected = True
                break
            if not rejected:
                gen.append(draw(dist(tuple(gen), start)))
        out[i] = gen
    return out


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wrapped():
    return hf_plookup.wrap(_model(), max_cache_tokens=N * 32, block_size=8, max_num_seqs=N, max_batch_tokens=N * 24,
                           tree_min_score=0.0)  # every draft fed: the drafts are what is tested


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_hf_scores(case):
    """The enumerated conditionals are exactly what HF's `generate` samples from (its processed
    `scores`), after the prompt and after each one-token prefix."""
    _, probs, _ = _exact(case)
    model = _model()
    for depth in (0, 1):
        ids = _prefix_inputs(depth)
        with torch.random.fork_rng():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=True,
                                 eos_token_id=None, output_scores=True, return_dict_in_generate=True, **_kwargs(case))
        hf = ref.scores[0].softmax(-1).double().numpy()
        ours = probs[depth].reshape(V**depth, V)  # row-major prefixes, as _prefix_inputs
        np.testing.assert_allclose(ours, hf, atol=1e-6, err_msg=f"{case} depth {depth}")
        assert ((ours == 0) == (hf == 0)).all(), f"{case}: filtered tokens differ from HF's"


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampling_distribution_matches_exact(wrapped, case):
    joint, _, _ = _exact(case)
    ids = torch.tensor([PROMPT]).repeat(N, 1)
    torch.manual_seed(20240601)
    out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=True,
                           eos_token_id=None, prompt_lookup_num_tokens=K, **_kwargs(case))
    stats = wrapped.last_stats
    assert stats.delegated is False, stats.delegated_reason
    assert out.shape == (N, len(PROMPT) + NEW)
    assert torch.equal(out[:, : len(PROMPT)], ids)
    assert 0 < stats.accepted < stats.drafted, stats.as_dict()  # drafts both accepted and rejected
    p, impossible = check_distribution(out[:, len(PROMPT) :].numpy(), joint)
    assert impossible == 0, f"{case}: {impossible} samples have probability 0 under HF's processors"
    assert p > ALPHA, f"{case}: Monte Carlo chi-square p-value {p:.3g} (floor 1/4001; acceptance {stats.acceptance_rate:.2f})"


@pytest.mark.parametrize("case", ["temperature_0.7", "top_k_3", "top_p_0.8", "min_p_0.2", "combined"])
def test_tree_sampling_distribution_matches_exact(wrapped, case):
    """The same check with candidate trees (prompt_lookup_tree_nodes): each fed node gets one
    draw and the walk follows matching children. Where a processor looks at the history
    (repetition penalty in "combined") the call keeps one chain, and that must hold too."""
    joint, _, _ = _exact(case)
    ids = torch.tensor([PROMPT]).repeat(N, 1)
    torch.manual_seed(20240602)
    out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=True,
                           eos_token_id=None, prompt_lookup_num_tokens=K, prompt_lookup_tree_nodes=6, **_kwargs(case))
    stats = wrapped.last_stats
    assert stats.delegated is False, stats.delegated_reason
    assert stats.drafter == ("ngram" if "repetition_penalty" in CASES[case] else "ngram-tree")
    assert 0 < stats.accepted < stats.drafted, stats.as_dict()
    p, impossible = check_distribution(out[:, len(PROMPT) :].numpy(), joint)
    assert impossible == 0, f"{case}: {impossible} samples have probability 0 under HF's processors"
    assert p > ALPHA, f"{case} (trees): Monte Carlo chi-square p-value {p:.3g}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_chi_square_rejects_wrong_samplers(case):
    """The test's power: a correct simulated sampler passes, plausible wrong ones fail, with
    the same N and threshold as the engine test."""
    joint, _, _ = _exact(case)
    p, impossible = check_distribution(simulate(case, N, seed=0), joint)
    assert impossible == 0 and p > ALPHA, (case, p)
    bugs = ["resample_with_draft", "accept_if_possible"]
    if any(k in CASES[case] for k in ("top_k", "top_p", "min_p")):
        bugs.append("mask_then_warp")
    if "logits_processor" in CASES[case]:
        bugs.append("stale_history")
    for bug in bugs:
        p, impossible = check_distribution(simulate(case, N, seed=0, bug=bug), joint)
        assert impossible > 0 or p < ALPHA, f"{case}: chi-square misses the {bug} sampler (p={p:.3g})"


def test_chi_square_machinery():
    """chi2 survival function, pooling, and the Monte Carlo p-value's calibration."""
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(chi2_sf(23.209251158954356, 10) - 0.01) < 1e-9
    probs = np.array([0.5, 0.3, 0.19, 0.006, 0.004])
    assert pool_cells(probs * 1000).tolist() == [2, 1, 0, 3, 3]  # the two small cells pooled (expected 10)
    stat, df, p_asym, p_mc = chi_square_test(np.array([500, 300, 190, 6, 4]), probs)
    assert stat == pytest.approx(0.0) and df == 3 and p_asym == pytest.approx(1.0) and p_mc == 1.0
    stat, _, p_asym, p_mc = chi_square_test(np.array([400, 350, 230, 10, 10]), probs)
    assert p_asym < 1e-6 and p_mc == 1 / 4001
    # samples of the right distribution are rejected at about the nominal rate
    rng = np.random.default_rng(0)
    ps = np.array([chi_square_test(rng.multinomial(1000, probs), probs, draws=400, seed=i)[3] for i in range(300)])
    assert 0.02 < (ps <= 0.05).mean() < 0.09


def test_same_seed_same_output_different_seed_differs():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    g = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, 96, (4, 8), generator=g)
    ids = phrase.repeat(1, 3)  # repeats so that drafts are proposed
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=True, temperature=1.5,
              eos_token_id=None, prompt_lookup_num_tokens=4)
    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        outs.append(wrapped.generate(ids, **kw))
        assert wrapped.last_stats.delegated is False, wrapped.last_stats.delegated_reason
        assert wrapped.last_stats.drafted > 0
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])
