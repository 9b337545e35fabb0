"""cpu.huge_pages: a CPU model's parameters copied onto memory advised for 2 MB pages keep their
values, aliasing and strides, save and load as before, and generate the same tokens; under the
engine, the linear weights packed on such pages (cpu.packed_weight), the rest copied there."""

from __future__ import annotations

import pytest
import torch

from hf_plookup.api import _state
from hf_plookup.cpu import huge_pages, kernels as cpu_kernels
from hf_plookup.cpu.packed_weight import PackedWeight
from tests.conftest import left_padded, tiny_model, wrap_copy


def _vma_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _storages(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_parameters_keep_values_ties_and_strides(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True, hidden_size=256, intermediate_size=1024)
    model.model.layers[0].mlp.up_proj.weight.data = model.model.layers[0].mlp.up_proj.weight.data.t().contiguous().t()
    before = {n: (p.clone(), p.stride(), p.storage_offset()) for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if not huge_pages.available():  # no transparent huge pages here: nothing moves
        assert huge_pages.to_huge_pages(model) is False
        return
    assert huge_pages.to_huge_pages(model) is True
    assert huge_pages.to_huge_pages(model) is False  # moved once
    lo, hi = model._hf_plookup_huge_pages
    assert hi - lo >= sum(p.untyped_storage().nbytes() for p in model.parameters()) > 2 << 20
    assert "hg" in _vma_flags(lo)  # the mapping is advised for huge pages
    for n, p in model.named_parameters():
        assert p is params[n]  # the same Parameter objects, their data moved
        value, stride, offset = before[n]
        assert torch.equal(p, value) and p.stride() == stride and p.storage_offset() == offset
        assert lo <= p.untyped_storage().data_ptr() < hi and p.untyped_storage().data_ptr() % huge_pages.ALIGN == 0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert len(_storages(model)) == len({id(p) for p in model.parameters()})  # a storage each
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built (invariant mode is then off)")
def test_engine_moves_cpu_weights_and_tokens_stay_hf_greedy():
    hf = tiny_model("llama", hidden_size=256, intermediate_size=1024)
    ids, mask = left_padded(3)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    wrapped = wrap_copy(hf)  # invariant mode, the CPU default
    got = wrapped.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(got, want)
    linears = [m.weight for m in wrapped.modules() if type(m) is torch.nn.Linear]
    assert linears and all(isinstance(w, PackedWeight) for w in linears)  # the packed layout is the weight
    if huge_pages.available():
        lo, hi = wrapped._hf_plookup_huge_pages
        plain = [p for p in wrapped.parameters() if type(p) is torch.nn.Parameter]
        assert plain and all(lo <= p.untyped_storage().data_ptr() < hi for p in plain)
        assert all("hg" in _vma_flags(w.packed.data_ptr()) for w in linears)
    layers = _state(wrapped).engine.c_layers
    assert layers is not None and layers.on  # the C layers took the moved weights
    # weights moved again under a running engine (another wrap of the same modules): its next call
    # rebuilds its layer structs from the new addresses and gives the same tokens
    other = wrap_copy(hf)
    other.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False)
    again = wrapped.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(again, want)


def test_a_model_off_the_cpu_or_without_parameters_is_left_alone():
    empty = torch.nn.Module()
    assert huge_pages.to_huge_pages(empty) is False and not hasattr(empty, "_hf_plookup_huge_pages")
    meta = tiny_model("llama").to("meta")
    assert huge_pages.to_huge_pages(meta) is False


def test_no_mapping_leaves_the_weights_where_they_are(monkeypatch):
    model = tiny_model("llama")
    where = {n: p.data_ptr() for n, p in model.named_parameters()}

    def refused(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refused)
    assert huge_pages.to_huge_pages(model) is False
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == where
