"""Resolve HF `generate` arguments into one engine request, exactly as HF resolves them, or
say why the call must go to HF's own `generate` instead."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig

logger = logging.getLogger("hf_plookup")

# generate() arguments the engine does not handle; any of them set -> HF's own generate
_DELEGATED_ARGS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
)
# GenerationConfig fields whose non-default value changes the result beyond greedy search
_DELEGATED_FIELDS = {
    "do_sample": False,
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "guidance_scale": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "watermarking_config": None,
    "stop_strings": None,
    "max_time": None,
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
    "assistant_early_exit": None,
    "dola_layers": None,
}
_HARMLESS_MODEL_KWARGS = {"attention_mask", "use_cache"}


@dataclass(slots=True)
class Request:
    """One engine call, resolved from HF arguments."""

    input_ids: torch.Tensor  # [B, L] as given (padding included)
    prompts: list[np.ndarray]  # B arrays [L_b] int64: each row's attended tokens
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    k: int  # prompt_lookup_num_tokens (0: plain greedy)
    max_ngram: int  # max_matching_ngram_size
    return_dict: bool

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.prompts) != self.input_ids.shape[0]:
            raise ValueError("one prompt per input row")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int (>= 1), got {value}")
    return int(value)


def _as_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    if isinstance(eos, int):
        return frozenset([eos])
    return frozenset(int(e) for e in eos)


def _check_raw(kwargs: dict) -> None:
    """Our own argument checks, done on what the user passed, before HF's config merges it."""
    if kwargs.get("prompt_lookup_num_tokens") is not None:
        _positive_int("prompt_lookup_num_tokens", kwargs["prompt_lookup_num_tokens"])
    if kwargs.get("max_matching_ngram_size") is not None:
        _positive_int("max_matching_ngram_size", kwargs["max_matching_ngram_size"])
    mnt = kwargs.get("max_new_tokens")
    if mnt is not None:
        if isinstance(mnt, bool) or not isinstance(mnt, (int, np.integer)):
            raise TypeError(f"max_new_tokens must be an int, got {type(mnt).__name__}")
        if mnt < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {mnt}")


def delegation_reason(config: GenerationConfig, args: dict, model_kwargs: dict) -> str:
    """Why this call cannot run on the engine ('' when it can)."""
    for name in _DELEGATED_ARGS:
        if args.get(name) not in (None, [], ()):
            return f"argument `{name}`"
    if args.get("synced_gpus"):
        return "argument `synced_gpus`"
    for name, default in _DELEGATED_FIELDS.items():
        value = getattr(config, name, default)
        if value is not None and value != default:
            return f"`{name}={value!r}`"
    extra = set(model_kwargs) - _HARMLESS_MODEL_KWARGS
    if extra:
        return f"model inputs {sorted(extra)}"
    return ""


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


def resolve(model, inputs, generation_config, args: dict, kwargs: dict) -> Request | str:
    """A `Request`, or the reason (str) to delegate. Raises on bad input before any work."""
    kwargs = dict(kwargs)
    _check_raw(kwargs)
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None or "inputs_embeds" in kwargs:
        return "inputs given as embeddings (or not at all)"
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be a 2-D integer tensor [batch, length], got {tuple(input_ids.shape)} {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty (length 0)")
    mask = kwargs.get("attention_mask")
    if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids has {tuple(input_ids.shape)}: they must match")

    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    reason = delegation_reason(config, args, model_kwargs)
    if reason:
        return reason
    config.validate()

    k = config.prompt_lookup_num_tokens
    k = 0 if k is None else _positive_int("prompt_lookup_num_tokens", k)
    n = config.max_matching_ngram_size
    n = 2 if n is None else _positive_int("max_matching_ngram_size", n)
    eos_list = config.eos_token_id
    if isinstance(eos_list, torch.Tensor):
        eos_list = eos_list.tolist()
    if isinstance(eos_list, int):
        eos_list = [eos_list]
    eos = _as_set(eos_list)
    pad = config.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = int(pad)
    if pad is None and eos_list:
        pad = int(eos_list[0])  # HF's fallback: the first EOS token

    width = input_ids.shape[1]
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_length = config.max_length
        if has_default_max_length:  # HF: the default max_length counts new tokens
            max_length = max_length + width
            max_pos = getattr(model.config, "max_position_embeddings", None)
            if max_pos is not None:
                max_length = min(max_length, max_pos)
        if width >= max_length:
            raise ValueError(
                f"Input length of input_ids is {width}, but `max_length` is set to {max_length}; "
                "increase `max_length` or set `max_new_tokens`"
            )
        max_new = max_length - width

    if mask is None:
        mask = infer_attention_mask(input_ids, pad, eos)
    prompts = attended_rows(input_ids, mask)
    if pad is not None and input_ids.shape[0] > 1 and bool((mask[:, -1] == 0).any()):
        # HF warns and then predicts a right-padded row's first token from the pad column's logits;
        # we warn the same way and generate from the row's attended tokens (what left padding gives)
        logger.warning(
            "A decoder-only architecture is being used, but right-padding was detected! For correct "
            "generation results, please set `padding_side='left'` when initializing the tokenizer."
        )
    return Request(
        input_ids=input_ids,
        prompts=prompts,
        max_new_tokens=max_new,
        eos_token_ids=eos,
        pad_token_id=pad,
        k=k,
        max_ngram=n,
        return_dict=bool(config.return_dict_in_generate),
    )
