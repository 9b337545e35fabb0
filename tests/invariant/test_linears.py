"""Invariant mode (`wrap(model, invariant=True)`): every token's logits are bitwise the same in a
1-token step, a verify step, a tree step, alone or in a batch, whatever the prefill chunking."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch

import hf_plookup
from hf_plookup import embedded
from hf_plookup.invariant.attention import build_layout
from hf_plookup.invariant.linears import PROBE_ROWS, invariant_rows, resolve_invariant, row_strategy
from hf_plookup.cpu import kernels as cpu_kernels
from hf_plookup.invariant import linears as invariant_mod
from tests.conftest import ARCHS, PAD, POSITIONS_FROM_CACHE, greedy_logits, left_pad, repeat_prompts, tiny_model, wrap_copy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DOCS = pathlib.Path(__file__).resolve().parents[2] / "eval" / "data" / "builtin.jsonl"
# fused MoE experts are not nn.Linear: their rows depend on the routing of the other tokens
NOT_COVERED = {"qwen3_moe", "deepseek_v3", "gpt_oss"}
BF16_ARCHS = ["llama", "gemma3_text", "qwen3", "gpt_neox", "mistral", "gemma2"]
FP16_ARCHS = ["llama", "gemma3_text"]  # (fp16: the same kernels, its own roundings)
CASES = ([(a, torch.float32) for a in ARCHS if a not in NOT_COVERED] + [(a, torch.bfloat16) for a in BF16_ARCHS]
         + [(a, torch.float16) for a in FP16_ARCHS])


def _drafts_change_no_logit(model, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy logits of `ids` with chains and with trees equal to without, bit for bit. Returns
    the plain greedy logits [B, new, V]."""
    plain, st = greedy_logits(model, ids, mask, new)
    chain, st_chain = greedy_logits(model, ids, mask, new, prompt_lookup_num_tokens=4)
    tree, st_tree = greedy_logits(model, ids, mask, new, prompt_lookup_num_tokens=4, prompt_lookup_tree_nodes=8)
    assert st.invariant and st_chain.drafted > 0 and st_tree.drafter == "ngram-tree" and st_tree.drafted > 0
    assert torch.equal(chain, plain), "a verify step's rows differ from 1-token steps"
    assert torch.equal(tree, plain), "a tree step's rows differ from 1-token steps"
    return plain


@pytest.mark.parametrize("arch, dtype", CASES, ids=[f"{a}-{str(d)[6:]}" for a, d in CASES])
def test_drafts_and_batch_change_no_logit(arch, dtype):
    hf = tiny_model(arch).to(dtype)
    model = wrap_copy(hf, invariant=True, max_batch_tokens=16)
    rows = repeat_prompts(4)
    ids, mask = left_pad(rows)
    new = 20
    plain = _drafts_change_no_logit(model, ids, mask, new)
    if dtype == torch.float32:  # fp32: the mode's greedy tokens are HF's
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD,
                          return_dict_in_generate=True, output_logits=True)
        assert torch.equal(plain.argmax(-1), torch.stack(ref.logits, 1).argmax(-1))
    for i in (0, 3) if arch not in POSITIONS_FROM_CACHE else ():  # each row alone against the same row in the batch
        r = rows[i][None]
        alone, _ = greedy_logits(model, r, torch.ones_like(r), new, prompt_lookup_num_tokens=4)
        n = alone.shape[1]
        assert torch.equal(alone[0], plain[i, :n]), f"row {i} alone differs from the batch"


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")
def test_decode_steps_run_torch_on_one_thread():
    """On CPU, decode steps run HF's own ops on one thread (the kernels keep torch's count:
    cpu_kernels.serial_torch); prompt steps keep torch's threads for their GEMMs, and the count
    is torch's again after generate. Logits as in a run with one thread throughout."""
    hf = tiny_model("llama")
    model = wrap_copy(hf, invariant=True)
    seen = []
    # (the activation: decode steps run it between steps.c_layers' C calls, prompt steps in the MLP)
    hook = hf.model.layers[0].mlp.act_fn.register_forward_pre_hook(
        lambda m, a: seen.append((a[0].numel() // a[0].shape[-1], torch.get_num_threads(), cpu_kernels.threads())))
    ids, mask = left_pad(repeat_prompts(3))
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits, _ = greedy_logits(model, ids, mask, 8, prompt_lookup_num_tokens=4)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        single, _ = greedy_logits(model, ids, mask, 8, prompt_lookup_num_tokens=4)
    finally:
        torch.set_num_threads(prev)
        hook.remove()
    first = seen[: len(seen) // 2]
    assert first[0] == (int(mask.sum()), 2, 2)  # the prompts' step (one chunk each)
    assert all(t == (t[0], 1, 2) for t in first[1:]) and len(first) > 1
    assert torch.equal(logits, single)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_long_prompt_chunks_change_no_logit(dtype):
    """Prompt chunks of more than PREFILL_TORCH_ROWS rows run torch's GEMM (float32, and bfloat16
    where its bf16 GEMM is native) instead of the row kernel: a chunk holds the same rows alone
    and in a batch, so drafts and batching still change no logit."""
    assert 64 == invariant_mod.PREFILL_TORCH_ROWS  # the prompts below cross it
    model = wrap_copy(tiny_model("llama").to(dtype), invariant=True, max_batch_tokens=128)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 96, (n,), generator=g).repeat(3)[: 3 * n - 7] for n in (45, 38, 31)]  # 128, 107, 86 tokens
    ids, mask = left_pad(rows)
    plain = _drafts_change_no_logit(model, ids, mask, 12)
    r = rows[1][None]
    alone, _ = greedy_logits(model, r, torch.ones_like(r), 12, prompt_lookup_num_tokens=4)
    assert torch.equal(alone[0], plain[1, : alone.shape[1]])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_neox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_drafted_greedy_equals_hf_batch1_greedy(arch, dtype):
    """Where the linears keep torch's 1-row arithmetic ("plain" or "rows") and attention runs
    SDPA (no cpu.kernels), a 1-token step is HF's batch-1 decode arithmetic (1-row
    linears, one SDPA call over the contiguous keys) and a one-chunk prefill is HF's prefill, so
    with drafts every logit equals HF greedy's bit for bit (layers without a sliding window; HF's
    sliding-window decode attends over a longer masked cache). Where the engine's own kernels run
    (cpu.kernels, invariant.row_linear), the logits differ by rounding only (in bf16 a few of
    its ulps, after 20 tokens through the layers): fp32 tokens are HF's, and bf16 tokens are HF's
    up to a near-tie, where HF's own bf16 kernels (their rounding differs between CPUs: on one
    with AVX-512 BF16 they use its dot products) may pick the other token."""
    model = tiny_model(arch).to(dtype)
    ids = repeat_prompts(1)[0][None]
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=PAD,
              return_dict_in_generate=True, output_logits=True)
    ref = model.generate(**kw)
    out = hf_plookup.wrap(model, invariant=True).generate(**kw, prompt_lookup_num_tokens=4)
    ours, theirs = torch.stack(out.logits, 1), torch.stack(ref.logits, 1)
    strategies = {row_strategy(m.weight, m.bias) for m in model.modules() if type(m) is torch.nn.Linear}
    if strategies <= {"plain", "rows"} and not cpu_kernels.available():
        assert torch.equal(out.sequences, ref.sequences)
        assert torch.equal(ours, theirs)
        return
    tol = 1e-4 if dtype == torch.float32 else 0.25
    new_ours, new_theirs = out.sequences[0, ids.shape[1]:], ref.sequences[0, ids.shape[1]:]
    differ = (new_ours != new_theirs).nonzero()
    if dtype == torch.float32 or len(differ) == 0:
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
        return
    t = int(differ[0])  # the first parting: same history before it, so its logits are comparable
    torch.testing.assert_close(ours[:, : t + 1], theirs[:, : t + 1], rtol=tol, atol=tol)
    top2 = theirs[0, t].float().topk(2).values
    assert float(top2[0] - top2[1]) <= 2 * tol, f"parted at new token {t} without a near-tie ({top2.tolist()})"


def test_padded_drafts_change_no_logit():
    """pad_drafts: every row feeds k + 1 tokens (missing drafts padded, as compiled steps do)."""
    model = hf_plookup.wrap(tiny_model("gemma3_text"), invariant=True, pad_drafts=True, max_batch_tokens=16)
    _drafts_change_no_logit(model, *left_pad(repeat_prompts(4)), 16)


def test_without_invariant_mode_fp32_verify_rows_differ():
    """What the mode fixes: fp32 GEMMs of k+1 rows round unlike 1-row ones on CPU."""
    model = hf_plookup.wrap(tiny_model("gemma3_text"), invariant=False, max_batch_tokens=16)
    ids, mask = left_pad(repeat_prompts(4))
    plain, st = greedy_logits(model, ids, mask, 12)
    chain, _ = greedy_logits(model, ids, mask, 12, prompt_lookup_num_tokens=4)
    assert not st.invariant
    assert not torch.equal(chain, plain)
    torch.testing.assert_close(chain, plain)  # only rounding apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_invariant_rows_equal_one_row_calls(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    x = torch.randn(2 * PROBE_ROWS + 3, 40, generator=g).to(dtype)  # more rows than one verified piece
    y = invariant_rows(x, w, b)
    exact_torch = row_strategy(w, b) in ("plain", "rows")  # else a kernel's own (M-free) rounding
    for i in range(x.shape[0]):
        alone = torch.nn.functional.linear(x[i : i + 1], w, b)
        assert torch.equal(y[i : i + 1], invariant_rows(x[i : i + 1], w, b))
        if exact_torch:
            assert torch.equal(y[i : i + 1], alone)
        else:
            torch.testing.assert_close(y[i : i + 1], alone)


def test_row_linear_rows_do_not_depend_on_the_call():
    """invariant.row_linear against a float64 reference, and each row bitwise the same alone, among
    other rows at any position, with any row count and thread count."""
    from hf_plookup.invariant.row_linear import row_linear

    g = torch.Generator().manual_seed(3)
    for n_out, k in ((48, 40), (67, 129), (200, 576)):
        w, b = torch.randn(n_out, k, generator=g), torch.randn(n_out, generator=g)
        x = torch.randn(21, k, generator=g)
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
        y = row_linear(x, w, b)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        alone = torch.cat([row_linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
        assert torch.equal(y, alone)
        perm = torch.randperm(x.shape[0], generator=g)
        assert torch.equal(row_linear(x[perm], w, b), alone[perm])
        for m in (2, 5, 9, 16):
            assert torch.equal(row_linear(x[-m:], w, b), alone[-m:])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(row_linear(x[:7], w, b), alone[:7])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(row_linear(x.t().contiguous().t(), w, b), alone)  # a strided input


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C kernels were not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norms_recognised_by_their_output(dtype):
    """`rms_form` names the arithmetic of Llama's and Gemma's RMSNorm (checked on random rows),
    and leaves alone what the C kernel does not compute: LayerNorm, a gated norm (it takes a
    second input), a norm on another dtype."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    llama, gemma = LlamaRMSNorm(40, eps=1e-6).to(dtype), Gemma3RMSNorm(40, eps=1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
    assert invariant_mod.rms_form(llama) == "scale_after"
    assert invariant_mod.rms_form(gemma) == "one_plus"
    assert invariant_mod.rms_form(torch.nn.LayerNorm(40).to(dtype)) is None
    assert invariant_mod.rms_form(Qwen3NextRMSNormGated(40).to(dtype)) is None
    assert invariant_mod.rms_form(llama.to(torch.float64)) is None
    x = torch.randn(3, 40).to(dtype)
    routed = invariant_mod.InvariantLinears(torch.nn.Sequential(gemma))
    assert routed.modules == [gemma]  # what an engine forward routes through cpu_kernels.rms_norm
    with torch.inference_mode():
        torch.testing.assert_close(routed.forwards[0](x), Gemma3RMSNorm.forward(gemma, x))


def test_tree_node_sees_context_then_its_ancestors():
    from hf_plookup.base.layout import StepLayout

    # one sequence, 3 cached tokens, a tree chunk: root, node 1 (child of root), node 2 (child of root), node 3 (child of 1)
    tree_mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)[None]
    qpos = np.array([[3, 4, 4, 5]])
    step = StepLayout(input_ids=np.zeros(4, np.int64), positions=qpos[0], depth=qpos[0] - 3,
                      slot_mapping=np.arange(3, 7), keep=np.arange(4), prefill=np.zeros(1, bool), query_pos=qpos,
                      kv_slots=np.arange(10, 17)[None], context_lens=np.array([7]),
                      block_tables=np.zeros((1, 1), np.int64), cu_seqlens_q=np.array([0, 4]),
                      cu_seqlens_k=np.array([0, 7]), tree_mask=tree_mask)
    layout = build_layout(step, torch.device("cpu"))
    assert [list(c) for _, _, _, c in layout.decode] == [[0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 1, 2, 3, 4, 6]]
    def slots(window):
        idx, bases, views, _ = layout.keys(window)
        out = []
        for base, start, n in views:
            off = bases[base][0] + start
            out.append(idx[off : off + n].tolist())
        return out

    # without a window each node reads its context then its ancestors
    assert slots(None) == [[10, 11, 12, 13], [10, 11, 12, 13, 14], [10, 11, 12, 13, 15], [10, 11, 12, 13, 14, 16]]
    assert slots(2)[3] == [14, 16]  # window 2: node 3 (position 5) sees positions 4 and 5 only


def test_invariant_option_validated_and_auto_policy():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="invariant"):
        hf_plookup.wrap(model, invariant="yes")
    with pytest.raises(ValueError, match="invariant"):
        hf_plookup.wrap(model, invariant=1)
    cpu = [torch.device("cpu")]
    assert resolve_invariant("auto", cpu, [torch.bfloat16], "sdpa")
    assert resolve_invariant("auto", cpu, [torch.float32], "sdpa") == cpu_kernels.available()  # fp32: with the kernels
    assert not resolve_invariant("auto", [torch.device("cuda")], [torch.bfloat16], "sdpa")  # not measured
    for flag in ("compiled", "hooked", "distributed"):
        assert not resolve_invariant("auto", cpu, [torch.bfloat16], "sdpa", **{flag: True})
    assert not resolve_invariant("auto", cpu, [torch.bfloat16], "triton")  # not measured
    assert resolve_invariant(True, cpu, [torch.float32], "triton")
    with pytest.raises(ValueError, match="attn_backend"):
        resolve_invariant(True, [torch.device("cuda")], [torch.bfloat16], "flash_attn")
    assert hf_plookup.wrap(model, invariant=True).generate(
        input_ids=torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=2).shape == (1, 7)


def _chat(tokenizer, docs: list[str]) -> list[torch.Tensor]:
    texts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": "Summarize the following text in two sentences.\n\n" + d}],
        add_generation_prompt=True, tokenize=False) for d in docs]
    return [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


@pytest.mark.slow
def test_smollm2_bf16_drafts_and_batch_equal_plain_greedy():
    if not embedded.is_available("smollm2-135m"):
        pytest.skip("smollm2-135m package not installed")
    model, tok = embedded.load_embedded("smollm2-135m", dtype=torch.bfloat16)
    wrapped = hf_plookup.wrap(model)  # auto: on for bf16 on CPU
    docs = [json.loads(line)["document"] for line in DOCS.read_text().splitlines()[:4]]
    new = 48

    def gen(ids, mask=None, **kw):
        mask = torch.ones_like(ids) if mask is None else mask
        out = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw)
        assert wrapped.last_stats.invariant
        return out[:, ids.shape[1]:]

    for p in _chat(tok, docs[:1]):  # ~400 tokens
        plain = gen(p[None])
        for kw in ({"prompt_lookup_num_tokens": 4}, {"prompt_lookup_num_tokens": 8},
                   {"prompt_lookup_num_tokens": 8, "prompt_lookup_tree_nodes": 16}):
            assert torch.equal(gen(p[None], **kw), plain), kw
    # a left-padded batch of 4 (shortened documents, different lengths) against each prompt alone
    rows = _chat(tok, [d[: 200 + 50 * i] for i, d in enumerate(docs)])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, mask = left_pad(rows, pad)
    new = 16
    batch = gen(ids, mask, prompt_lookup_num_tokens=4, pad_token_id=pad)
    for i, r in enumerate(rows):
        alone = gen(r[None], prompt_lookup_num_tokens=4)[0]
        assert torch.equal(batch[i, : len(alone)], alone), i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("backend, compiled", [("sdpa", False), ("triton", False), ("triton", True)])
def test_cuda_bf16_drafts_change_no_logit(arch, backend, compiled):
    """CUDA, bf16: eager steps on sdpa (its per-query form; graphs off), and on Triton captured
    in CUDA graphs, eager or inductor-compiled (the Triton attention's invariant form,
    invariant.triton_linear for the linears cuBLAS's rows fail the check on)."""
    model = hf_plookup.wrap(tiny_model(arch).to("cuda", torch.bfloat16), invariant=True, max_batch_tokens=16,
                            attn_backend=backend, compile=compiled, max_cache_tokens=4096)
    try:
        ids, mask = left_pad(repeat_prompts(4))
        ids, mask = ids.cuda(), mask.cuda()
        plain = _drafts_change_no_logit(model, ids, mask, 20)
        r = ids[3:4]  # the longest prompt: no padding
        alone, _ = greedy_logits(model, r, torch.ones_like(r), 20, prompt_lookup_num_tokens=4)
        assert torch.equal(alone[0], plain[3, : alone.shape[1]])
        graphs = model._engine._graphs
        assert (graphs is not None and graphs.num_replays > 0) == (backend == "triton")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("arch, dtype", [("llama", torch.float32), ("gemma3_text", torch.bfloat16)])
def test_seeded_sampling_same_tokens_whatever_the_batch_and_drafts(arch, dtype):
    """Sampling draws each output position from a uniform keyed by (row seed, position)
    (drafting.verify), so with invariant logits a seeded row samples the same tokens alone, in a
    batch beside other prompts, with or without drafts, chains or trees."""
    model = wrap_copy(tiny_model(arch).to(dtype), invariant=True, max_batch_tokens=16)
    rows = repeat_prompts(4, seed=7)
    kw = dict(max_new_tokens=24, do_sample=True, temperature=1.3, top_k=40, pad_token_id=PAD, eos_token_id=None)

    def sample(rows, seed=11, **more):
        ids, mask = left_pad(rows)
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, **kw, **more)
        assert model.last_stats.invariant and not model.last_stats.delegated
        return out[:, ids.shape[1]:], model.last_stats

    batch, _ = sample(rows)
    alone, _ = sample(rows[:1])
    assert torch.equal(alone[0], batch[0]), "row 0 alone differs from row 0 of a batch of 4"
    other, _ = sample([rows[0], rows[3]])
    assert torch.equal(other[0], batch[0]) and not torch.equal(other[1], batch[1])
    chain, st = sample(rows, prompt_lookup_num_tokens=4)
    assert st.drafted > 0 and torch.equal(chain, batch), "drafts changed sampled tokens"
    tree, st = sample(rows, prompt_lookup_num_tokens=4, prompt_lookup_tree_nodes=8)
    assert st.drafter == "ngram-tree" and st.drafted > 0 and torch.equal(tree, batch)
    different, _ = sample(rows, seed=12)
    assert not torch.equal(different, batch)


def test_position_uniforms_and_inverse_cdf():
    from hf_plookup.drafting.verify import position_uniforms, row_seeds, sample_targets

    seeds = row_seeds(123, 4)
    assert len(set(seeds.tolist())) == 4 and np.array_equal(row_seeds(123, 2), seeds[:2])
    pos = np.arange(20000)
    u = position_uniforms(np.repeat(seeds[:1], len(pos)), pos)
    assert np.array_equal(u[5:9], position_uniforms(np.repeat(seeds[:1], 4), pos[5:9]))  # keyed, not stateful
    assert 0 < u.min() and u.max() < 1
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.abs(hist - 2000).max() < 200  # about uniform (about 4.7 sigma)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.05
    v = position_uniforms(np.repeat(seeds[1:2], len(pos)), pos)
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.05  # rows draw independently
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).repeat(6, 1)
    grid = np.array([1e-9, 0.2499, 0.2501, 0.6, 0.999999, 1 - 2.0**-53])
    assert sample_targets(probs, grid).tolist() == [1, 1, 3, 3, 3, 3]  # the CDF's intervals; p=0 never


@pytest.mark.parametrize("arch, dtype", [("gemma3_text", torch.bfloat16)])  # sliding windows, bf16
def test_compiled_steps_change_no_logit(arch, dtype):
    """Invariant mode in compiled steps (inductor on CPU): 1-token, verify and tree steps are
    compiled per bucket, every row padded to it; the linears and attention stay the mode's own
    (opaque ops), inductor fuses the rest (norms, RoPE, activations) and keeps each row's
    arithmetic whatever the bucket."""
    model = wrap_copy(tiny_model(arch).to(dtype), invariant=True, compile=True, max_batch_tokens=16, max_cache_tokens=1024)
    try:
        _drafts_change_no_logit(model, *left_pad(repeat_prompts(4)), 8)
        graphs = model._engine._graphs
        assert graphs.compiled and graphs.num_replays > 0 and {k[0] for k in graphs.graphs} == {1, 5, 9}
    finally:
        torch._dynamo.reset()  # drop compiled graphs (they hold the test's model)


def test_triton_backend_drafts_change_no_logit():
    """The Triton backend's invariant form (under the interpreter on CPU) in eager steps: packed
    prompt chunks, 1-token, verify and tree steps. (Its static-buffer steps, the ones CUDA graphs
    capture, run the same kernel through the attention op, as the compiled sdpa test runs it.)"""
    if importlib.util.find_spec("triton") is None:  # pragma: no cover - triton ships with the test extra
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():  # no interpreter there, and Triton takes no CPU model
        pytest.skip("the interpreter's test: on CUDA, test_cuda_bf16_drafts_change_no_logit runs this backend")
    model = wrap_copy(tiny_model("llama"), invariant=True, attn_backend="triton", max_batch_tokens=16, block_size=16,
                      max_cache_tokens=1024)
    _drafts_change_no_logit(model, *left_pad(repeat_prompts(4)), 6)
    assert model.last_stats.attn_backend == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_row_linear_rows_do_not_depend_on_the_call(dtype):
    """invariant.triton_linear (the CUDA linear of invariant mode; the interpreter here) against a
    float64 reference, each row bitwise the same alone, at any position and row count (more
    than one row block), with and without bias, K and N off its tile sizes."""
    if importlib.util.find_spec("triton") is None:  # pragma: no cover
        pytest.skip("triton is not installed")
    from hf_plookup.invariant.triton_linear import row_linear

    g = torch.Generator().manual_seed(5)
    for n_out, k, bias in ((48, 40, True), (67, 129, False)):
        w = torch.randn(n_out, k, generator=g).to(DEVICE, dtype)
        b = torch.randn(n_out, generator=g).to(DEVICE, dtype) if bias else None
        x = torch.randn(21, k, generator=g).to(DEVICE, dtype)
        y = row_linear(x, w, b)
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
        alone = torch.cat([row_linear(x[i : i + 1], w, b) for i in range(x.shape[0])])
        assert torch.equal(y, alone)
        for m in (2, 5, 17):
            assert torch.equal(row_linear(x[-m:], w, b), alone[-m:])


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested-absmax"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_row_linear_reads_bitsandbytes_4bit_codes(dtype, quant_type, nested):
    """The Triton row linear over a bitsandbytes `Linear4bit`'s flat codes (invariant.bnb4bit's
    view): bitwise the same kernel over the weight bitsandbytes itself dequantizes
    (`dequantize_4bit`, the compute dtype), every row as alone; blocks of 64 over K = 192 (three
    tiles of K, a block never spanning two), N off the tile width."""
    if importlib.util.find_spec("triton") is None:  # pragma: no cover
        pytest.skip("triton is not installed")
    bnb = pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnb_f

    from hf_plookup.invariant import bnb4bit
    from hf_plookup.invariant.triton_linear import row_linear, supported

    g = torch.Generator().manual_seed(6)
    n_out, k = 40, 192
    module = bnb.nn.Linear4bit(k, n_out, bias=True, compute_dtype=dtype, compress_statistics=nested,
                               quant_type=quant_type)
    with torch.no_grad():
        module.weight = bnb.nn.Params4bit(torch.randn(n_out, k, generator=g), requires_grad=False,
                                          compress_statistics=nested, quant_type=quant_type, blocksize=64)
        module.bias.copy_(torch.randn(n_out, generator=g))
    module = module.to(DEVICE)  # (moving it quantizes the weight)
    state = module.weight.quant_state
    assert bool(state.nested) == nested and state.blocksize == 64
    w = bnb4bit.linear_weight(module)
    assert w.flat() is not None and supported(w) == (DEVICE == "cuda")
    values = bnb_f.dequantize_4bit(module.weight.data, state).to(dtype)
    bias = module.bias.to(dtype)
    x = torch.randn(21, k, generator=g).to(DEVICE, dtype)
    y = row_linear(x, w, bias)
    assert torch.equal(y, row_linear(x, values, bias))
    alone = torch.cat([row_linear(x[i : i + 1], w, bias) for i in range(x.shape[0])])
    assert torch.equal(y, alone) and all(torch.equal(row_linear(x[-m:], w, bias), alone[-m:]) for m in (2, 5, 17))
    ref = torch.nn.functional.linear(x.double(), values.double(), bias.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_prompt_chunk_cut_into_units():
    """A prompt chunk spanning several of the scheduler's units (positions 100..399, units of 128)
    is cut at the unit boundaries: each piece its own attention call and row group, all reading
    one gathered run of the sequence's keys."""
    from hf_plookup.base.layout import StepLayout

    n, start = 300, 100
    step = StepLayout(input_ids=np.zeros(n, np.int64), positions=np.arange(start, start + n), depth=np.zeros(n, np.int64),
                      slot_mapping=np.arange(start, start + n), keep=np.array([n - 1]), prefill=np.ones(1, bool),
                      query_pos=np.arange(start, start + n)[None], kv_slots=np.arange(1000, 1400)[None],
                      context_lens=np.array([400]), block_tables=np.zeros((1, 1), np.int64),
                      cu_seqlens_q=np.array([0, n]), cu_seqlens_k=np.array([0, 400]))
    layout = build_layout(step, torch.device("cpu"), prefill_unit=128)
    assert layout.prefill == [(0, 28, 0, 100), (28, 128, 0, 128), (156, 128, 0, 256), (284, 16, 0, 384)]
    assert layout.row_groups == [(0, 28, True), (28, 156, True), (156, 284, True), (284, 300, True)]
    idx, bases, views, masks = layout.keys(None)
    assert bases == [(0, 400)] and idx.tolist() == list(range(1000, 1400))
    assert views == [(0, 0, 128), (0, 0, 256), (0, 0, 384), (0, 0, 400)]
    assert masks[0].shape == (28, 128) and masks[0][0].sum() == 101  # position 100 sees positions 0..100
    assert build_layout(step, torch.device("cpu")).prefill == [(0, 300, 0, 100)]  # no unit: one piece


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_merged_prompt_calls_equal_each_chunk_alone(dtype):
    """Where `merge_safe` says so, torch's call over several prompt chunks gives each row as the
    chunk's own call, also for chunk sizes the check did not try; `_merged` then joins them, and
    always joins neighbouring groups of the row kernel."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=g).to(dtype)
    sizes = [65, 128, 90, 128, 128, 71, 128, 128, 120]
    cuts = np.cumsum([0, *sizes]).tolist()
    x = torch.randn(cuts[-1], 80, generator=g).to(dtype)
    alone = torch.cat([torch.nn.functional.linear(x[a:b], w) for a, b in zip(cuts, cuts[1:])])
    safe = invariant_mod.merge_safe(w, None)
    if safe:
        for a, b in [(0, 5), (2, 9), (1, 4), (3, 8)]:
            assert torch.equal(torch.nn.functional.linear(x[cuts[a] : cuts[b]], w), alone[cuts[a] : cuts[b]])
    groups = [(0, 128, True), (128, 256, True), (256, 296, True), (296, 299, False)]
    calls = invariant_mod._merged(groups, w, None)
    torch_calls = [[0, 256, "gemm"]] if safe else [[0, 128, "gemm"], [128, 256, "gemm"]]
    if invariant_mod._group_call(128, True, w, None) == "cpu":
        # bf16 where torch's bf16 GEMM is not native (an AVX2 CPU): long chunks take the row kernel too
        assert calls == [[0, 299, "cpu"]]
    elif row_strategy(w, None) == "cpu":  # the 40-row chunk padded for torch's call, the decode rows on the row kernel
        assert calls == [*torch_calls, [256, 296, "padded"], [296, 299, "cpu"]]
    # a weight whose decode rows take another strategy: short chunks take it too, alone, never merged
    invariant_mod._STRATEGIES[invariant_mod.strategy_key(w, None)] = "rows"
    try:
        calls = invariant_mod._merged([(0, 40, True), (40, 80, True), (80, 208, True), (208, 336, True)], w, None)
    finally:
        invariant_mod._STRATEGIES.pop(invariant_mod.strategy_key(w, None))
    assert calls == [[0, 40, "rows"], [40, 80, "rows"], *([[80, 336, "gemm"]] if safe else [[80, 208, "gemm"], [208, 336, "gemm"]])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_units_per_step_change_no_logit(dtype):
    """Prompts of several units each: with a budget of 1024 tokens a prompt takes several units
    in one step (merged calls), with 128 one unit per step; the logits are bitwise the same, with
    and without drafts, and in float32 the tokens are HF's."""
    hf = tiny_model("llama").to(dtype)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, 96, (n,), generator=g).repeat(4)[: 4 * n - 5] for n in (90, 70, 40)]  # 355, 275, 155 tokens
    ids, mask = left_pad(rows)
    wide = wrap_copy(hf, invariant=True, max_batch_tokens=1024)
    narrow = wrap_copy(hf, invariant=True, max_batch_tokens=128)
    plain, st = greedy_logits(wide, ids, mask, 10)
    assert st.invariant and st.forwards < greedy_logits(narrow, ids, mask, 10)[1].forwards
    assert torch.equal(greedy_logits(narrow, ids, mask, 10)[0], plain)
    assert torch.equal(greedy_logits(wide, ids, mask, 10, prompt_lookup_num_tokens=4)[0], plain)
    r = rows[0][None]
    alone, _ = greedy_logits(wide, r, torch.ones_like(r), 10)
    assert torch.equal(alone[0], plain[0, : alone.shape[1]])  # (alone, it stops at its EOS)
    if dtype == torch.float32:
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
        assert torch.equal(plain.argmax(-1), ref[:, ids.shape[1]:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemm_into_gives_f_linears_bits(dtype):
    """A prompt's torch calls write their rows into the step's output in place (`_gemm_into`):
    the same bits as F.linear's own result, with a bias and without, in rows of a larger output."""
    torch.manual_seed(0)
    x, w, b = torch.randn(300, 576).to(dtype), torch.randn(1536, 576).to(dtype), torch.randn(1536).to(dtype)
    for bias in (None, b):
        out = torch.full((305, 1536), float("nan"), dtype=dtype)
        invariant_mod._gemm_into(x, w, bias, out[5:])
        assert torch.equal(out[5:], torch.nn.functional.linear(x, w, bias))
        assert out[:5].isnan().all()


def test_padded_gemm_literal():
    """A short prompt chunk is rows 0..m-1 of one F.linear of PREFILL_TORCH_ROWS + 1 rows, zeros below."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 16, generator=g), torch.randn(40, 16, generator=g)
    padded = torch.cat([x, torch.zeros(invariant_mod.PREFILL_TORCH_ROWS + 1 - 40, 16)])
    assert torch.equal(invariant_mod._padded_gemm(x, w, None), torch.nn.functional.linear(padded, w)[:40])
    assert invariant_mod._group_call(40, True, w, None) == "padded"
    assert invariant_mod._group_call(invariant_mod.PADDED_MIN_ROWS[torch.float32] - 1, True, w, None) == "cpu"
    assert invariant_mod._group_call(40, False, w, None) == "cpu"  # decode rows: the row kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_padded_prompt_tails_change_no_logit(dtype):
    """Prompts whose last unit is short enough for the padded call (128 + 40, 30 and 50 tokens, units of
    128; fp32 pads the 40 and 50, bf16 all three): with drafts, trees and in a batch the logits are
    those of greedy alone, and fp32's tokens HF's."""
    hf = tiny_model("llama").to(dtype)
    model = wrap_copy(hf, invariant=True, max_batch_tokens=128)
    g = torch.Generator().manual_seed(9)
    rows = [torch.randint(3, 96, (n,), generator=g) for n in (24, 10, 17)]
    rows = [r.repeat(8)[:n] for r, n in zip(rows, (168, 30, 50))]
    ids, mask = left_pad(rows)
    plain = _drafts_change_no_logit(model, ids, mask, 12)
    r = rows[2][None]
    alone, _ = greedy_logits(model, r, torch.ones_like(r), 12, prompt_lookup_num_tokens=4)
    assert torch.equal(alone[0], plain[2, : alone.shape[1]])
    if dtype == torch.float32:
        ref = hf.generate(input_ids=r, attention_mask=torch.ones_like(r), max_new_tokens=12, do_sample=False,
                          pad_token_id=PAD)
        got = model.generate(input_ids=r, attention_mask=torch.ones_like(r), max_new_tokens=12, do_sample=False,
                             pad_token_id=PAD, prompt_lookup_num_tokens=4)
        assert torch.equal(got, ref)
