"""cpu.packed_weight: after `wrap` on CPU each linear weight is held once, in the C kernels' packed
layout, and everything outside the engine still sees the true weight: values, state_dict, save and
reload, in-place changes, `.data` swaps, `.to()`, deepcopy and pickle; the engine's prompt GEMMs
give the same bits as from the plain weight."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from transformers import AutoModelForCausalLM

from hf_plookup.cpu import kernels as ck
from hf_plookup.cpu.packed_weight import PackedWeight, dense, pack_linears, unpack_linears
from tests.conftest import left_padded, tiny_model

pytestmark = pytest.mark.skipif(not ck.available(), reason="the C kernels were not built (nothing is packed then)")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 90), dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 2**16))
def test_c_pack_matches_the_reference_and_unpacks_back(n, k, dtype, seed):
    """The C packing (threads, 32-bit pairs for even bf16 rows) puts every value where the torch
    formula `pack_reference` does, unpacking gives the weight back bit for bit, and rows gathered
    from the panels are the weight's rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(DTYPES[dtype])
    packed = ck.pack(w)
    assert torch.equal(packed, ck.pack_reference(w))
    assert torch.equal(ck.unpack(packed, n, k), w)
    ids = torch.randint(n, (3, 4), generator=g)
    assert torch.equal(ck.packed_rows(packed, k, ids), w[ids])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_pack_and_unpack_agree_at_every_simd_level(dtype):
    """The vector packing (8 x 8 transposes of 32-bit elements: fp32 values, bf16 pairs) puts every
    value where the portable loop does, and unpacks it back, for full panels, the last partial one,
    lengths that leave a remainder past the transposes, and odd bf16 rows (the portable way)."""
    g = torch.Generator().manual_seed(5)
    top = ck.simd_level()
    try:
        for n, k in ((8, 8), (16, 64), (61, 203), (64, 17), (3, 5), (40, 9), (24, 130)):
            w = torch.randn(n, k, generator=g).to(DTYPES[dtype])
            packs, unpacks = [], []
            for level in range(top + 1):
                ck.set_simd_level(level)
                packs.append(ck.pack(w))
                unpacks.append(ck.unpack(packs[-1], n, k))
            assert all(torch.equal(p, ck.pack_reference(w)) for p in packs), (n, k)
            assert all(torch.equal(u, w) for u in unpacks), (n, k)
    finally:
        ck.set_simd_level(top)


def test_the_docstring_example():
    lin = torch.nn.Linear(16, 20, bias=False)
    w = lin.weight.detach().clone()
    assert pack_linears(lin) == 1 and pack_linears(lin) == 0  # packed once
    assert type(lin.weight) is PackedWeight and isinstance(lin.weight, torch.nn.Parameter)
    assert lin.weight.packed.shape == (3, 16, 8) and torch.equal(lin.weight, w)
    assert not lin.weight.packed[2, :, 4:].any()  # zeros past row 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_packed_weight_reads_writes_and_moves_as_the_weight(dtype):
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.ReLU(), torch.nn.Linear(24, 40, bias=False),
                                torch.nn.Linear(24, 40, bias=False)).to(dtype)
    model[3].weight = model[2].weight  # tied: packed once, still one parameter
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(5, 40, generator=g).to(dtype)
    ref = model[0](x)
    assert pack_linears(model) == 2
    assert model[3].weight is model[2].weight and type(model[0].weight) is PackedWeight
    # ops see the true weight: HF's forward outside the engine, comparisons, the kernels
    assert torch.equal(model[0](x), ref)
    assert torch.equal(ck.linear(x, model[0].weight, model[0].bias), ck.linear(x, want["0.weight"], model[0].bias))
    # state_dict gives plain tensors with the true values
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor and torch.equal(v, want[n]) for n, v in sd.items() if n != "3.weight")
    # in place: load_state_dict, +=, .data.add_ are packed back, and the kernels read the new values
    new = torch.randn(24, 40, generator=g).to(dtype)
    model.load_state_dict({**sd, "0.weight": new})
    assert type(model[0].weight) is PackedWeight and torch.equal(model[0].weight, new)
    assert torch.equal(ck.linear(x, model[0].weight, None), ck.linear(x, new, None))
    with torch.no_grad():
        model[0].weight += 1
    model[0].weight.data.mul_(2)
    assert torch.equal(model[0].weight, (new + 1) * 2)
    assert torch.equal(ck.linear(x, model[0].weight, None), ck.linear(x, (new + 1) * 2, None))
    # deepcopy and pickle keep it packed, with copies of the values
    for other in (copy.deepcopy(model), _pickled(model)):
        assert type(other[0].weight) is PackedWeight and torch.equal(other[0].weight, model[0].weight)
        assert other[0].weight.packed.data_ptr() != model[0].weight.packed.data_ptr()
        assert other[3].weight is other[2].weight
    # `.data = plain` (PEFT's safe merge) and `.to(dtype)`: the same parameter object, plain from then on
    p = model[2].weight
    p.data = want["2.weight"] * 3
    assert model[2].weight is p and model[3].weight is p and type(p) is torch.nn.Parameter
    assert torch.equal(p, want["2.weight"] * 3)
    w0 = model[0].weight
    model.to(torch.float64)
    assert model[0].weight is w0 and type(w0) is torch.nn.Parameter and w0.dtype == torch.float64
    assert torch.equal(w0, ((new + 1) * 2).double())


def _pickled(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_unpack_linears_gives_plain_parameters_back():
    model = tiny_model("llama", tie_word_embeddings=True)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert pack_linears(model) > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight and type(model.lm_head.weight) is PackedWeight
    unpack_linears(model)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prompt_gemm_through_the_scratch_equals_the_plain_weight(dtype):
    """The engine's GEMM for a long prompt chunk reads the weight unpacked into a reused scratch: the
    same bits as torch's call on the weight itself (the scratch is reused by the next weight)."""
    g = torch.Generator().manual_seed(3)
    lins = [torch.nn.Linear(96, n).to(dtype) for n in (200, 64)]
    plain = [lin.weight.detach().clone() for lin in lins]
    for lin in lins:
        pack_linears(lin)
    x = torch.randn(300, 96, generator=g).to(dtype)
    ptrs = set()
    for lin, w in zip(lins, plain):
        d = dense(lin.weight)
        ptrs.add(d.data_ptr())
        assert type(d) is torch.Tensor and torch.equal(F.linear(x, d, lin.bias), F.linear(x, w, lin.bias))
    assert len(ptrs) == 1  # one scratch, the larger weight's size
    assert dense(plain[0]) is plain[0]  # a plain weight is used as it is


def test_wrap_keeps_one_copy_and_the_checkpoint_unchanged(tmp_path):
    """After `wrap`, the original linear weights are gone (a weak reference to each dies), the
    checkpoint saved from the wrapped model reloads to the same state_dict as before, and its tokens
    are HF greedy's."""
    import hf_plookup

    model = tiny_model("llama", hidden_size=256, intermediate_size=1024)
    ids, mask = left_padded(2)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    originals = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    hf_plookup.wrap(model)
    gc.collect()
    assert originals and all(r() is None for r in originals)  # released: the packed copy is the weight
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert set(reloaded.state_dict()) == set(before)
    assert all(torch.equal(reloaded.state_dict()[n], v) for n, v in before.items())
