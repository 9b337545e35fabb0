"""A tiny random Llama checkpoint with a word-level tokenizer trained on the builtin
documents, saved to a directory, so the eval harness runs end to end offline in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BUILTIN = Path(__file__).resolve().parents[2] / "eval" / "data" / "builtin.jsonl"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s_turn> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def build_tokenizer(chat: bool = False):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for line in BUILTIN.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        texts += [row["document"], row["summary"]]
    texts.append("Summarize the following text. Summary: user assistant")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>", "</s_turn>"]
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=1500, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.padding_side = "left"
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_checkpoint(path, chat: bool = False, seed: int = 0) -> Path:
    """Save a tiny random Llama (fp32) and its tokenizer under `path`; returns the path."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tok = build_tokenizer(chat)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        initializer_range=0.2, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
