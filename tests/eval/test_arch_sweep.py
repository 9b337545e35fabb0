"""eval/arch_sweep.py: the config shrinking (literal cases), one architecture end to end, and the
whole sweep: every causal-LM config type the installed transformers ships, each checked against HF
greedy, none crashing or differing."""

from __future__ import annotations

import json
import os

import pytest

from eval.arch_sweep import causal_lm_types, counts, run_one, shrink, sweep


def test_shrink_sizes_layers_and_sub_configs():
    config = {
        "model_type": "x", "num_hidden_layers": 6, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000,
        "layer_types": ["sliding", "sliding", "full", "sliding", "sliding", "full"],
        "rope_scaling": {"type": "linear"},
        "per_layer": {"0": "a", "5": "b"},
        "text_config": {"model_type": "y", "num_hidden_layers": 4, "intermediate_size": 11008, "rope_theta": 1e4},
    }
    assert shrink(config) == {
        "model_type": "x", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512,
        "layer_types": ["sliding", "full"],  # one layer of each kind
        "rope_scaling": {"type": "linear"},
        "per_layer": {"0": "a"},  # settings of layers that are gone are dropped
        "text_config": {"model_type": "y", "num_hidden_layers": 2, "intermediate_size": 128, "rope_theta": 1e4},
    }


def test_shrink_keeps_each_kept_layers_own_settings():
    """A heterogeneous config's per-layer settings (Gemma 4: the full-attention layers' heads twice
    as wide) follow the layer each kept layer stands for, sizes in proportion to the global ones."""
    types = ["sliding_attention"] * 5 + ["full_attention"]
    out = shrink({"model_type": "g", "num_hidden_layers": 12, "head_dim": 256, "num_attention_heads": 8,
                  "layer_types": types * 2, "per_layer_config": {"05": {"head_dim": 512}, "11": {"head_dim": 512}}})
    assert out["layer_types"] == ["sliding_attention", "full_attention"]
    assert out["head_dim"] == 16 and out["per_layer_config"] == {"1": {"head_dim": 32}}


def test_shrink_cuts_the_vocabulary_and_renumbers_special_tokens_past_it():
    out = shrink({"model_type": "v", "vocab_size": 163840, "pad_token_id": 163839, "bos_token_id": 163584,
                  "eos_token_id": [163586, 2]})
    assert out == {"model_type": "v", "vocab_size": 512, "pad_token_id": 509, "bos_token_id": 511,
                   "eos_token_id": [510, 2]}
    assert shrink({"model_type": "s", "vocab_size": 260, "eos_token_id": 259})["vocab_size"] == 260  # small: kept


def test_shrink_latent_attention_keeps_a_key_head_per_query_head():
    out = shrink({"model_type": "m", "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
                  "qk_rope_head_dim": 64, "head_dim": 64})
    assert out["num_key_value_heads"] == out["num_attention_heads"] == 4
    assert out["head_dim"] == out["qk_rope_head_dim"] == 8


def test_shrink_mamba2_heads_fill_the_mixer_width():
    # expand x hidden size: 2 x 64 = 8 heads of 16
    assert shrink({"model_type": "m", "hidden_size": 4096, "mamba_expand": 2, "mamba_n_heads": 128, "mamba_d_head": 64,
                   "mamba_d_state": 256}) == {"model_type": "m", "hidden_size": 64, "mamba_expand": 2,
                                              "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16}
    # a width of its own (Falcon-H1's mamba_d_ssm): 1024 = 128 heads of 8
    out = shrink({"model_type": "f", "hidden_size": 4096, "mamba_expand": 2, "mamba_n_heads": 128, "mamba_d_head": 8,
                  "mamba_d_ssm": 1024})
    assert (out["mamba_n_heads"], out["mamba_d_head"]) == (128, 8)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen3_next"])
def test_run_one_identical(arch):
    """Llama; DeepSeek V3, whose values are narrower than its keys; Qwen3-Next, whose gated delta
    net layers keep a recurrent state."""
    assert run_one(arch, 8) == {"status": "identical", "detail": ""}


def test_whisper_decoder_ignores_logits_to_keep_and_still_matches_hf():
    """Whisper's decoder returns every row's logits whatever logits_to_keep says: the engine picks
    the kept rows itself."""
    res = run_one("whisper", 8, padded=False)
    assert res == {"status": "identical", "detail": ""}


@pytest.mark.parametrize("arch", ["whisper", "bart"])
def test_padded_batch_on_positions_counted_from_the_cache(arch):
    """Whisper's and BART's forwards take no position_ids, so HF counts a left-padded row's pads
    into its positions; the engine hands their position embeddings those positions."""
    assert run_one(arch, 8, padded=True) == {"status": "identical", "detail": ""}


def test_bert_is_swept_as_a_decoder():
    """BERT-style configs are built with is_decoder=True (HF asks for it to generate)."""
    assert shrink({"model_type": "bert", "is_decoder": False, "num_hidden_layers": 12})["is_decoder"] is True
    assert run_one("bert", 8) == {"status": "identical", "detail": ""}


# The sweep, in chunks that xdist's workers share (about 5 s each on 2 cores), in this process: a
# process of its own per type (`python eval/arch_sweep.py`) costs seconds of imports a type, where
# one type in-process takes 0.1-0.4 s
SWEEP_CHUNKS = 4
# identical outcomes the whole sweep must keep at least (transformers 5.24: 144 of 196 types; the
# rest are refused at wrap or delegated, each with its reason, or cannot be built tiny, or fail
# in HF's own generate)
MIN_IDENTICAL = 144


def _sweep_dir(tmp_path_factory) -> str:
    """A folder every chunk of this test run can see: under xdist each worker's base temp is a
    subfolder of the run's."""
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "arch_sweep")


@pytest.mark.parametrize("chunk", range(SWEEP_CHUNKS))
def test_every_causal_lm_type_runs_as_hf_greedy_or_is_refused(chunk, tmp_path_factory):
    """Every causal-LM config type of the installed transformers (eval/arch_sweep.py, tiny random,
    a left-padded batch of 2, k=4), each against HF greedy of the same model: none crashes in
    `wrap` or `generate`, none returns tokens that are not HF's. The chunk that finds every
    chunk's counts written checks the total of identical ones."""
    import torch

    rng = torch.random.get_rng_state()
    try:
        results = sweep(causal_lm_types()[chunk::SWEEP_CHUNKS], 12)
    finally:
        torch.random.set_rng_state(rng)  # run_one seeds torch's generator per type
    bad = [(r["model_type"], r["status"], r["detail"]) for r in results if r["status"] in ("crashed", "differs")]
    assert not bad, bad

    folder = _sweep_dir(tmp_path_factory)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"chunk{chunk}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(counts(results), f)
    os.replace(path + ".tmp", path)
    done = [os.path.join(folder, f"chunk{i}.json") for i in range(SWEEP_CHUNKS)]
    if all(os.path.exists(p) for p in done):
        total = {}
        for p in done:
            with open(p) as f:
                for status, n in json.load(f).items():
                    total[status] = total.get(status, 0) + n
        assert sum(total.values()) == len(causal_lm_types())
        assert total["identical"] >= MIN_IDENTICAL, total
