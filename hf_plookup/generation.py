"""Resolve HF `generate` arguments into one engine call, exactly as HF resolves them, or say
why the call must go to HF's own `generate` instead.

Precedence is HF's (explicit kwargs > `generation_config` argument > `model.generation_config`
> defaults) because the merge is HF's own `_prepare_generation_config`; special tokens,
logits processors/warpers and stopping criteria are built by HF's own builders too.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .attention.positions import left_padded, position_embedders
from .base.checks import positive_int
from .engine.sequence import DecodeConfig
from .mixers.recurrent import mixer_modules, state_only
from .outputs import CACHE_FIELD

logger = logging.getLogger("hf_plookup")

# generate() arguments the engine does not handle; any of them set -> HF's own generate
_DELEGATED_ARGS = (
    "prefix_allowed_tokens_fn",  # called with a batch id, which packed virtual rows do not keep
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
)
# GenerationConfig fields the engine does not handle, with their inactive value
_DELEGATED_FIELDS = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "force_words_ids": None,
    "constraints": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "output_attentions": False,
    "output_hidden_states": False,
    "assistant_early_exit": None,
    "dola_layers": None,
    "low_memory": None,
}
_HARMLESS_MODEL_KWARGS = {"attention_mask", "use_cache"}
GENERATE_ARGS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "tokenizer",
)


@dataclass(slots=True)
class Request:
    """One engine call, resolved from HF arguments."""

    input_ids: torch.Tensor  # [B', L] rows as given, expanded for num_return_sequences
    prompts: list[np.ndarray]  # B' arrays [L_b] int64: each row's attended tokens
    decode: DecodeConfig
    pad_token_id: int | None
    return_dict: bool
    attention_mask: torch.Tensor | None = None  # [B', L] the mask of input_ids (given or inferred)
    # the caller's cache (HF extends it in place; see outputs.assemble); its content is not read:
    # the engine prefills the whole input_ids
    past_key_values: DynamicCache | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) != self.input_ids.shape[0]:
            raise ValueError("one prompt per input row")


def _check_raw(kwargs: dict) -> None:
    """Our own checks on what the user passed, before HF's config merges it."""
    if "seed" in kwargs:  # vLLM's and others' name; HF's generate has none
        raise TypeError("generate() got an unexpected keyword argument 'seed': a call's sampling seed is drawn from "
                        "torch's default generator, as HF's sampling draws from it; call torch.manual_seed(seed) first")
    # max_new_tokens: HF's own rule (GenerationConfig.validate), greater than 0
    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size", "max_new_tokens"):
        positive_int(name, kwargs.get(name), none_ok=True)


def _check_token_range(model, input_ids: torch.Tensor) -> None:
    """Every id must index the embedding table (HF's forward would fail in the embedding lookup)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab - 1}] of size {vocab}")


def _check_sampling(config: GenerationConfig) -> None:
    """Ranges HF leaves to its warpers (or ignores); checked here, before any work."""
    if not config.do_sample:
        return
    t = config.temperature
    if t is not None and (not isinstance(t, (int, float)) or t <= 0):
        raise ValueError(f"temperature must be a float > 0 when do_sample=True, got {t!r}")
    p = config.top_p
    if p is not None and (not isinstance(p, (int, float)) or not 0.0 < p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {p!r}")
    positive_int("top_k", config.top_k, minimum=0, none_ok=True, type_error=ValueError)
    mp = config.min_p
    if mp is not None and (not isinstance(mp, (int, float)) or not 0.0 <= mp <= 1.0):
        raise ValueError(f"min_p must be in [0, 1], got {mp!r}")


def delegation_reason(config: GenerationConfig, args: dict, model_kwargs: dict) -> str:
    """Why this call cannot run on the engine ('' when it can)."""
    for name in _DELEGATED_ARGS:
        if args.get(name) is not None:
            return f"argument `{name}`"
    if args.get("synced_gpus"):
        return "argument `synced_gpus`"
    for name, default in _DELEGATED_FIELDS.items():
        value = getattr(config, name, default)
        if value is not None and value != default:
            return f"`{name}={value!r}`"
    extra = set(model_kwargs) - _HARMLESS_MODEL_KWARGS
    if model_kwargs.get("past_key_values") is None or type(model_kwargs["past_key_values"]) is DynamicCache:
        # None (HF's "no cache", as a chat loop's first turn passes it) or a DynamicCache; others: HF
        extra.discard("past_key_values")
    if extra:
        return f"model inputs {sorted(extra)}"
    return ""


def _check_past(past: DynamicCache, input_ids: torch.Tensor, config: GenerationConfig) -> None:
    """A `DynamicCache` given to continue from: it must cover a prefix of `input_ids`."""
    if getattr(config, "cache_implementation", None) is not None:
        raise ValueError("Passing both `cache_implementation` and `past_key_values` (a Cache object) is unsupported")
    cached = past.get_seq_length()
    if cached >= input_ids.shape[1]:
        raise ValueError(f"past_key_values holds {cached} tokens: input_ids ({input_ids.shape[1]} tokens) must "
                         "hold those and at least one more")
    if cached and past.layers[0].keys.shape[0] != input_ids.shape[0]:
        raise ValueError(f"past_key_values has batch size {past.layers[0].keys.shape[0]}, input_ids has "
                         f"{input_ids.shape[0]} rows")


def caller_kv(past: DynamicCache, attention_mask: torch.Tensor) -> list | None:
    """The caller's cache per row, for the engine to copy into pages: per row, the cache columns
    of its attended tokens before the cache's end (padding left out; n of them for its first n
    tokens) and per layer its keys [H_kv, W, D] and values [H_kv, W, Dv], views of the cache (the
    engine copies only the columns the prefix pool does not give). None when it cannot be read
    whole: an empty cache, or layers that keep fewer columns than the cache's length (sliding
    windows); those rows are prefilled.

    Example: a cache of 5 columns and a row masked [0, 1, 1, 1, 1, 1, 1] gives that row columns
    [1, 2, 3, 4] of each layer, its first 4 tokens."""
    length = past.get_seq_length()
    if not length or any(layer.keys is None or layer.keys.shape[-2] != length or layer.keys.shape[0] != attention_mask.shape[0]
                         for layer in past.layers):
        return None
    mask = attention_mask[:, :length].bool().cpu()
    return [(torch.nonzero(mask[b]).view(-1), [(layer.keys[b], layer.values[b]) for layer in past.layers])
            for b in range(mask.shape[0])]


def attended_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[np.ndarray]:
    """Each row's tokens where the mask is 1 (left, right or inner padding removed)."""
    ids = input_ids.cpu().numpy()
    mask = attention_mask.cpu().numpy().astype(bool)
    rows = [ids[i][mask[i]].astype(np.int64) for i in range(ids.shape[0])]
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"input_ids row {i} is empty: its attention_mask has no 1")
    return rows


def infer_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: frozenset[int]) -> torch.Tensor:
    """HF's rule: mask out `pad_token_id` when it occurs and is not also an EOS token."""
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def _max_new_tokens(model, config: GenerationConfig, width: int, input_ids: torch.Tensor,
                    has_default_max_length: bool, has_default_min_length: bool) -> int:
    """HF's own `_prepare_generated_length` (sets max_length and min_length on `config`, with
    min_new_tokens winning over min_length), then its length validation."""
    model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=width,
        inputs_tensor=input_ids,
    )
    if width >= config.max_length:
        raise ValueError(
            f"Input length of input_ids is {width}, but `max_length` is set to {config.max_length}; "
            "increase `max_length` or set `max_new_tokens`"
        )
    return config.max_length - width


def _warn_past_context(model, width: int, max_new: int) -> None:
    """HF's warning (its MaxLengthCriteria) when generation would run past the model's
    `max_position_embeddings`, given here once, before any work, instead of after a step."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and width + max_new > limit:
        logger.warning(
            "This is a friendly reminder - the current text generation call has exceeded the model's predefined "
            f"maximum length ({limit}). Depending on the model, you may observe "
            f"exceptions, performance degradation, or nothing at all. (input_ids: {width} tokens, "
            f"max_new_tokens: {max_new})"
        )


# generate arguments of hf_plookup's own (HF's generate does not know them): drafting options
OWN_ARGS = ("prompt_lookup_tree_nodes", "draft_cross_rows", "draft_corpus", "draft_recycled")


def _corpus(model, corpus, tokenizer) -> tuple[np.ndarray, ...]:
    """`draft_corpus` as token arrays: a list of strings (tokenized with `tokenizer=`, no special
    tokens) and/or token id sequences within the vocabulary."""
    if isinstance(corpus, (str, bytes)) or not isinstance(corpus, (list, tuple)):
        raise TypeError(f"draft_corpus must be a list of strings or token id sequences, got {type(corpus).__name__}")
    vocab = model.get_input_embeddings().weight.shape[0]
    out = []
    for i, doc in enumerate(corpus):
        if isinstance(doc, str):
            if tokenizer is None:
                raise ValueError("draft_corpus holds strings: pass `tokenizer=` to generate so they can be tokenized")
            ids = np.asarray(tokenizer(doc, add_special_tokens=False)["input_ids"], dtype=np.int64)
        else:
            if isinstance(doc, torch.Tensor):
                doc = doc.detach().cpu().numpy()
            ids = np.asarray(doc)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise TypeError(f"draft_corpus[{i}] must be a string or a 1-D sequence of token ids")
            ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"draft_corpus[{i}] holds token ids outside the vocabulary [0, {vocab - 1}]")
        out.append(ids)
    return tuple(out)


@dataclass(slots=True)
class OwnArgs:
    """hf_plookup's own drafting arguments (OWN_ARGS), checked."""

    tree_nodes: int | None = None  # prompt_lookup_tree_nodes
    cross_rows: bool = False       # draft_cross_rows
    corpus: tuple[np.ndarray, ...] | None = None  # draft_corpus as token arrays
    recycled: int = 0              # draft_recycled

    def check_drafting(self, k: int) -> None:
        for name, given in (("prompt_lookup_tree_nodes", self.tree_nodes is not None),
                            ("draft_cross_rows", self.cross_rows), ("draft_corpus", self.corpus is not None),
                            ("draft_recycled", self.recycled > 0)):
            if given and k == 0:
                raise ValueError(f"{name} needs prompt_lookup_num_tokens (the longest path of a draft)")


def own_arguments(model, own: dict, args: dict) -> OwnArgs:
    """Part 1 of `resolve`: hf_plookup's own arguments, checked (types and ranges)."""
    tree_nodes = own.get("prompt_lookup_tree_nodes")
    if tree_nodes is not None:
        tree_nodes = positive_int("prompt_lookup_tree_nodes", tree_nodes)
    cross_rows = own.get("draft_cross_rows", False)
    if not isinstance(cross_rows, bool):
        raise TypeError(f"draft_cross_rows must be True or False, got {cross_rows!r}")
    corpus = own.get("draft_corpus")
    corpus = _corpus(model, corpus, args.get("tokenizer")) if corpus is not None else None
    # the model's own best-ranked successors drafted per token (drafting.recycle); 0: none
    recycled = positive_int("draft_recycled", own.get("draft_recycled", 0), minimum=0)
    return OwnArgs(tree_nodes, cross_rows, corpus, recycled)


@dataclass(slots=True)
class CheckedCall:
    """A `generate` call that passed every check and runs on the engine (part 2 of `resolve`)."""

    input_ids: torch.Tensor                 # [B, L] as given
    mask: torch.Tensor                      # [B, L] the given attention_mask, or HF's inferred one
    config: GenerationConfig                # merged by HF's own rules, validated
    model_kwargs: dict                      # what HF's merge left over (attention_mask, use_cache)
    past: DynamicCache | None               # the caller's cache to continue from
    has_default_max_length: bool
    has_default_min_length: bool
    eos: frozenset[int]                     # the stop tokens HF's special-token rules give
    pad: int | None                         # the pad token they give
    keep_kv: bool                           # the call returns (or extends) a cache


def _check_inputs(model, inputs, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None] | str:
    """input_ids and attention_mask: types, shapes, values (or why the call goes to HF)."""
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None or "inputs_embeds" in kwargs:
        return "inputs given as embeddings (or not at all)"
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"input_ids must be a 2-D integer tensor [batch, length], got {tuple(input_ids.shape)} {input_ids.dtype}"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty (length 0)")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows (batch size 0)")
    _check_token_range(model, input_ids)
    mask = kwargs.get("attention_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask is not None and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 and 1")
    if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}, input_ids has {tuple(input_ids.shape)}: they must match"
        )
    return input_ids, mask


def checked_call(model, inputs, generation_config, args: dict, kwargs: dict) -> CheckedCall | str:
    """Part 2 of `resolve`: the inputs checked, the generation config merged as HF merges it and
    validated, or the reason (str) the call goes to HF's own `generate`."""
    _check_raw(kwargs)
    checked = _check_inputs(model, inputs, kwargs)
    if isinstance(checked, str):
        return checked
    input_ids, mask = checked
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    if CACHE_FIELD == "cache" and "cache" in model_kwargs:  # HF's new name for past_key_values
        if model_kwargs.get("past_key_values") is not None:
            raise ValueError("pass either `cache` or `past_key_values` (its old name), not both")
        model_kwargs["past_key_values"] = model_kwargs.pop("cache")
    reason = delegation_reason(config, args, model_kwargs)
    if reason:
        return reason
    past = model_kwargs.pop("past_key_values", None)
    if past is not None:
        _check_past(past, input_ids, config)
    config.validate()
    _check_sampling(config)
    nrs = config.num_return_sequences or 1
    if nrs > 1 and not config.do_sample:
        raise ValueError(f"num_return_sequences={nrs} needs do_sample=True (greedy search returns one sequence)")
    if args.get("streamer") is not None and input_ids.shape[0] * nrs > 1:
        raise ValueError("streamer: streaming works with one sequence only (batch size 1), as in HF")
    model._prepare_special_tokens(config, mask is not None, device=input_ids.device)
    eos_t, pad_t = config._eos_token_tensor, config._pad_token_tensor
    eos = frozenset(eos_t.view(-1).tolist()) if eos_t is not None else frozenset()
    pad = int(pad_t.view(-1)[0]) if pad_t is not None else None
    if mask is None:
        mask = infer_attention_mask(input_ids, pad, eos)
    keep_kv = past is not None or bool(config.return_dict_in_generate and model_kwargs.get("use_cache", config.use_cache))
    reason = engine_reason(model, mask, keep_kv)
    if reason:
        return reason
    return CheckedCall(input_ids, mask, config, model_kwargs, past, has_default_max_length, has_default_min_length,
                       eos, pad, keep_kv)


def engine_reason(model, mask: torch.Tensor, keep_kv: bool) -> str:
    """Why the engine cannot run this model with these rows ('' when it can): what HF's arguments
    alone do not say (`delegation_reason`)."""
    if not bool(mask.all()) and "position_ids" not in inspect.signature(model.forward).parameters and not (
            position_embedders(model) and left_padded(mask)) and not state_only(model):
        # HF's generate passes position_ids only to a forward that names them; such a model counts a
        # row's pads as positions: the engine hands them to its position embedding where it has
        # one (BART's family, Whisper's decoder: attention.positions) and the pads are all on the left;
        # a model of recurrent mixers only (Mamba) sees no positions at all
        return "padded rows on a model whose forward takes no position_ids"
    if keep_kv and mixer_modules(model):
        # HF's cache of a hybrid model holds each recurrent layer's state, which the pages do not
        return "a cache in or out (`past_key_values`, `return_dict_in_generate`) on a model with recurrent mixers"
    return ""


def _processors_and_criteria(model, config: GenerationConfig, args: dict, input_ids: torch.Tensor, width: int,
                             model_kwargs: dict) -> tuple[LogitsProcessorList, StoppingCriteriaList]:
    """HF's own logits processors and stopping criteria for this call, as HF's `generate` builds
    them (max length and EOS left out: the engine stops rows at those itself)."""
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=width,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=args.get("logits_processor") or LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs=model_kwargs,
    )
    criteria = model._get_stopping_criteria(
        generation_config=config, stopping_criteria=args.get("stopping_criteria") or StoppingCriteriaList(),
        tokenizer=args.get("tokenizer"),
    )
    return processors, StoppingCriteriaList(c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)))


def decode_request(model, call: CheckedCall, own: OwnArgs, args: dict) -> Request:
    """Part 3 of `resolve`: the engine's `DecodeConfig` (drafting, lengths, special tokens, HF's
    own logits processors and stopping criteria) and the rows it runs."""
    config, model_kwargs, input_ids, mask = call.config, call.model_kwargs, call.input_ids, call.mask
    k = config.prompt_lookup_num_tokens
    k = 0 if k is None else positive_int("prompt_lookup_num_tokens", k)
    n = config.max_matching_ngram_size
    n = 2 if n is None else positive_int("max_matching_ngram_size", n)
    own.check_drafting(k)
    width = input_ids.shape[1]
    max_new = _max_new_tokens(model, config, width, input_ids, call.has_default_max_length, call.has_default_min_length)
    _warn_past_context(model, width, max_new)
    nrs = config.num_return_sequences or 1
    if nrs > 1:
        input_ids = input_ids.repeat_interleave(nrs, dim=0)
        mask = mask.repeat_interleave(nrs, dim=0)
    if call.pad is not None and input_ids.shape[0] > 1 and bool((mask[:, -1] == 0).any()):
        # HF warns and then predicts a right-padded row's first token from the pad column's logits;
        # we warn the same way and generate from the row's attended tokens (what left padding gives)
        logger.warning(
            "A decoder-only architecture is being used, but right-padding was detected! For correct "
            "generation results, please set `padding_side='left'` when initializing the tokenizer."
        )
    model_kwargs["attention_mask"] = mask  # the expanded (or inferred) mask, one row per sequence
    processors, stopping = _processors_and_criteria(model, config, args, input_ids, width, model_kwargs)
    past = call.past
    decode = DecodeConfig(
        max_new_tokens=max_new,
        eos_token_ids=call.eos,
        k=k,
        max_ngram=n,
        tree_nodes=own.tree_nodes or 0,
        cross_rows=own.cross_rows,
        corpus=own.corpus,
        recycled=own.recycled,
        do_sample=bool(config.do_sample),
        processors=processors,
        stopping=stopping,
        streamer=args.get("streamer"),
        output_scores=bool(config.return_dict_in_generate and config.output_scores),
        output_logits=bool(config.return_dict_in_generate and config.output_logits),
        hf_input_ids=input_ids.cpu().numpy().astype(np.int64),
        pad_token_id=call.pad,
        # HF returns its cache with return_dict_in_generate (unless use_cache=False) and extends a given one
        keep_kv=call.keep_kv,
        # its keys and values are read, as HF reads them, not computed again
        prompt_kv=caller_kv(past, mask) if past is not None else None,
    )
    return Request(
        input_ids=input_ids,
        prompts=attended_rows(input_ids, mask),
        decode=decode,
        pad_token_id=call.pad,
        return_dict=bool(config.return_dict_in_generate),
        attention_mask=mask,
        past_key_values=past,
    )


def resolve(model, inputs, generation_config, args: dict, kwargs: dict, own: dict | None = None) -> Request | str:
    """A `Request`, or the reason (str) to delegate. Raises on bad input before any work.
    `own`: hf_plookup's own drafting arguments (OWN_ARGS).

    Three parts: `own_arguments` (hf_plookup's arguments), `checked_call` (the inputs and HF's
    merged, validated generation config; delegation), `decode_request` (the engine's decode
    config)."""
    kwargs = dict(kwargs)
    own_args = own_arguments(model, own or {}, args)
    call = checked_call(model, inputs, generation_config, args, kwargs)
    if isinstance(call, str):
        return call
    return decode_request(model, call, own_args, args)
