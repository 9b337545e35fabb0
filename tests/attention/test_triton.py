"""The Triton paged-attention kernel against dense attention, run by the Triton interpreter on
CPU (TRITON_INTERPRET=1, set before the kernel module is imported), and the whole engine on the
Triton backend against HF greedy. Skipped only when triton is not installed."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:  # pragma: no cover - triton ships with the test extra
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():  # tests/conftest.py sets it before triton is first imported
    assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET=1 must be set before triton is imported"

import hf_plookup  # noqa: E402
from hf_plookup.attention.triton import paged_attention  # noqa: E402
from tests.conftest import dense_causal, left_padded, tiny_model, wrap_copy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(cached, new, h, h_kv, d, page, dummies=0, extra_table=0, seed=0):
    """Random pages, scattered block tables, packed queries. `dummies` rows padded the way the
    CUDA-graph runner pads a bucket (context = q, every table entry the scratch page);
    `extra_table` spare table entries pointing at the scratch page."""
    g = torch.Generator().manual_seed(seed)
    ctx = [c + n for c, n in zip(cached, new)]
    num_pages = sum(-(-t // page) for t in ctx) + 4
    scratch = num_pages  # one more page at the end, zero-filled
    # unwritten slots hold NaN, as an uninitialised cache may: they must never leak into outputs
    k_cache = torch.full((num_pages + 1, page, h_kv, d), float("nan"))
    v_cache = torch.full((num_pages + 1, page, h_kv, d), float("nan"))
    k_cache[scratch] = 0
    v_cache[scratch] = 0
    perm = torch.randperm(num_pages, generator=g).tolist()
    width = max(-(-t // page) for t in ctx) + extra_table
    rows = len(ctx) + dummies
    tables = torch.full((rows, width), scratch, dtype=torch.int32)
    full_k, full_v, qs = [], [], []
    for i, t in enumerate(ctx):
        pages = [perm.pop() for _ in range(-(-t // page))]
        tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        kk, vv = torch.randn(h_kv, t, d, generator=g), torch.randn(h_kv, t, d, generator=g)
        for p in range(t):
            k_cache[pages[p // page], p % page] = kk[:, p]
            v_cache[pages[p // page], p % page] = vv[:, p]
        full_k.append(kk)
        full_v.append(vv)
        qs.append(torch.randn(h, new[i], d, generator=g))
    q_lens = list(new) + [new[0]] * dummies
    ctx_all = ctx + [new[0]] * dummies
    q = torch.cat(qs + [torch.randn(h, n, d, generator=g) for n in q_lens[len(ctx):]], dim=1).transpose(0, 1)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q.contiguous(), k_cache, v_cache, tables, torch.tensor(ctx_all, dtype=torch.int32), cu,
            max(q_lens), qs, full_k, full_v)


CASES = {  # name: (cached per sequence, new per sequence)
    "uniform-verify": ([0, 7, 29, 22], [3, 3, 3, 3]),
    "ragged": ([0, 7, 13, 22], [1, 5, 2, 9]),
    "one-token": ([17], [1]),
    "long-chunk": ([5, 0], [20, 33]),  # more queries than one query block (16)
}


# every case x (window, softcap) x splits, except the long chunk split three ways without both
# window and softcap (the interpreter's slowest runs; the other cases cover those combinations)
KERNEL_CASES = [(case, window, softcap, splits) for case in sorted(CASES)
                for window, softcap in [(None, None), (5, None), (9, 20.0)] for splits in (1, 3)
                if not (case == "long-chunk" and splits == 3 and softcap is None)]


@pytest.mark.parametrize("case, window, softcap, splits", KERNEL_CASES)
def test_kernel_matches_dense(case, window, softcap, splits):
    cached, new = CASES[case]
    h, h_kv, d, page = 6, 2, 16, 4
    q, kc, vc, tables, ctx, cu, tq, qs, full_k, full_v = _step(cached, new, h, h_kv, d, page)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = paged_attention(dev(q), dev(kc), dev(vc), dev(tables), dev(ctx), dev(cu), tq, 0.3, window, softcap,
                          num_splits=splits).cpu()
    for i in range(len(new)):
        ref = dense_causal(qs[i], full_k[i], full_v[i], 0.3, window, softcap)  # [H, n, D]
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].transpose(0, 1), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("h, h_kv, d", [(4, 1, 24), (8, 8, 32)])  # MQA with a head dim that is no power of two; MHA
@pytest.mark.parametrize("splits", [None, 1])
def test_kernel_head_layouts_and_graph_padded_steps(h, h_kv, d, splits):
    """A bucket-padded static-shape step (dummy rows on the scratch page, spare table entries):
    the real rows match dense attention, the dummy rows stay finite."""
    cached, new = [3, 40], [5, 5]
    q, kc, vc, tables, ctx, cu, tq, qs, full_k, full_v = _step(cached, new, h, h_kv, d, 8, dummies=2, extra_table=3)
    out = paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE), ctx.to(DEVICE),
                          cu.to(DEVICE), tq, d**-0.5, num_splits=splits).cpu()
    for i in range(len(new)):
        ref = dense_causal(qs[i], full_k[i], full_v[i], d**-0.5)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].transpose(0, 1), ref, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(out).all()


def test_kernel_bf16_close_to_fp32():
    cached, new = [0, 12], [4, 4]
    q, kc, vc, tables, ctx, cu, tq, *_ = _step(cached, new, 4, 2, 16, 4)
    args = lambda dt: [t.to(DEVICE, dt) for t in (q, kc, vc)] + [t.to(DEVICE) for t in (tables, ctx, cu)]  # noqa: E731
    a = paged_attention(*args(torch.float32), tq, 0.25).float().cpu()
    b = paged_attention(*args(torch.bfloat16), tq, 0.25)
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float().cpu(), a, atol=3e-2, rtol=3e-2)


def _tree_reference(q, k, v, scale, allowed, softcap=None):
    """q [H, n, D], k/v [H_kv, L, D], allowed [n, L] bool: plain masked attention in float64."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0).double(), v.repeat_interleave(groups, 0).double()
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v).float()


TREE_CASES = [  # (cached, new, h, h_kv, d, window, softcap, max_query_block)
    ([9, 0, 30], [6, 4, 11], 4, 2, 16, None, None, 8),  # GQA, ragged chunks, a chunk over two query blocks
    ([9, 0, 30], [6, 4, 11], 4, 2, 16, None, None, 16),  # 16-token query blocks (not the default: see MAX_QUERY_BLOCK)
    ([21, 5], [7, 7], 6, 2, 16, 6, 20.0, 4),  # sliding window measured from the nodes' real positions; soft-capping
    ([13], [9], 4, 1, 24, 5, None, 2),  # MQA, head size no power of two, many small query blocks
]


@pytest.mark.parametrize("cached, new, h, h_kv, d, window, softcap, max_query_block", TREE_CASES)
def test_kernel_tree_mask_matches_dense(cached, new, h, h_kv, d, window, softcap, max_query_block):
    """Candidate-tree chunks (random trees, node i stored at slot start + i, positioned at
    start + depth(i)) against dense attention under metadata.step_mask, the mask sdpa uses."""
    from hf_plookup.attention.metadata import step_mask
    from hf_plookup.drafting.tree import ancestor_mask, depths

    q, kc, vc, tables, ctx, cu, tq, qs, full_k, full_v = _step(cached, new, h, h_kv, d, 4, seed=3)
    rng = torch.Generator().manual_seed(7)
    b = len(new)
    tree = torch.zeros((b, tq, tq), dtype=torch.bool)
    query_pos = torch.full((b, tq), -1, dtype=torch.int64)
    for i, (c, n) in enumerate(zip(cached, new)):
        parents = [int(torch.randint(0, j + 1, (1,), generator=rng)) for j in range(n - 1)]  # node j+1's parent
        tree[i] = torch.from_numpy(ancestor_mask(np.array(parents, dtype=np.int64), tq))
        query_pos[i, :n] = c + torch.from_numpy(depths(np.array(parents, dtype=np.int64)))
    ctx64 = ctx.long()
    allowed = step_mask(query_pos, ctx64, int(ctx64.max()), window, tree)[:, 0]  # [B, Tq, Lk]
    assert not torch.equal(tree, torch.ones_like(tree).tril())  # some row is a real tree, not a chain
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = paged_attention(dev(q), dev(kc), dev(vc), dev(tables), dev(ctx), dev(cu), tq, 0.3, window, softcap,
                          tree_mask=dev(tree), query_pos=dev(query_pos), max_query_block=max_query_block).cpu()
    for i, n in enumerate(new):
        ref = _tree_reference(qs[i], full_k[i], full_v[i], 0.3, allowed[i, :n, : int(ctx[i])], softcap)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].transpose(0, 1), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("max_query_block", [1, 16])
def test_kernel_query_block_sizes(max_query_block):
    """Chains with query blocks other than the default 8 tokens (16 is the size that went wrong
    on an H100 with the earlier kernel: the GPU run of this test says whether it is right now)."""
    cached, new = [3, 20], [9, 13]
    q, kc, vc, tables, ctx, cu, tq, qs, full_k, full_v = _step(cached, new, 4, 2, 16, 8, seed=5)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = paged_attention(dev(q), dev(kc), dev(vc), dev(tables), dev(ctx), dev(cu), tq, 0.3, 7, None,
                          max_query_block=max_query_block).cpu()
    for i in range(len(new)):
        ref = dense_causal(qs[i], full_k[i], full_v[i], 0.3, 7)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].transpose(0, 1), ref, atol=2e-5, rtol=2e-5)


def test_kernel_tree_arguments_checked():
    q, kc, vc, tables, ctx, cu, tq, *_ = _step([3], [4], 2, 1, 16, 4)
    tree = torch.ones((1, tq, tq), dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="tree_mask and query_pos go together"):
        paged_attention(q, kc, vc, tables, ctx, cu, tq, 0.3, tree_mask=tree)
    with pytest.raises(ValueError, match="tree_mask must be"):
        paged_attention(q, kc, vc, tables, ctx, cu, tq, 0.3, tree_mask=tree[:, :2, :2],
                        query_pos=torch.zeros((1, 2), dtype=torch.int64))
    with pytest.raises(ValueError, match="max_query_block must be a power of two"):
        paged_attention(q, kc, vc, tables, ctx, cu, tq, 0.3, max_query_block=6)


@pytest.mark.parametrize("arch, pad_drafts", [("gemma3_text", True), ("llama", False)])  # gemma3: window, scaling
def test_engine_on_triton_backend_identical_to_hf(arch, pad_drafts):
    """Packed prefill chunks, verify steps (padded to k + 1 with pad_drafts, as CUDA graphs run
    them), sliding windows and Gemma's scaling, through the HF model's own modules."""
    model = tiny_model(arch).to(DEVICE)
    wrapped = wrap_copy(model, attn_backend="triton", max_cache_tokens=1024, block_size=8, pad_drafts=pad_drafts)
    ids, mask = left_padded(2, seed=4)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=3)
    assert wrapped.last_stats.attn_backend == "triton" and wrapped.last_stats.drafted > 0  # multi-token verify chunks ran
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))


def _short_branchy(model, batch: int, seed: int = 0) -> torch.Tensor:
    """A short prompt whose suffix recurs with two continuations (the model's own greedy one and
    a copy with two tokens changed), so trees have branches to verify; kept short because the
    interpreter's prefill is what costs here."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 96, (1, 4), generator=g)
    cont = model.generate(base, max_new_tokens=14, do_sample=False, eos_token_id=None)
    changed = cont.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 96
    changed[0, 12] = (changed[0, 12] + 1) % 96
    return torch.cat([cont, changed, base], 1).repeat(batch, 1)


@pytest.mark.parametrize("arch, batch, compiled", [("gemma2", 2, False), ("gpt_bigcode", 1, False), ("llama", 1, True)])
def test_trees_on_triton_backend_identical_to_hf(arch, batch, compiled, monkeypatch):
    """Candidate trees run on the Triton kernel (its tree mask), not as a chain: Gemma 2 for the
    sliding window and soft-capping, GPT-BigCode for MQA, and Llama through compiled
    static-buffer steps (the custom op, traced with aot_eager on CPU)."""
    from hf_plookup.steps import graphs

    monkeypatch.setattr(graphs, "COMPILE_BACKEND", "aot_eager")
    model = tiny_model(arch)
    ids = _short_branchy(model, batch).to(DEVICE)
    model.to(DEVICE)
    wrapped = wrap_copy(model, attn_backend="triton", max_cache_tokens=1024, block_size=16,
                        tree_min_score=0.0, compile=compiled)  # static steps: tree (9) <= block_size
    ref = model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None)
    out = wrapped.generate(ids, max_new_tokens=12, eos_token_id=None, prompt_lookup_num_tokens=4,
                           prompt_lookup_tree_nodes=8)
    s = wrapped.last_stats
    assert s.attn_backend == "triton" and s.drafter == "ngram-tree" and s.drafted > 0
    assert torch.equal(ref, out), arch
    if compiled:
        assert any(key[3] for key in wrapped._engine._graphs.graphs)  # a tree bucket ran
        torch._dynamo.reset()


def test_triton_backend_checks():
    model = tiny_model("llama").to(DEVICE)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        wrap_copy(model, attn_backend="triton", block_size=12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attn_backend='triton' cannot run: Triton kernels run on CUDA"):
        hf_plookup.wrap(tiny_model("llama"), attn_backend="triton")


@pytest.mark.parametrize("cached, h, h_kv, window, splits", [(13, 4, 2, None, 1), (21, 6, 2, 9, 1), (1100, 2, 1, None, 4)])
def test_invariant_kernel_query_alone_equals_query_in_chunk_and_batch(cached, h, h_kv, window, splits):
    """`invariant=True`: each query of a 5-token chunk, and of a sequence beside two others,
    bitwise equals the same query computed in a 1-token call over the keys it sees (the last
    case crosses the fixed key-split offsets, 512 keys, with 4 splits). The control: the
    ordinary form, split by the call's context length, does not give that."""
    d, n = 16, 5
    q, kc, vc, tables, ctx, cu, tq, *_ = _step([cached, 7, 40], [n, 1, 3], h, h_kv, d, 8, seed=11)
    dev = lambda t: t.to(DEVICE)  # noqa: E731

    def call(rows, ctx_, cu_, tq_, tables_, invariant=True, num_splits=splits):
        return paged_attention(dev(rows), dev(kc), dev(vc), dev(tables_), dev(ctx_), dev(cu_), tq_, 0.3, window,
                               None, num_splits=num_splits, invariant=invariant).cpu()

    batch = call(q, ctx, cu, tq, tables)  # [T, H, D]: the chunk beside two other sequences
    chunk = call(q[:n], ctx[:1], cu[:2], n, tables[:1])
    one_cu = torch.tensor([0, 1], dtype=torch.int32)
    for j in range(n):
        alone = call(q[j : j + 1], torch.tensor([cached + j + 1], dtype=torch.int32), one_cu, 1, tables[:1])
        assert torch.equal(alone[0], chunk[j]) and torch.equal(alone[0], batch[j]), j
    if splits > 1:  # splits chosen from the context length move a query's partial sums where the
        # chunk's and a query's own boundaries differ: with 1151 cached keys the first query alone
        # sees 1152 keys (36 tiles of 32, 12 per split), the chunk 1156 (37 tiles, 13 per split)
        c = 1151
        q, kc, vc, tables, ctx, cu, tq, *_ = _step([c, 7, 40], [n, 1, 3], h, h_kv, d, 8, seed=11)
        plain = call(q[:n], ctx[:1], cu[:2], n, tables[:1], invariant=False, num_splits=3)
        alone = [call(q[j : j + 1], torch.tensor([c + j + 1], dtype=torch.int32), one_cu, 1, tables[:1],
                      invariant=False, num_splits=3)[0] for j in range(n)]
        assert not all(torch.equal(a, plain[j]) for j, a in enumerate(alone))
