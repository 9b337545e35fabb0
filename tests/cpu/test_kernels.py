"""cpu.kernels against float64 references, and their invariance as properties: a row's (a
query's) bits never depend on the row count, its place in the call, the other rows or the
thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_plookup.cpu import kernels as ck
from tests.conftest import dense_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (tests/test_imports.py fails where the package was installed without them)
pytestmark = pytest.mark.skipif(not ck.available(), reason="the C kernels were not built")


def _threads(n):
    class _Ctx:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)

    return _Ctx()


def test_linear_literal():
    x = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]])
    w = torch.tensor([[1.0, 0.0, 1.0], [2.0, 1.0, -1.0]])
    b = torch.tensor([0.25, -0.5])
    assert ck.linear(x, w, b).tolist() == [[4.25, 0.5], [0.75, -0.5]]


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 64), k=st.integers(1, 300), n=st.integers(1, 160), dtype=st.sampled_from(sorted(DTYPES)),
       bias=st.booleans(), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_linear_rows_are_invariant(m, k, n, dtype, bias, threads, seed):
    """Every row of an M-row call equals that row alone, at another place of another call and
    under another thread count; values match a float64 reference."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dt)
    w = torch.randn(n, k, generator=g).to(dt)
    b = torch.randn(n, generator=g).to(dt) if bias else None
    with _threads(threads):
        full = ck.linear(x, w, b)
    i = int(torch.randint(m, (1,), generator=g))
    assert torch.equal(ck.linear(x[i : i + 1], w, b), full[i : i + 1])
    perm = torch.randperm(m, generator=g)
    assert torch.equal(ck.linear(x[perm], w, b), full[perm])
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    if dt == torch.float32:
        torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)
    else:  # one rounding of an fp32 sum: within 1 ulp of the dtype (plus the sum's own error)
        ulp = 2**-7 if dt == torch.bfloat16 else 2**-10
        torch.testing.assert_close(full.double(), ref, rtol=ulp, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_linear_simd_levels_agree_bitwise(dtype):
    """The portable C loop and the AVX2 tiles (up to 9 rows in one pass, 1-9 rows x 1-4 panels; more
    rows in passes of up to 9 over each panel) run one arithmetic per output: every level this CPU
    has gives the same bits (level 2 runs level 1's linears)."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(3)
    top = ck.simd_level()
    try:
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 17, 64):
            x, w, b = torch.randn(m, 203, generator=g).to(dt), torch.randn(61, 203, generator=g).to(dt), torch.randn(61).to(dt)
            outs = []
            for level in range(top + 1):
                ck.set_simd_level(level)
                outs.append(ck.linear(x, w, b))
            assert all(torch.equal(o, outs[0]) for o in outs), m
    finally:
        ck.set_simd_level(top)
    assert ck.simd_level() == top


def test_fp16_outputs_round_as_torch_rounds():
    """An fp16 output is its fp32 sum rounded once to nearest even, as torch's `.half()`: with K = 1,
    out[m, n] = a[m] * b[n], and a product of two fp16 values is exact in fp32, so each output rounds
    a known fp32 number. The values cover ties, fp16's subnormals and their edge (2^-24 .. 2^-14),
    overflow past 65504 to infinity and NaN; every SIMD level, calls of one row and of many, and
    the scalar stores of columns past the last whole panel (N = 301)."""
    g = torch.Generator().manual_seed(5)
    special = [300.0, 256.25, 0.0, -0.0, 65504.0, float("inf"), float("nan"), 1.0 + 2**-10, 2**-14, 2**-24, 3.0]
    a = torch.cat([torch.randn(290, generator=g) * 2.0 ** torch.randint(-14, 9, (290,), generator=g),
                   torch.tensor(special)]).half()
    b = a[torch.randperm(len(a), generator=g)]
    want = (a.float()[:, None] * b.float()[None, :]).half()
    top = ck.simd_level()
    try:
        for level in range(top + 1):
            ck.set_simd_level(level)
            for got, ref in ((ck.linear(a[:, None], b[:, None], None), want),
                             (ck.linear(a[-7:-6, None], b[:, None], None), want[-7:-6])):
                assert torch.equal(got.isnan(), ref.isnan()), level
                assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0)), level
    finally:
        ck.set_simd_level(top)


def test_linear_is_one_chain_over_k():
    """Each output is one FMA chain over k in order: 1e8, then + 1 (rounded away: fp32 spacing at
    1e8 is 8), then - 1e8 gives 0, where a sum in 8 lanes and a tree would keep the 1. The same at
    every SIMD level and as any row of a longer call."""
    x = torch.tensor([[1e8, 1.0, -1e8]])
    w = torch.ones(1, 3)
    top = ck.simd_level()
    try:
        for level in range(top + 1):
            ck.set_simd_level(level)
            assert ck.linear(x, w, None).tolist() == [[0.0]]
            assert ck.linear(torch.cat([torch.randn(4, 3), x]), w, None)[4].tolist() == [0.0]
    finally:
        ck.set_simd_level(top)


def test_pack_literal():
    """The docstring's examples: for each k, 8 columns side by side (zeros past N); bf16 pairs k and
    k + 1 of a column side by side (a zero past an odd K)."""
    assert ck.pack(torch.tensor([[1.0, 2.0], [3.0, 4.0]])).tolist() == [[[1, 3, 0, 0, 0, 0, 0, 0], [2, 4, 0, 0, 0, 0, 0, 0]]]
    w = torch.tensor([[1.0, 2.0, 3.0]]).bfloat16()
    got = ck.pack(w)
    assert got.shape == (1, 2, 8, 2)
    assert got[0, :, 0].tolist() == [[1, 2], [3, 0]] and not got[0, :, 1:].any()


def test_packed_copy_follows_the_weight():
    """`linear` reads a packed copy made once per weight; an in-place change of the weight, a new
    `.data` and a new tensor each give the new weight's result."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 40, generator=g)
    w = torch.nn.Parameter(torch.randn(20, 40, generator=g))
    first = ck.linear(x, w, None)
    assert ck.packed(w) is ck.packed(w)
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(ck.linear(x, w, None), ck.linear(x, w.detach().clone(), None))
    torch.testing.assert_close(ck.linear(x, w, None), 2 * first)
    w.data = torch.randn(20, 40, generator=g)
    assert torch.equal(ck.linear(x, w, None), ck.linear(x, w.detach().clone(), None))


def test_linear_rejects_mixed_dtypes():
    with pytest.raises(TypeError, match="x is torch.float32, weight is torch.bfloat16"):
        ck.linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None)


def test_rms_norm_literal():
    """The docstring's example: r = 1 / sqrt((9 + 16) / 2) = 1 / sqrt(12.5)."""
    x, w = torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 1.0])
    r = 1 / 12.5**0.5
    torch.testing.assert_close(ck.rms_norm(x, w, 0.0, "scale_after"), torch.tensor([[3 * r, 4 * r]]))
    torch.testing.assert_close(ck.rms_norm(x, w, 0.0, "one_plus"), torch.tensor([[6 * r, 8 * r]]))


@settings(max_examples=40, deadline=None)
@given(m=st.one_of(st.integers(1, 40), st.integers(120, 300)), k=st.integers(1, 700), dtype=st.sampled_from(sorted(DTYPES)),
       form=st.sampled_from(sorted(ck.RMS_FORMS)), eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**16))
def test_rms_norm_rows_are_invariant(m, k, dtype, form, eps, seed):
    """Each row of an M-row call (from 128 rows, split over the threads) equals that row alone
    and in another order; values match a float64 reference of the form (within the dtype's
    rounding)."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 4).to(dt)
    w = torch.randn(k, generator=g).to(dt)
    full = ck.rms_norm(x, w, eps, form)
    i = int(torch.randint(m, (1,), generator=g))
    assert torch.equal(ck.rms_norm(x[i : i + 1], w, eps, form), full[i : i + 1])
    perm = torch.randperm(m, generator=g)
    assert torch.equal(ck.rms_norm(x[perm], w, eps, form), full[perm])
    xd, wd = x.double(), w.double()
    normed = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    ref = normed * wd if form == "scale_after" else normed * (1 + wd)
    rtol, atol = (1e-5, 1e-5) if dt == torch.float32 else (2**-6, 1e-2)  # bf16 "scale_after" rounds twice
    torch.testing.assert_close(full.double(), ref, rtol=rtol, atol=atol * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("form", sorted(ck.RMS_FORMS))
def test_rms_norm_simd_levels_agree_bitwise(dtype, form):
    """The norms' loops are one C source compiled per level (vectorized for AVX2): every level this
    CPU has gives the portable level's bits, for short rows, rows of odd widths and prompt chunks of
    many rows over the threads."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(11)
    top = ck.simd_level()
    try:
        for m, k in ((1, 576), (5, 7), (9, 203), (40, 64), (130, 333)):
            x, w = (torch.randn(m, k, generator=g) * 4).to(dt), torch.randn(k, generator=g).to(dt)
            outs = []
            for level in range(top + 1):
                ck.set_simd_level(level)
                with _threads(2):
                    outs.append(ck.rms_norm(x, w, 1e-5, form))
            assert all(torch.equal(o, outs[0]) for o in outs), (m, k)
    finally:
        ck.set_simd_level(top)


def test_rms_norm_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="does not fit weight"):
        ck.rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-6, "scale_after")
    with pytest.raises(ValueError, match="does not fit weight"):
        ck.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6, "scale_after")


def _dense_reference(q, kc, vc, kv_slots, seq, lo, hi, xoff, extra, scale, softcap):
    """Each token's attention in float64 over exactly its keys (tests.conftest.dense_attention)."""
    t, h, d = q.shape
    h_kv, dv = kc.shape[-2], vc.shape[-1]
    out = torch.empty(t, h, dv, dtype=torch.float64)
    kf, vf = kc.reshape(-1, h_kv, d), vc.reshape(-1, h_kv, dv)
    for i in range(t):
        cpos = np.concatenate([np.arange(lo[i], hi[i]), extra[xoff[i] : xoff[i + 1]]])
        slots = torch.from_numpy(kv_slots[seq[i], cpos])
        every = torch.ones(1, len(slots), dtype=torch.bool)
        out[i] = dense_attention(q[i : i + 1], kf[slots], vf[slots], every, scale, softcap)[0]
    return out


def _paged(seed, dtype, num_seqs=3, h=6, h_kv=2, d=40, block=16, ctx=70, dv=None):
    g = torch.Generator().manual_seed(seed)
    pages = num_seqs * (-(-ctx // block)) + 1
    kc = torch.randn(pages, block, h_kv, d, generator=g).to(dtype)
    vc = torch.randn(pages, block, h_kv, dv or d, generator=g).to(dtype)
    tables = 1 + torch.randperm(pages - 1, generator=g).numpy()[: num_seqs * (-(-ctx // block))].reshape(num_seqs, -1)
    pos = np.arange(ctx)
    kv_slots = tables[:, pos // block] * block + pos % block
    return g, kc, vc, kv_slots


def test_attend_literal_chain():
    """One sequence, one head: 2 cached keys and a 2-token chain at cache positions 2 and 3."""
    kc = torch.zeros(2, 4, 1, 2)
    vc = torch.zeros(2, 4, 1, 2)
    kc[1, :, 0] = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    vc[1, :, 0] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 0.0]])
    kv_slots = np.array([[4, 5, 6, 7]])  # page 1
    q = torch.tensor([[[0.0, 0.0]], [[0.0, 0.0]]])  # zero queries: uniform weights over the visible keys
    out = ck.attend(q, kc, vc, kv_slots, np.array([0, 0]), np.array([0, 0]), np.array([3, 4]), np.array([0, 0, 0]),
                    np.zeros(0, np.int64), 1.0, None)
    torch.testing.assert_close(out[:, 0], torch.tensor([[1.0, 1.0], [7 / 4, 3 / 4]]))


@pytest.mark.skipif(ck.simd_level() < 2, reason="this CPU has no AVX-512 BF16 (level 2)")
def test_bf16_scores_follow_the_dot_product_order():
    """Level 2 sums a bf16 score q.k by dot products of pairs: lane l adds the products of values
    2l+1, then 2l, of each 16, then hsum8. Key 0's products are 1, 2^24, 0, -2^24: lane 0 rounds
    2^24 + 1 to 2^24, so the score is 0, where the 8-lane order of levels 0 and 1 (and of fp32 pages)
    keeps the 1. Key 1 scores 0 and the values are one-hot, so the output shows the score."""
    kc, vc = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16)
    q = torch.zeros(1, 1, 16)
    q[0, 0, :4] = torch.tensor([1.0, 4096.0, 0.0, 4096.0])
    kc[0, 0, 0, :4] = torch.tensor([1.0, 4096.0, 0.0, -4096.0])
    vc[0, 0, 0, 0] = vc[0, 1, 0, 1] = 1.0
    args = (np.array([[0, 1, 2, 3]]), np.array([0]), np.array([0]), np.array([2]), np.array([0, 0]),
            np.zeros(0, np.int64), 1.0, None)
    top = ck.simd_level()
    try:
        level2 = ck.attend(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), *args)
        ck.set_simd_level(1)
        level1 = ck.attend(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), *args)
    finally:
        ck.set_simd_level(top)
    fp32 = ck.attend(q, kc, vc, *args)
    e = 1 / (1 + float(np.exp(-1.0)))  # softmax of scores (1, 0)
    assert level2[0, 0, :2].tolist() == [0.5, 0.5]
    torch.testing.assert_close(level1[0, 0, :2].float(), torch.tensor([e, 1 - e]), atol=4e-3, rtol=0)
    torch.testing.assert_close(fp32[0, 0, :2], torch.tensor([e, 1 - e]), atol=1e-6, rtol=0)


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), window=st.sampled_from([None, 9, 40]), softcap=st.sampled_from([None, 5.0]),
       tree=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16), dv=st.sampled_from([40, 24]))
def test_attend_matches_reference_and_each_query_alone(dtype, window, softcap, tree, threads, seed, dv):
    """Chains or trees over paged keys (GQA 6/2, D=40, values of 40 or, as in multi-head latent
    attention, 24; sliding window, soft-capping): each query equals a float64 reference, and
    bitwise itself when computed alone or under another thread count."""
    dt = DTYPES[dtype]
    g, kc, vc, kv_slots = _paged(seed, dt, dv=dv)
    arrays = _chains_or_trees(g, [(start, 1 + int(torch.randint(5, (1,), generator=g))) for start in (60, 33, 5)],
                              tree, window)
    t = len(arrays[0])
    q = torch.randn(t, 6, 40, generator=g).to(dt)
    with _threads(threads):
        out = ck.attend(q, kc, vc, kv_slots, *arrays, 0.17, softcap)
    ref = _dense_reference(q, kc, vc, kv_slots, *arrays, 0.17, softcap)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    i = int(torch.randint(t, (1,), generator=g))
    assert torch.equal(_attend_alone(q, kc, vc, kv_slots, arrays, i, 0.17, softcap), out[i])


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), d=st.sampled_from([13, 64]), dv=st.sampled_from([None, 7]),
       window=st.sampled_from([None, 20]), softcap=st.sampled_from([None, 5.0]), tree=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attend_tiles_equal_head_groups_bitwise(dtype, d, dv, window, softcap, tree, seed):
    """16 tokens of one sequence with 4 query heads per KV head: 64 queries share each KV head's
    cached keys, which in bf16 they read widened to fp32 rows, in tiles of queries (D of 13 padded
    with zeros); a token alone has 4 queries and reads them by groups of heads (fp32 and fp16: both
    ways).
    Every query gets the same bits both ways, and the float64 reference's values, at each SIMD level
    this CPU has (level 1 has the tiles; level 2 reads bf16 pages by its dot products instead)."""
    dt = DTYPES[dtype]
    g, kc, vc, kv_slots = _paged(seed, dt, num_seqs=1, h=8, h_kv=2, d=d, ctx=110, dv=dv)
    arrays = _chains_or_trees(g, [(70, 16)], tree, window)
    q = torch.randn(16, 8, d, generator=g).to(dt)
    ref = _dense_reference(q, kc, vc, kv_slots, *arrays, 0.3, softcap)
    tol = 1e-5 if dt == torch.float32 else 2e-2
    top = ck.simd_level()
    try:
        for level in range(top + 1):
            ck.set_simd_level(level)
            with _threads(1):  # one pass of all 16 tokens
                out = ck.attend(q, kc, vc, kv_slots, *arrays, 0.3, softcap)
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
            for i in range(16):
                assert torch.equal(_attend_alone(q, kc, vc, kv_slots, arrays, i, 0.3, softcap), out[i]), (level, i)
    finally:
        ck.set_simd_level(top)


def _chains_or_trees(g, seqs, tree, window):
    """attend's per-token arrays for sequences (start, n): n tokens after `start` cached positions, a
    chain or a random tree, optionally under a sliding window"""
    seq, lo, hi, xoff, extra = [], [], [], [0], []
    for b, (start, n) in enumerate(seqs):
        parents = [-1] + [int(torch.randint(j, (1,), generator=g)) for j in range(1, n)] if tree else list(range(-1, n - 1))
        for j in range(n):
            anc, a = [], j
            while a >= 0:
                anc.append(a)
                a = parents[a]
            anc = sorted(anc)
            pos = start + len(anc) - 1  # the node's position id (a chain: start + j)
            if tree:
                run_lo, run_hi, ext = 0, start, [start + a for a in anc]
            else:
                run_lo, run_hi, ext = 0, start + j + 1, []
            if window:  # positions: the context's are its cache positions, a node's start + depth
                run_lo = max(run_lo, pos - window + 1)
                run_hi = max(run_hi, run_lo)
                ext = [c for c, a in zip(ext, anc) if start + sum(1 for x in anc if x <= a) - 1 > pos - window]
            seq.append(b), lo.append(run_lo), hi.append(run_hi), extra.extend(ext), xoff.append(xoff[-1] + len(ext))
    return [np.array(a, dtype=np.int64) for a in (seq, lo, hi, xoff, extra)]


def _attend_alone(q, kc, vc, kv_slots, arrays, i, scale, softcap):
    """token i's attention computed by itself"""
    seq, lo, hi, xoff, extra = arrays
    return ck.attend(q[i : i + 1], kc, vc, kv_slots, seq[i : i + 1], lo[i : i + 1], hi[i : i + 1],
                     np.array([0, xoff[i + 1] - xoff[i]]), extra[xoff[i] : xoff[i + 1]], scale, softcap)[0]


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), window=st.sampled_from([None, 30]), seed=st.integers(0, 2**16))
def test_attend_partitions_and_levels_agree_bitwise(dtype, window, seed):
    """Five sequences feeding up to 20 chain tokens (more than the 16 that share one pass over the
    keys) under 1, 2 and 3 threads, which cut the work by sequence, by KV head or by token: every
    query is bitwise itself computed alone, at each SIMD level this CPU has (the portable level's
    exp is libm's, so its bits are its own)."""
    dt = DTYPES[dtype]
    g, kc, vc, kv_slots = _paged(seed, dt, num_seqs=5, ctx=130)
    seq, lo, hi = [], [], []
    for b in range(5):
        start, n = 40 + int(torch.randint(60, (1,), generator=g)), 1 + int(torch.randint(20, (1,), generator=g))
        for j in range(n):
            seq.append(b), hi.append(start + j + 1), lo.append(max(0, start + j + 1 - window) if window else 0)
    t = len(seq)
    arrays = [np.array(seq), np.array(lo), np.array(hi), np.zeros(t + 1, np.int64), np.zeros(0, np.int64)]
    q = torch.randn(t, 6, 40, generator=g).to(dt)
    top = ck.simd_level()
    try:
        for level in range(top + 1):
            ck.set_simd_level(level)
            alone = torch.stack([ck.attend(q[i : i + 1], kc, vc, kv_slots, arrays[0][i : i + 1], arrays[1][i : i + 1],
                                           arrays[2][i : i + 1], np.zeros(2, np.int64), arrays[4], 0.2, None)[0]
                                 for i in range(t)])
            for threads in (1, 2, 3):
                with _threads(threads):
                    out = ck.attend(q, kc, vc, kv_slots, *arrays, 0.2, None)
                assert torch.equal(out, alone), (level, threads)
    finally:
        ck.set_simd_level(top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_c_layers_match_the_modules_at_every_level(arch, dtype):
    """The decoder layers' C calls (steps.c_layers: layer_attention, layer_mlp) write RoPE, the residual
    adds and the gate-times-up product out in C, compiled per level; the modules path computes them
    with torch, around the same linear, norm and attention kernels. At each SIMD level this CPU has,
    both give the same logits (chain drafts: 1- and 5-token steps; qwen3: per-head q/k norms)."""
    from hf_plookup.api import _state
    from tests.conftest import greedy_logits, left_pad, repeat_prompts, tiny_model, wrap_copy

    hf = tiny_model(arch).to(dtype)
    ids, mask = left_pad(repeat_prompts(3))
    top = ck.simd_level()
    try:
        for level in range(top + 1):
            ck.set_simd_level(level)
            fast, plain = wrap_copy(hf, invariant=True), wrap_copy(hf, invariant=True)
            _state(plain).engine.c_layers = None
            got, _ = greedy_logits(fast, ids, mask, 8, prompt_lookup_num_tokens=4)
            want, _ = greedy_logits(plain, ids, mask, 8, prompt_lookup_num_tokens=4)
            layers = _state(fast).engine.c_layers
            assert layers is not None and layers.checked and layers.on, level
            assert torch.equal(got, want), level
    finally:
        ck.set_simd_level(top)


def test_attend_rejects_a_query_that_does_not_fit_the_pages():
    kc = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="does not fit pages"):
        ck.attend(torch.zeros(1, 3, 8), kc, kc, np.zeros((1, 4), np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                  np.ones(1, np.int64), np.zeros(2, np.int64), np.zeros(0, np.int64), 1.0, None)


def test_concurrent_callers_and_thread_counts():
    """Python threads calling the kernels at once (each call splitting its work over the pool)
    get what a lone call gets; the pool grows and shrinks with torch's thread count."""
    import threading

    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 96, generator=g)
    xs = [torch.randn(1 + i % 7, 96, generator=g) for i in range(8)]
    want = [ck.linear(x, w, None) for x in xs]
    errors = []

    def caller(i):
        try:
            for r in range(40):
                j = (i + r) % len(xs)
                if not torch.equal(ck.linear(xs[j], w, None), want[j]):
                    errors.append((i, r))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for threads in (4, 2, 1):
        with _threads(threads):
            callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
            for c in callers:
                c.start()
            for c in callers:
                c.join()
    assert errors == []


def test_serial_torch_keeps_the_kernels_threads_and_restores():
    """Inside serial_torch torch runs on one thread while the kernels keep the count torch had;
    nested uses change nothing, and the count comes back after an exception too."""
    with _threads(2):
        with ck.serial_torch():
            assert (torch.get_num_threads(), ck.threads()) == (1, 2)
            with ck.serial_torch():
                assert (torch.get_num_threads(), ck.threads()) == (1, 2)
            assert (torch.get_num_threads(), ck.threads()) == (1, 2)
        assert (torch.get_num_threads(), ck.threads()) == (2, 2)
        with pytest.raises(KeyError):
            with ck.serial_torch():
                raise KeyError("x")
        assert (torch.get_num_threads(), ck.threads()) == (2, 2)


def _outputs_of_every_row_count(w: torch.Tensor, kind: int, n: int, x: torch.Tensor) -> list[torch.Tensor]:
    """linear's outputs over the first 1, 2, ..., len(x) rows of x, on 2 threads."""
    outs = []
    for m in range(1, len(x) + 1):
        out = torch.empty(m, n, dtype=x.dtype)
        assert ck._LIB.linear(x.data_ptr(), m, w.data_ptr(), kind, x.shape[1], 0, n, out.data_ptr(),
                              ck.dtype_code(x.dtype), 2) == 0
        outs.append(out)
    return outs


def _agree_across_levels(fn) -> None:
    from tests.conftest import at_every_simd_level

    levels = at_every_simd_level(fn)
    assert all(torch.isfinite(o).all() for o in levels[0])
    for level, got in levels.items():
        assert all(torch.equal(a, b) for a, b in zip(got, levels[0])), f"level {level} differs from the portable C"


# 101 columns on 2 threads: 13 panels, in units of 12 and 1, so level 2's pairs of panels, the one
# left without a partner, and a part panel of 5 columns; 1 to 9 rows (one tile each) and 10 (past them)
Q_COLUMNS, Q_ROWS = 101, 10


@pytest.mark.parametrize("kind, k, group", [(ck.W_Q4, 96, 32), (ck.W_Q4K, 96, 32), (ck.W_Q4K, 1088, 64)],
                         ids=["q4", "q4k", "q4k-chunks"])
@pytest.mark.parametrize("form", list(ck.Q4_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_q4_tiles_of_every_row_count_agree_across_levels(form, dtype, kind, k, group):
    """Every W_Q4 and W_Q4K tile shape at every SIMD level gives the portable C's bits (Q_COLUMNS,
    Q_ROWS), groups of 32 over K = 96, the weights' values from each form's arithmetic; W_Q4K also
    over K = 1088 in groups of 64, which level 1's many-row tiles take in several chunks of k, a
    group across the boundary of two."""
    g = torch.Generator().manual_seed(0)
    n = Q_COLUMNS
    codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    shifts = torch.randn(n, k // group, generator=g)
    if form == "sub_mul_f16":  # (GPTQ: fp16 scales, integer zero points)
        scales, shifts = scales.half().float(), shifts.round()
    lut = torch.randn(16, generator=g) if form == "lut" else None
    w = ck.pack_q4(codes, scales, shifts, group, form, 8.0 if form in ("fma", "sub_mul") else 0.0, dtype, lut,
                   kind=kind)
    assert torch.equal(ck.q4_codes(w, n, k, kind), codes)
    x = torch.randn(Q_ROWS, k, generator=g).to(dtype)
    _agree_across_levels(lambda: _outputs_of_every_row_count(w, kind, n, x))


def test_q4k_literal():
    """W_Q4K's layout and order. One column, K = 32, the "fma" form with offset 8, scale 1 and shift 0,
    codes 9 (weights 1) but code 10 at k = 3 and 7 at k = 20 (weights 2 and -1): byte 3 holds 10 and 9
    (k = 3, 19), byte 4 holds 9 and 7 (k = 4, 20). x = [2^24, 1 x 15, -2^24, 0 x 15]: W_Q4's one chain
    over k adds 1 to 2^24 as a tie to even (2^24), then 2 (2^24 + 2), then 1 (a tie: 2^24 + 4), then
    ties that stay, so 4 is left after - 2^24; W_Q4K's lane 0 takes 2^24 - 2^24 and lanes 1-15 their
    products (lane 3's 2), so its sum is the exact 16. Plus the bias 0.5."""
    from tests.conftest import at_every_simd_level

    codes = torch.full((1, 32), 9, dtype=torch.uint8)
    codes[0, 3], codes[0, 20] = 10, 7
    args = (torch.ones(1, 1), torch.zeros(1, 1), 32, "fma", 8.0, torch.float32)
    q4k, q4 = ck.pack_q4(codes, *args, kind=ck.W_Q4K), ck.pack_q4(codes, *args, kind=ck.W_Q4)
    assert q4k[:16].tolist() == [0x99, 0x99, 0x99, 0x9A, 0x79] + [0x99] * 11 and not q4k[16:64].any()
    x, bias, out = torch.zeros(1, 32), torch.tensor([0.5]), torch.empty(1, 1)
    x[0, :16], x[0, 0], x[0, 16] = 1.0, 2.0**24, -(2.0**24)
    for kind, want in ((ck.W_Q4K, 16.5), (ck.W_Q4, 4.5)):
        w = q4k if kind == ck.W_Q4K else q4
        for level, rc in at_every_simd_level(lambda: ck._LIB.linear(
                x.data_ptr(), 1, w.data_ptr(), kind, 32, bias.data_ptr(), 1, out.data_ptr(), 0, 1)).items():
            assert rc == 0 and out.item() == want, (kind, level, out.item())
    assert ck.q4_kind(2048, 128) == (ck.W_Q4K if ck.cpu_level() >= 2 else ck.W_Q4)
    assert ck.q4_kind(576, 16) == ck.q4_kind(20, 2) == ck.W_Q4 and ck.q4_kind(64, 32, 8) == ck.W_Q8G
    with pytest.raises(ValueError, match="W_Q4K needs"):
        ck.pack_q4(torch.zeros(1, 48, dtype=torch.uint8), torch.ones(1, 3), torch.zeros(1, 3), 16, "fma", 8.0,
                   torch.float32, kind=ck.W_Q4K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_q8_tiles_of_every_row_count_agree_across_levels(dtype):
    """As the W_Q4 test, for W_Q8 weights (K = 75: odd, so bfloat16's panels hold a zero pair)."""
    g = torch.Generator().manual_seed(1)
    n, k = Q_COLUMNS, 75
    w = ck.pack_q8(torch.randint(-128, 128, (n, k), generator=g).to(torch.int8), torch.rand(n, generator=g) * 0.01, dtype)
    x = torch.randn(Q_ROWS, k, generator=g).to(dtype)
    _agree_across_levels(lambda: _outputs_of_every_row_count(w, ck.W_Q8, n, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_q8g_tiles_of_every_row_count_agree_across_levels(dtype):
    """As the W_Q4 test, for W_Q8G weights: 8-bit codes over all 256 values, "sub_mul" with offset
    128, integer zero points, groups of 32 over K = 160 (the dequantizing path of 10 rows crosses no
    K block; the compressed-tensors tests' K = 256 does)."""
    g = torch.Generator().manual_seed(2)
    n, k, group = Q_COLUMNS, 160, 32
    codes = torch.randint(0, 256, (n, k), generator=g).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    zeros = torch.randint(-128, 128, (n, k // group), generator=g).float()
    w = ck.pack_q4(codes, scales, zeros, group, "sub_mul", 128.0, dtype, bits=8)
    x = torch.randn(Q_ROWS, k, generator=g).to(dtype)
    _agree_across_levels(lambda: _outputs_of_every_row_count(w, ck.W_Q8G, n, x))


def test_q8g_literal():
    """One column of 8-bit codes, two groups of 2, offset 128: weights (q - 128 - z) * s =
    [(0 - 128 - 1) / 2, (255 - 128 - 1) / 2 | (128 + 2) * 3, (129 + 2) * 3] = [-64.5, 63 | 6, 9], so
    x = [1, 2, 3, 4] gives -64.5 + 126 + 18 + 36 = 115.5, plus the bias 0.5; the panel holds one code
    a byte, column 0 of each k's 8."""
    from tests.conftest import at_every_simd_level

    codes = torch.tensor([[0, 255, 128, 129]], dtype=torch.uint8)
    w = ck.pack_q4(codes, torch.tensor([[0.5, 3.0]]), torch.tensor([[1.0, -2.0]]), 2, "sub_mul", 128.0, torch.float32,
                   bits=8)
    assert w[:32].view(4, 8)[:, 0].tolist() == [0, 255, 128, 129] and not w[:32].view(4, 8)[:, 1:].any()
    assert torch.equal(ck.q4_codes(w, 1, 4, ck.W_Q8G), codes)
    out = torch.empty(1, 1)
    x, bias = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([0.5])
    for level, rc in at_every_simd_level(lambda: ck._LIB.linear(
            x.data_ptr(), 1, w.data_ptr(), ck.W_Q8G, 4, bias.data_ptr(), 1, out.data_ptr(), 0, 1)).items():
        assert rc == 0 and out.item() == 116.0, level
    with pytest.raises(ValueError, match="8 in 'sub_mul'"):
        ck.pack_q4(codes, torch.ones(1, 2), torch.zeros(1, 2), 2, "fma", 8.0, torch.float32, bits=8)
