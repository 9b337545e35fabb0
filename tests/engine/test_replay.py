"""The live engine's forwards against `eval/draft_replay.py`'s count on the same text.

Greedy verification accepts a draft exactly when it equals the token the row emits next, so a
row's number of forwards is fixed by its text and by what the drafter is given at each step (the
row's tokens so far, its budget near the end of the row, the tree's per-row decay and min score).
`eval.draft_replay.replay` replays a finished text through the drafters offline; the engine must
take exactly as many forwards and feed exactly as many drafts on the text it produced itself,
chains and trees, rows that run to `max_new_tokens` and rows that end at EOS (whose budget is
still their length limit, not where they happened to end). A difference means the live path
(what the engine hands the drafter, budgets, stopping, acceptance record, compaction) drifted
from the drafters' own behaviour, which the replay's published counts pin down.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eval.draft_replay import replay
from hf_plookup import embedded
from hf_plookup.drafting.ngram import NgramProposer
from hf_plookup.drafting.tree import TreeProposer
from tests.conftest import PAD, tiny_model, wrap_copy

# (k, tree nodes): chains of 4 and 8, the 16-node tree at k=8, and small trees, whose
# node budget binds (which nodes are kept then depends on the row's acceptance record)
DRAFTERS = [(4, None), (8, None), (8, 16), (4, 4), (8, 4)]


def _proposer(k: int, nodes: int | None, ngram: int = 2):
    return TreeProposer(k, nodes, ngram) if nodes else NgramProposer(k, ngram)


def _replayed(prompts, outs, k, nodes, max_new_tokens, min_score: float = 0.0):
    """(new tokens, forwards, drafts fed) of the replay summed over rows."""
    tokens = forwards = fed = 0
    for p, o in zip(prompts, outs):
        a, b, _, f = replay(p, o, _proposer(k, nodes), min_score, max_new_tokens=max_new_tokens)
        tokens, forwards, fed = tokens + a, forwards + b, fed + f
    return tokens, forwards, fed


def _live(wrapped, prompts, k, nodes, max_new_tokens, eos):
    """Run the engine on `prompts` (left-padded); (its rows' new tokens, the call's stats)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, prompt_lookup_num_tokens=k, eos_token_id=eos,
              pad_token_id=PAD)
    if nodes:
        kw["prompt_lookup_tree_nodes"] = nodes
    out = wrapped.generate(ids, attention_mask=mask, **kw)[:, width:]
    stats = wrapped.last_stats
    assert not stats.delegated and stats.drafter == ("ngram-tree" if nodes else "ngram")
    rows = []
    for row in out.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row[: max_new_tokens])
    assert sum(len(r) for r in rows) == stats.new_tokens
    return rows, stats


def _branching_prompt(model, seed: int) -> list[int]:
    """Four phrases that end in the same two tokens, each followed by the model's own greedy
    continuation of it, then two of them again: the row's suffix has earlier occurrences with
    different continuations (trees branch, the node budget binds and the row's acceptance record
    decides which nodes are kept), and the model continues as it did before (drafts are accepted)."""
    g = torch.Generator().manual_seed(seed)
    last2 = torch.randint(3, 96, (2,), generator=g)
    segments = []
    for _ in range(4):
        p = torch.randint(3, 96, (1, 6), generator=g)
        p[0, -2:] = last2
        cont = model.generate(p, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=PAD)[0, 6:]
        segments.append(p[0].tolist() + cont.tolist())
    return sum(segments, []) + segments[1] + segments[0][:6]


@pytest.fixture(scope="module")
def copying():
    """A sliding-window model (it sees its last 4 tokens, so its greedy text keeps returning to
    the same runs) and three branching prompts of different lengths."""
    model = tiny_model("mistral", sliding_window=4)
    prompts = [_branching_prompt(model, seed) for seed in (0, 2, 3)]
    prompts[1] = prompts[1][5:]  # rows of different lengths
    return model, wrap_copy(model, max_cache_tokens=4096, block_size=8, tree_min_score=0.0), prompts


@pytest.mark.parametrize("k, nodes", DRAFTERS)
@pytest.mark.parametrize("batch", [1, 3])
def test_live_forwards_equal_replay(copying, k, nodes, batch):
    """Rows that run to max_new_tokens (47: the last steps' budget cuts drafts short)."""
    _, wrapped, prompts = copying
    prompts = prompts[:batch]
    outs, stats = _live(wrapped, prompts, k, nodes, 47, None)
    assert stats.accepted >= 9 * batch, stats.as_dict()  # the text is copied: drafts matter here
    tokens, forwards, fed = _replayed(prompts, outs, k, nodes, 47)
    assert (stats.new_tokens, stats.row_steps, stats.drafted) == (tokens, forwards, fed), stats.as_dict()
    assert stats.tokens_per_forward == tokens / forwards


@pytest.mark.parametrize("nodes", [None, 16])
def test_live_forwards_equal_replay_with_a_budget(copying, nodes):
    """A min score (the CPU's budget, here given by hand so the batch does not scale it): chains
    are cut by the row's acceptance record (drafting.tree.chain_budget) and trees drop nodes, in
    the engine as in the replay; the budget feeds fewer drafts than none."""
    model, _, prompts = copying
    wrapped = wrap_copy(model, max_cache_tokens=4096, block_size=8, tree_min_score=0.5)
    outs, stats = _live(wrapped, prompts[:1], 8, nodes, 47, None)
    tokens, forwards, fed = _replayed(prompts[:1], outs, 8, nodes, 47, min_score=0.5)
    assert (stats.new_tokens, stats.row_steps, stats.drafted) == (tokens, forwards, fed), stats.as_dict()
    assert fed < _replayed(prompts[:1], outs, 8, nodes, 47)[2]


@pytest.mark.parametrize("k, nodes", DRAFTERS)
def test_live_forwards_equal_replay_when_eos_ends_the_row(copying, k, nodes):
    """A row that stops at EOS long before max_new_tokens: its drafts were capped by the length
    limit (48), which the replay is given (capped at the text's own end instead, the replay feeds
    fewer drafts near the end, and on real text can take a different number of forwards)."""
    _, wrapped, prompts = copying
    plain, _ = _live(wrapped, prompts[:1], k, nodes, 48, None)
    eos = plain[0][20]  # a token the row reaches about halfway (its first occurrence ends the row)
    outs, stats = _live(wrapped, prompts[:1], k, nodes, 48, eos)
    assert outs[0][-1] == eos and len(outs[0]) < 48
    tokens, forwards, fed = _replayed(prompts[:1], outs, k, nodes, 48)
    assert (stats.new_tokens, stats.row_steps, stats.drafted) == (tokens, forwards, fed), stats.as_dict()


@pytest.mark.slow
def test_smollm2_live_tokens_per_forward_equal_replay():
    """SmolLM2-135M-Instruct, fp32, batch 1, one builtin document: chain k=8 and the 16-node tree
    (tree_min_score=0) take the replay's forwards on the text they produced."""
    name = "smollm2-135m"
    if not embedded.is_available(name):
        pytest.skip(f"{name} package not installed")
    from eval.bench import builtin_prompts

    model, tokenizer = embedded.load_embedded(name, dtype=torch.float32)
    wrapped = wrap_copy(model, tree_min_score=0)
    prompt = builtin_prompts(tokenizer, 1)[0]
    eos = int(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, int)
              else model.generation_config.eos_token_id[0])
    for k, nodes in ((8, None), (8, 16)):
        outs, stats = _live(wrapped, [prompt], k, nodes, 64, eos)
        tokens, forwards, fed = _replayed([prompt], outs, k, nodes, 64)
        assert (stats.new_tokens, stats.row_steps, stats.drafted) == (tokens, forwards, fed), (k, nodes, stats.as_dict())
        assert stats.tokens_per_forward > 1.5


def test_within_document_oracle_literal_cases():
    from eval.draft_replay import oracle

    assert oracle([5, 6, 7, 5], [6, 7, 9], k=4) == (3, 2)  # the docstring's example
    assert oracle([1, 2, 3, 4, 1], [2, 3, 4, 1, 2], k=8) == (5, 2)  # all four drafts from position 1
    assert oracle([1, 2, 3, 4, 1], [2, 3, 4, 1, 2], k=2) == (5, 3)  # two at a time
    assert oracle([1, 2, 3], [4, 5, 6], k=4) == (3, 3)  # nothing repeats: one token a forward
    # a row's last token is not drafted past its limit: 2 tokens left, at most 1 draft
    assert oracle([1, 2, 3, 1], [2, 3], k=4, max_new_tokens=2) == (2, 2)


def test_live_forwards_equal_replay_under_the_draft_budget(copying):
    """The default CPU budget (engine.budget), with step costs given by hand so nothing depends on
    this machine: the engine and the replay feed the same drafts and take the same forwards, the
    acceptance record learned the same way, step by step (the default tree of 2k nodes)."""
    from hf_plookup.engine.budget import DraftBudget, FedCosts

    model, _, prompts = copying
    costs = FedCosts.given({1: 1.0, 2: 1.04, 3: 1.09, 5: 1.3, 9: 1.9, 17: 3.4})
    wrapped = wrap_copy(model, max_cache_tokens=4096, block_size=8, tree_min_score=None)
    wrapped._engine.budget.costs = costs
    width = len(prompts[0])
    out = wrapped.generate(torch.tensor([prompts[0]]), max_new_tokens=47, do_sample=False, prompt_lookup_num_tokens=8,
                           eos_token_id=None, pad_token_id=PAD)[0, width:].tolist()
    stats = wrapped.last_stats
    assert stats.drafter == "ngram-tree" and 0 < stats.drafted and stats.accepted >= 9
    budget = DraftBudget()
    budget.costs = costs
    tokens, forwards, _, fed = replay(prompts[0], out, TreeProposer(8, 16, 2), max_new_tokens=47, budget=budget)
    assert (stats.new_tokens, stats.row_steps, stats.drafted) == (tokens, forwards, fed), stats.as_dict()
    every = _replayed(prompts[:1], [out], 8, 16, 47)[2]
    assert fed < every  # the budget left drafts out
    live = wrapped._engine.budget.acceptance["tree"]
    assert (live.fed == budget.acceptance["tree"].fed).all() and (live.accepted == budget.acceptance["tree"].accepted).all()


@pytest.mark.parametrize("nodes", [4, 16])
def test_live_forwards_equal_replay_with_recycled_successors(copying, monkeypatch, nodes):
    """draft_recycled (drafting.recycle): the engine writes each verified position's top-ranked
    successors into its table; the replay, given those same rows in position order, drafts the
    same trees and takes the same forwards; last_stats counts the accepted drafts by source."""
    from hf_plookup.drafting.recycle import SuccessorTable

    model, wrapped, prompts = copying
    log = []
    update = SuccessorTable.update
    monkeypatch.setattr(SuccessorTable, "update", lambda self, tokens, top: (log.append((tokens, top)),
                                                                              update(self, tokens, top))[1])
    ids = torch.tensor([prompts[0]])
    out = wrapped.generate(ids, max_new_tokens=47, do_sample=False, prompt_lookup_num_tokens=8,
                           prompt_lookup_tree_nodes=nodes, draft_recycled=4, eos_token_id=None,
                           pad_token_id=PAD)[0, ids.shape[1]:].tolist()
    stats = wrapped.last_stats
    assert stats.drafter == "ngram-tree" and stats.accepted >= 9
    by_source = stats.accepted_by_source
    assert by_source["text"] + by_source["recycled"] == stats.accepted
    assert (by_source["recycled"] > 0) == (nodes == 16), by_source  # 4 nodes: the text's candidates fill them
    # the engine updated the table once per forward, at the prompt's last position and then at
    # each step's verified positions: together, every position up to the last output's
    tokens = np.concatenate([t for t, _ in log])
    full = prompts[0] + out
    assert tokens.tolist() == full[len(prompts[0]) - 1 : len(full) - 1] and len(log) == stats.row_steps
    recorded = np.concatenate([top for _, top in log])
    table = SuccessorTable(model.config.vocab_size, 4)
    got = replay(prompts[0], out, TreeProposer(8, nodes, 2, recycled=4), max_new_tokens=47, successors=recorded,
                 table=table)
    assert (stats.new_tokens, stats.row_steps, stats.drafted) == (got[0], got[1], got[3]), stats.as_dict()
    if nodes == 16:  # the recycled nodes changed what was fed
        plain = _replayed(prompts[:1], [out], 8, nodes, 47)
        assert plain[1] != got[1] or plain[2] != got[3]
