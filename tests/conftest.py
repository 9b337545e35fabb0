"""Shared fixtures and helpers: tiny random causal LMs built from configs (no weights to download),
their prompts, the one dense attention reference every attention test checks against, and the
stand-ins those tests give the backends."""

from __future__ import annotations

import os

# Under pytest-xdist (the README's `-n 2`) each worker process takes an equal share of the cores, for
# torch, the C kernels' pool, numba and the scripts the tests start: two workers that each used every
# core of a 2-core machine spun against each other and ran the suite slower than one process did.
# Tests of thread counts set their own.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_var, str(max(1, _cores // _WORKERS)))

# Without CUDA the Triton kernels run under Triton's interpreter. Triton reads this when its
# functions are decorated, including the ones of `triton.language` itself, so it must be set
# before anything in the session imports triton (torch or transformers may do so).
if "TRITON_INTERPRET" not in os.environ:
    import torch.cuda  # noqa: E402  (does not import triton)

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The package as installed where no C compiler was found (pyproject.toml's optional extension):
# set by tests/cpu/test_without_c_kernels.py for the child pytest run it starts
if os.environ.get("HF_PLOOKUP_TEST_WITHOUT_C") == "1":
    import sys

    sys.modules["hf_plookup._cpu_kernels"] = None  # its import then raises ImportError

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:  # in case a plugin imported torch before the variable was set
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Tests that take tens of seconds on 2 cores (real weights: marked slow; subprocesses, compiling, the
# architecture sweep: named here) start first, and the workers steal each other's pending tests
# (pyproject's `--dist worksteal`), so that the two workers end together rather than one waiting
# for the other's long test, started last.
_LONG_TESTS = ("test_second_process_loads_the_first_ones_compiled_steps", "test_bench_smoke",
               "test_summarize_two_processes", "test_tensor_parallel_two_cpu_ranks_match_single_process",
               "test_warmup_builds_the_buckets_before_the_first_call", "test_soak_bounded",
               "test_compiled_steps_change_no_logit", "test_cpu_memory_on_a_quantized_model", "test_cpu_memory_smoke",
               "test_invariant_mode_without_the_c_kernels", "test_every_causal_lm_type_runs_as_hf_greedy_or_is_refused",
               "test_step_bench_smoke", "test_bench_on_a_quantized_model", "test_bench_starts_both_ways_for_real",
               "test_every_eval_script_starts_both_ways")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.originalname in _LONG_TESTS))

from transformers import AutoConfig, AutoModelForCausalLM, StoppingCriteria

VOCAB = 96
PAD, EOS, BOS = 0, 1, 2

_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=BOS,
    initializer_range=0.3,
)

# architecture -> config overrides; Mistral and Gemma 3 get sliding windows smaller than the prompts
ARCHS = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma3_text": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,  # scaling != 1/sqrt(head_dim)
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3": {},
    "olmo2": {},
    "gpt_neox": {"num_key_value_heads": None, "rotary_pct": 0.5},
    # GPT-NeoX has no GQA and ignores this field: the cache layout must come from the real keys
    "gpt_neox_kv_field": {"model_type": "gpt_neox", "num_key_value_heads": 2, "rotary_pct": 0.5},
    "stablelm": {"partial_rotary_factor": 0.25, "qk_layernorm": True, "use_parallel_residual": True},
    "gemma2": {  # attention and final logit soft-capping, alternating sliding/global layers
        "head_dim": 16, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0,
        "sliding_window": 8, "query_pre_attn_scalar": 24,
        # its reference attention: transformers before 5.2x defaulted Gemma 2 to sdpa, which drops the
        # attention softcap (later versions refuse sdpa for it)
        "attn_implementation": "eager",
    },
    "cohere": {"logit_scale": 0.5},  # parallel attention and MLP
    "gpt_bigcode": {"multi_query": True, "num_key_value_heads": None},  # MQA
    "starcoder2": {"sliding_window": 8},
    "granite": {"attention_multiplier": 0.2, "residual_multiplier": 0.5, "embedding_multiplier": 2.0, "logits_scaling": 2.0},
    "phi": {"partial_rotary_factor": 0.5, "num_key_value_heads": None},
    "olmo": {},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "smollm3": {"no_rope_layer_interval": 2},  # some layers without rotary embeddings
    "exaone4": {"sliding_window": 8, "head_dim": 16},
    # multi-head latent attention: keys of 16 + 8 values per head, values of 12 (pages of two widths);
    # DeepSeek V3 with a routed-expert MLP in its second layer, MiniCPM3 dense
    "deepseek_v3": {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 16, "v_head_dim": 12, "moe_intermediate_size": 32, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
    "minicpm3": {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                 "qk_nope_head_dim": 16, "v_head_dim": 12},
    # BERT and RoBERTa as decoders: absolute position embeddings (RoBERTa's counted from its padding
    # index unless given position_ids, which HF's generate gives), token type embeddings
    "bert_decoder": {"model_type": "bert", "is_decoder": True},
    "roberta_decoder": {"model_type": "roberta", "is_decoder": True},
    # attention sinks (one extra logit per head in the softmax), alternating sliding/full layers, MoE
    "gpt_oss": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                "num_local_experts": 4, "num_experts_per_tok": 2},
    # position embeddings counted from the cache, no position_ids in their forward: handed the
    # engine's positions plus each row's left pads (attention.positions); learned and sinusoidal
    "bart": {"decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128, "encoder_layers": 1,
             "encoder_attention_heads": 4, "encoder_ffn_dim": 128, "num_key_value_heads": None},
    "pegasus": {"decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128, "encoder_layers": 1,
                "encoder_attention_heads": 4, "encoder_ffn_dim": 128, "num_key_value_heads": None},
}
# hybrid and state-space models: recurrent token mixers whose per-sequence states live beside the
# pages (mixers.recurrent); they draft chains only and run eagerly only, so the tests of trees,
# compiled steps and invariant mode over ARCHS leave them out
RECURRENT_ARCHS = {
    # gated delta net + full attention, MoE MLP (Qwen 3.5 and OLMo-Hybrid share the mixer)
    "qwen3_next": {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32},
    # Mamba-2 mixer, attention, and layers that mix no tokens (MoE, MLP)
    "nemotron_h": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
                   "head_dim": 16, "ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
                   "n_routed_experts": 4, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32},
    # a Mamba-2 mixer and attention side by side in every layer (one layer index, a state and pages)
    "falcon_h1": {"head_dim": 16, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1,
                  "mamba_d_state": 16, "mamba_chunk_size": 16},
    "lfm2": {"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False},  # short convolution
    "mamba": {"state_size": 8},  # no attention at all: no pages, and padded rows need no positions
}

# positions counted from the cache: a left-padded row's pads count (as in HF), so a row alone and
# in a padded batch differ; run eagerly only (attention.positions patches a module per step)
POSITIONS_FROM_CACHE = {"bart", "pegasus"}
# steps run eagerly only: compile=True is refused (positions handed by a patch, attention sinks)
EAGER_ONLY = POSITIONS_FROM_CACHE | {"gpt_oss"}
# refused at wrap time, with the architecture and the reason in the message
REFUSED_ARCHS = {"xglm": "AttentionInterface", "bloom": "AttentionInterface", "falcon": "probe forward",
                 "bert": "attend both ways",  # built as a causal LM without is_decoder=True
                 # takes its positions from its cache's length, not from position_ids: decode steps would differ
                 "diffllama": "fed the way the engine feeds later tokens"}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    kw = dict(_BASE)
    kw.update(ARCHS.get(arch, RECURRENT_ARCHS.get(arch, {})))
    kw.update(overrides)
    kw = {k: v for k, v in kw.items() if v is not None}
    config = AutoConfig.for_model(kw.pop("model_type", arch), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if arch in POSITIONS_FROM_CACHE:
        # their configs force EOS at the length limit, a processor that reads the tokens, with which
        # no candidate trees are drafted (Engine.uses_trees); the tests compare plain greedy
        model.generation_config.forced_eos_token_id = None
    return model


def left_padded(batch: int, seed: int = 1, period: int = 12, repeats: float = 2.5, pad_step: int = 3):
    """[batch, L] prompts made of a random phrase repeated (so n-grams recur), row i left-padded
    with i * pad_step pad tokens; returns (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (batch, period), generator=g)
    reps = int(repeats) + 1
    ids = phrase.repeat(1, reps)[:, : int(period * repeats)]
    mask = torch.ones_like(ids)
    for i in range(batch):
        ids[i, : i * pad_step] = PAD
        mask[i, : i * pad_step] = 0
    return ids, mask


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


def wrap_copy(model: torch.nn.Module, **options) -> torch.nn.Module:
    """`hf_plookup.wrap` on a shallow copy of `model`: the same weights and submodules (hooks and
    config shared), while `model` itself stays the plain HF model that tests compare against
    (`wrap` swaps the class of the object it is given). Every draft is fed (`tree_min_score=0`)
    unless a test says otherwise: the default draft budget feeds what measured step costs say
    pays (engine.budget), so what a test counts would depend on how fast the machine runs;
    tests/engine/test_budget.py covers the budget with costs given by hand."""
    import copy

    import hf_plookup

    options.setdefault("tree_min_score", 0.0)
    return hf_plookup.wrap(copy.copy(model), **options)


# -- the one dense attention reference, and the stand-ins the attention tests hand the backends ----
def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention in float64, plain math: queries `q` [Lq, H, D] over keys `k` [Lk, H_kv, D] and
    values `v` [Lk, H_kv, Dv] (query heads grouped over KV heads in order), query i seeing key j
    where `visible[i, j]`; scores soft-capped as Gemma does when `softcap`. A query that sees no
    key gets zeros. Returns [Lq, H, Dv] float64.

    Example: one head, q = [[0.]], keys at 0 and 1 both visible, values [[1.], [3.]]: [[[2.]]]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~visible.to(s.device)[None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


def causal_visible(lq: int, lk: int, window: int | None = None, left: int | None = None,
                   right: int = 0) -> torch.Tensor:
    """[Lq, Lk] bool: the Lq queries are the last Lq positions of a context of Lk keys; query i
    (at position lk - lq + i) sees keys up to `right` past its own and, with `window` (HF's sliding
    window: the query and window - 1 keys before it) or `left` (flash-attn's: left keys before it),
    none further back. right < 0 or left < 0: unbounded on that side.

    Example: causal_visible(2, 3) == [[True, True, False], [True, True, True]]."""
    i = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        ok &= j <= i + right
    if window:
        left = window - 1
    if left is not None and left >= 0:
        ok &= j >= i - left
    return ok


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """dense_attention with head-major tensors, q [H, Lq, D] the last Lq positions of a context of
    k/v [H_kv, Lk, D], causal (and sliding `window`): [H, Lq, Dv] float32."""
    visible = causal_visible(q.shape[1], k.shape[1], window)
    out = dense_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), visible, scale, softcap)
    return out.transpose(0, 1).float()


class OneLayer(torch.nn.Module):
    """An attention module as the backends see it: layer 0."""

    layer_idx = 0


class FixedPages:
    """A PagedKVCache as the backends see it: every layer's pages are these."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


def paged_step(dtype, bs: int, uniform: bool, device="cuda"):
    """Random paged step on `device`: (meta, query, key, value, per-sequence dense tensors)."""
    from hf_plookup.attention.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(0)
    h, h_kv, d = 8, 2, 64
    cached = [0, 7, 300, 22]
    new = [3, 3, 3, 3] if uniform else [1, 5, 2, 9]
    b = len(cached)
    ctx = [c + n for c, n in zip(cached, new)]
    num_blocks = sum(-(-t // bs) for t in ctx) + 3  # every context's pages, and a few spare to scatter among
    k_cache = torch.randn(num_blocks, bs, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, h_kv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-t // bs))] for t in ctx]
    full_k = [torch.randn(h_kv, t, d, generator=g).to(dtype) for t in ctx]
    full_v = [torch.randn(h_kv, t, d, generator=g).to(dtype) for t in ctx]
    for i in range(b):
        for p in range(cached[i]):
            k_cache[tables[i][p // bs], p % bs] = full_k[i][:, p]
            v_cache[tables[i][p // bs], p % bs] = full_v[i][:, p]
    tq, lk = max(new), max(ctx)
    width = max(len(t) for t in tables)
    bt = torch.zeros(b, width, dtype=torch.int32)
    kv_slots = torch.zeros(b, lk, dtype=torch.long)
    query_pos = torch.full((b, tq), -1, dtype=torch.long)
    slots, scatter = [], []
    for i in range(b):
        bt[i, : len(tables[i])] = torch.tensor(tables[i])
        for p in range(ctx[i]):
            kv_slots[i, p] = tables[i][p // bs] * bs + p % bs
        for j in range(new[i]):
            query_pos[i, j] = cached[i] + j
            slots.append(int(kv_slots[i, cached[i] + j]))
            scatter.append(i * tq + j)
    scatter = torch.tensor(scatter)
    gather = torch.zeros(b * tq, dtype=torch.long)
    gather[scatter] = torch.arange(len(scatter))

    k_cache_d, v_cache_d = k_cache.to(device), v_cache.to(device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        kv_cache=FixedPages(k_cache_d, v_cache_d), slot_mapping=torch.tensor(slots, device=device), query_pos=query_pos.to(device),
        kv_slots=kv_slots.to(device), context_lens=torch.tensor(ctx, device=device),
        q_gather=None if uniform else gather.to(device), q_scatter=None if uniform else scatter.to(device),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], **i32),
        cu_seqlens_k=torch.tensor([0, *torch.tensor(ctx).cumsum(0).tolist()], **i32),
        cache_seqlens=torch.tensor(ctx, **i32), block_tables=bt.to(device),
    )
    qs = [torch.randn(h, n, d, generator=g).to(dtype) for n in new]
    query = torch.cat(qs, dim=1)[None].to(device)
    key = torch.cat([full_k[i][:, cached[i] :] for i in range(b)], dim=1)[None].to(device)
    value = torch.cat([full_v[i][:, cached[i] :] for i in range(b)], dim=1)[None].to(device)
    return meta, query, key, value, qs, full_k, full_v, new


# -- prompts and generation helpers shared by several test modules -------------------------------
def greedy_logits(model, ids, mask, new, **kw):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD,
                         return_dict_in_generate=True, output_logits=True, **kw)
    return torch.stack(out.logits, 1), model.last_stats  # [B, new, V]


def repeat_prompts(n_rows: int, seed: int = 1) -> list[torch.Tensor]:
    """Repetitive prompts of different lengths (drafts find matches in them)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_rows):
        base = torch.randint(3, 96, (5 + i,), generator=g)
        rows.append(torch.cat([base, base, base[:3]]))
    return rows


def left_pad(rows: list[torch.Tensor], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def copy_model():
    return tiny_model("mistral", sliding_window=4)


def copy_batch(model, batch: int = 4, g_len: int = 16):
    """Rows P_i + G_i + P_i (len(P_i) = 8 + 2i, G_i = greedy continuation of P_i), left-padded
    (12, 8, 4, 0 pads: not all multiples of 3). Returns (input_ids, attention_mask, [G_i])."""
    rows, conts = [], []
    for i in range(batch):
        g = torch.Generator().manual_seed(100 + i)
        p = torch.randint(3, VOCAB, (1, 8 + 2 * i), generator=g)
        cont = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=g_len, do_sample=False, eos_token_id=None)
        cont = cont[0, p.shape[1] :]
        rows.append(torch.cat([p[0], cont, p[0]]))
        conts.append(cont.tolist())
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask, conts


class StopOnToken(StoppingCriteria):
    """Stops a row when its last token is `token` (so it must be asked after every token)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def torchao_linear(config, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Linear:
    """An `nn.Linear(k, n)` of seeded normal weights and bias in `dtype`, quantized by torchao's own
    `quantize_` with `config`."""
    from torchao.quantization import quantize_

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(k, n))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(n, k, generator=g))
        model[0].bias.copy_(torch.randn(n, generator=g))
    model = model.to(dtype)
    quantize_(model, config)
    return model[0]


def at_every_simd_level(fn) -> dict:
    """`fn()` at each SIMD level of the C kernels this CPU has, from the portable C (level 0) up,
    the top level restored after: {level: result}."""
    from hf_plookup.cpu import kernels as cpu_kernels

    outs = {}
    top = cpu_kernels.simd_level()
    try:
        for level in range(top + 1):
            cpu_kernels.set_simd_level(level)
            outs[level] = fn()
    finally:
        cpu_kernels.set_simd_level(top)
    return outs


def rows_alone_and_float_linear(weight, bias, values, x, counts) -> torch.Tensor:
    """A C linear over a quantized `weight` checked on the first m rows of `x` for each m of
    `counts`: equal to its rows run one at a time, bit for bit, and the float linear of its
    dequantized `values` (`assert_float_linear`). Returns the rows run one at a time."""
    from hf_plookup.cpu import kernels as cpu_kernels

    rows = torch.cat([cpu_kernels.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])
    for m in counts:
        got = cpu_kernels.linear(x[:m], weight, bias)
        assert torch.equal(got, rows[:m]), m
        assert_float_linear(got, weight, values, x[:m], bias, m)
    return rows


_UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_float_linear(got, weight, values, x, bias=None, msg=None) -> None:
    """`got`, a C linear's outputs of `x` (the inputs it multiplies) over a quantized `weight`, is the
    float (W_FLOAT) linear of its dequantized `values`: bit for bit, but for a W_Q4K weight, whose
    sums go in 16 lanes over k where W_FLOAT's go in one chain (csrc/cpu_kernels.h): then its values
    read back from its packed bytes are `values` exactly (the linear of one-hot rows gives each
    alone), and its outputs are within what two orders of the same fp32 sums and one rounding each
    to the dtype can part by (2 K u32 |x| |w| + 2 u |y|). `values` of another dtype than `got`
    (float32 values of a bf16 weight: tinygemm's) make the float linear one in their dtype, rounded."""
    from hf_plookup.cpu import kernels as cpu_kernels

    dt = values.dtype
    want = cpu_kernels.linear(x.to(dt).contiguous(), values.contiguous(), None if bias is None else bias.to(dt))
    want = want.to(got.dtype)
    if cpu_kernels.weight_kind(weight) != cpu_kernels.W_Q4K:
        assert torch.equal(got, want), msg
        return
    n, k = values.shape
    eye = torch.eye(k, dtype=dt)
    alone = cpu_kernels._linear_call(eye, cpu_kernels.packed(weight), cpu_kernels.W_Q4K, None, n)
    assert torch.equal(alone.t(), values), msg
    size = x.double().abs() @ values.double().abs().t() + (0 if bias is None else bias.double().abs())
    bound = 2 * k * _UNIT[torch.float32] * size + 2 * _UNIT[got.dtype] * want.double().abs()
    assert ((got.double() - want.double()).abs() <= bound).all(), msg


def assert_c_layers_are_the_modules(model, new: int = 16) -> None:
    """A wrapped copy of `model` stepping in the C decoder layers gives, at every step of greedy with
    drafts (k=4) over three repeating prompts, bitwise the logits of one stepping through the
    model's modules."""
    from hf_plookup.api import _state

    ids, mask = left_pad(repeat_prompts(3))
    fast, plain = wrap_copy(model), wrap_copy(model)
    _state(plain).engine.c_layers = None
    got, _ = greedy_logits(fast, ids, mask, new, prompt_lookup_num_tokens=4)
    want, _ = greedy_logits(plain, ids, mask, new, prompt_lookup_num_tokens=4)
    assert _state(fast).engine.c_layers.on and torch.equal(got, want)
