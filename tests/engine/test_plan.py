"""engine.plan: what an engine runs with, decided before anything is built; and base.checks'
one positive-int rule, which every argument check of the package uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_plookup.base.checks import positive_int
from hf_plookup.cpu.packed_weight import PackedWeight
from hf_plookup.engine.engine import EngineOptions
from hf_plookup.engine.plan import COMPILE_BY_DEFAULT, EnginePlan, prefix_policy, resolve_compile
from tests.conftest import tiny_model


def test_positive_int_literal_cases():
    assert positive_int("k", 3) == 3
    assert type(positive_int("k", np.int64(3))) is int
    assert positive_int("k", None, none_ok=True) is None
    assert positive_int("n", 0, minimum=0) == 0
    for bad, error in ((True, TypeError), (2.0, TypeError), ("3", TypeError), (None, TypeError), (0, ValueError),
                       (-1, ValueError)):
        with pytest.raises(error, match=r"^k must be (an int )?greater than 0, got "):
            positive_int("k", bad)
    with pytest.raises(ValueError, match=r"^n must be >= 0 or None, got -1$"):
        positive_int("n", -1, minimum=0, none_ok=True)
    with pytest.raises(ValueError, match=r"^opt must be an int greater than 0, got float 2.5$"):
        positive_int("opt", 2.5, type_error=ValueError)  # the wrap options' errors are all ValueErrors


def test_options_use_the_positive_int_rule():
    assert EngineOptions(max_cache_tokens=np.int64(64)).max_cache_tokens == 64
    with pytest.raises(ValueError, match="max_num_seqs must be an int greater than 0, got NoneType None"):
        EngineOptions(max_num_seqs=None)
    with pytest.raises(ValueError, match="draft_memory_tokens must be >= 0, got -1"):
        EngineOptions(draft_memory_tokens=-1)


def test_compile_auto_means_off():
    cpu = [torch.device("cpu")]
    assert COMPILE_BY_DEFAULT is False
    assert resolve_compile("auto", cpu, "sdpa") is False and resolve_compile(True, cpu, "sdpa") is True
    assert resolve_compile(False, cpu, "sdpa") is False


def test_prefix_policy_literal_cases():
    assert prefix_policy("auto", True, [], 16, 128) == (True, 8)  # follows invariant mode
    assert prefix_policy("auto", False, [], 16, None) == (False, 8)  # unit: PREFILL_UNIT's whole pages
    assert prefix_policy(True, False, [], 16, None) == (True, 8)
    assert prefix_policy("auto", True, [], 16, 8) == (False, 1)  # a unit of less than a page
    assert prefix_policy("auto", True, ["a mixer"], 16, 128) == (False, 8)
    with pytest.raises(ValueError, match="prefix_cache=True cannot run: this model's recurrent mixers"):
        prefix_policy(True, True, ["a mixer"], 16, 128)


def test_plan_of_a_tiny_cpu_model():
    model = tiny_model("llama")
    plan = EnginePlan.of(model, EngineOptions(max_cache_tokens=512))
    assert plan.options.attn_backend == "sdpa" and plan.options.block_size == 16
    assert plan.options.max_batch_tokens == 1024  # MAX_BATCH_TOKENS["cpu"]
    assert plan.devices == [torch.device("cpu")] and plan.dtypes == [torch.float32] and not plan.hooked
    assert not plan.use_graphs and not plan.use_compile and not plan.tensor_parallel and plan.eager_only is None
    # invariant mode on (CPU float32 with the C kernels): prompts cut at 128 tokens, weights packed,
    # and the prefix pool follows it
    assert plan.invariant and plan.packs and plan.prefill_unit == 128
    assert plan.prefix_cache and plan.prefix_unit_pages == 8
    # the draft budget decides what is fed (tree_min_score=None on CPU); no uniform widths
    assert plan.budget and plan.tree_min_score == 0.0 and not plan.width_policy
    assert not any(isinstance(p, PackedWeight) for p in model.parameters())  # planned, not applied

    plain = EnginePlan.of(model, EngineOptions(max_cache_tokens=512, invariant=False, tree_min_score=0.3,
                                               max_batch_tokens=64))
    assert not plain.invariant and not plain.packs and plain.prefill_unit is None
    assert not plain.prefix_cache and plain.prefix_unit_pages == 8
    assert not plain.budget and plain.tree_min_score == 0.3 and plain.options.max_batch_tokens == 64
    assert EnginePlan.of(model, EngineOptions(max_cache_tokens=512, prefix_cache=True, invariant=False)).prefix_cache
