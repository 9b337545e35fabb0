"""The CPU LM-head layout chooser: same logits as the plain head, swap held only inside engine
forwards, and the engine's greedy outputs unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import hf_plookup
from hf_plookup.steps.head import HeadChooser, fast_head, head_chooser
from tests.conftest import left_padded, tiny_model, wrap_copy


def test_both_layouts_give_the_plain_logits():
    head = torch.nn.Linear(32, 500, bias=True)
    chooser = HeadChooser(head, max_rows=16)
    x = torch.randn(1, 1, 32)
    chooser.forward(x)
    assert chooser.transposed is None  # one row: never timed, always the plain layout
    for forced in (False, True):
        chooser.transposed = forced
        for rows in (1, 2, 5, 16, 17):
            x = torch.randn(1, rows, 32)
            torch.testing.assert_close(chooser.forward(x), F.linear(x, head.weight, head.bias), atol=1e-5, rtol=1e-5)
    chooser.transposed = None
    chooser.forward(torch.randn(3, 32))
    assert chooser.transposed in (True, False)  # decided at the first multi-row call


def test_swap_only_inside_the_context(llama):
    chooser = head_chooser(llama)
    head = llama.get_output_embeddings()
    assert chooser is not None and "forward" not in vars(head)
    with fast_head(chooser):
        assert vars(head)["forward"] == chooser.forward
    assert "forward" not in vars(head)
    try:
        with fast_head(chooser):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert "forward" not in vars(head)
    with fast_head(None):  # no chooser: nothing to do
        pass


def test_not_for_replaced_or_non_linear_heads():
    model = tiny_model("llama")
    head = model.get_output_embeddings()
    head.forward = lambda x: F.linear(x, head.weight)  # as accelerate's hooks do
    assert head_chooser(model) is None
    assert head_chooser(torch.nn.Module()) is None


def test_engine_outputs_unchanged_with_the_transposed_head():
    """Force the transposed layout for every row count: greedy outputs stay identical to HF."""
    model = tiny_model("llama")
    w = wrap_copy(model, max_cache_tokens=2048)
    chooser = w._engine.head
    chooser.transposed = True
    ids, mask = left_padded(3, seed=2)
    out = w.generate(ids, attention_mask=mask, max_new_tokens=20, prompt_lookup_num_tokens=4)
    assert torch.equal(out, model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20))
    assert "forward" not in vars(model.get_output_embeddings())
