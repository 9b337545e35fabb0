"""Prompts: summary requests (a chat model's template, or a few-shot pattern for a base model),
where a few-shot summary ends, and the benchmarks' prompts (the builtin documents as requests,
or synthetic token ids with repeated phrases)."""

from __future__ import annotations

import random

from hf_plookup import embedded

from .documents import BUILTIN_PATH, load_jsonl

CHAT_INSTRUCTION = "Summarize the following text in two or three sentences.\n\n{document}"  # the benchmarks' prompts
# eval/summarize.py's request: the instruction after the document. With it in front, SmolLM2-135M
# answered 2 of the 8 default documents with a run of years or the notes' header copied out.
SUMMARY_REQUEST = "{document}\n\nSummarize the text above in two or three sentences."
# A base model is not asked anything: it is shown one article with its summary and continues the
# pattern (an instruction line in front only made the base Gemma repeat the instruction, then copy
# the article's opening). The example is invented and is none of the builtin documents.
FEWSHOT_ARTICLE = (
    "The Dunmore water board voted on Monday to raise household water charges by 6 percent from April, "
    "the first rise in three years. The board said the extra money, about 2.1 million pounds a year, will "
    "pay for replacing 14 miles of cast-iron mains, which burst twice last winter and left parts of the town "
    "without water for two days. Two of the nine members voted against, saying pensioners should be exempt. "
    "A public meeting on the plan will be held at the town hall on 12 March."
)
FEWSHOT_SUMMARY = (
    "Dunmore's water board approved a 6 percent rise in water charges from April to pay for replacing 14 miles "
    "of old mains that burst last winter; two members objected, and a public meeting follows on 12 March."
)
FEWSHOT_PROMPT = f"Article: {FEWSHOT_ARTICLE}\nSummary: {FEWSHOT_SUMMARY}\n\nArticle: {{document}}\nSummary:"
PROMPT_STYLES = {
    "chat": "chat template, one user turn: <document>, then 'Summarize the text above in two or three sentences.'",
    "fewshot": "few-shot for a base model: one 'Article: ... Summary: ...' example, then 'Article: <document> Summary:'",
}


def truncate_document(tokenizer, document: str, max_tokens: int | None) -> str:
    """The document cut to its first `max_tokens` tokens (decoded back to text)."""
    if max_tokens is None:
        return document
    ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return document
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(model_name: str, tokenizer) -> bool:
    """Whether requests to this model go through its chat template: the embedded models say so
    themselves (the base Gemma 3 270M carries a chat template it was not tuned for), any other
    model when its tokenizer has a chat template."""
    return embedded.is_instruct(model_name, tokenizer)


def build_prompt(tokenizer, document: str, use_chat: bool | None = None, request: str = CHAT_INSTRUCTION) -> str:
    """The summarization prompt text: for a chat model its chat template (one user turn asking
    for a summary, with the generation prompt); for a base model the few-shot prompt
    (FEWSHOT_PROMPT), whose natural continuation is the document's summary. `use_chat` None:
    whether the tokenizer has a chat template; `request`: the user turn, with a {document} field.

    A base model and the document "the doc": FEWSHOT_PROMPT's example, then
    "...\\n\\nArticle: the doc\\nSummary:"."""
    if use_chat is None:
        use_chat = has_chat_template(tokenizer)
    if use_chat:
        messages = [{"role": "user", "content": request.format(document=document)}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return FEWSHOT_PROMPT.format(document=document)


def paragraph_stop_ids(tokenizer) -> set[int]:
    """Token ids that end a few-shot summary: the blank line before the next 'Article:' when the
    tokenizer spells it as one token (else none; `summary_text` still cuts the text there)."""
    ids = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    return {int(ids[0])} if len(ids) == 1 else set()


def summary_text(text: str, use_chat: bool) -> str:
    """The summary in a decoded continuation: all of it for a chat model; for the few-shot prompt
    the text before the first blank line or next 'Article:' (the pattern's next example): for a
    base model " The board met.\\n\\nArticle: next one" gives "The board met."."""
    text = text.strip()
    if not use_chat:
        for end in ("\n\n", "\nArticle:"):
            text = text.split(end, 1)[0]
    return text.strip()


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt; a chat-templated prompt already holds its special tokens."""
    return list(tokenizer(prompt, add_special_tokens=not chat)["input_ids"])


def builtin_prompts(tokenizer, n: int) -> list[list[int]]:
    """Token ids of summary requests for the first `n` builtin documents (at most the 28 there):
    the chat template when the tokenizer has one, else the few-shot prompt."""
    return requests(tokenizer, [d["document"] for d in load_jsonl(BUILTIN_PATH)[:n]])


def requests(tokenizer, documents: list[str], max_doc_tokens: int | None = None,
             request: str = CHAT_INSTRUCTION) -> list[list[int]]:
    """Token ids of a summary request for each document (cut to its first `max_doc_tokens`
    tokens): the chat template with the user turn `request` when the tokenizer has one, else the
    few-shot prompt."""
    chat = has_chat_template(tokenizer)
    return [encode_prompt(tokenizer, build_prompt(tokenizer, truncate_document(tokenizer, d, max_doc_tokens), chat,
                                                  request), chat) for d in documents]


# the shipped samples the benchmarks read: file in eval/data/, the article's field
DATASET_FILES = {"cnn_dailymail": ("cnn_dailymail.jsonl", "article"), "billsum": ("billsum.jsonl", "text")}


def dataset_prompts(tokenizer, dataset: str, n: int, max_doc_tokens: int | None = None,
                    request: str = CHAT_INSTRUCTION) -> list[list[int]]:
    """Token ids of summary requests for the first `n` documents of a shipped sample (DATASET_FILES;
    each cut to its first `max_doc_tokens` tokens): the chat template when the tokenizer has one
    (the user turn `request`: the benchmarks', or SUMMARY_REQUEST, the main job's), else the
    few-shot prompt. Documents differ in length, so the prompts do."""
    from .documents import DATA_DIR

    if dataset not in DATASET_FILES:
        raise ValueError(f"dataset must be one of {sorted(DATASET_FILES)}, got {dataset!r}")
    name, field = DATASET_FILES[dataset]
    docs = load_jsonl(DATA_DIR / name, text_field=field, summary_field=None)
    if n > len(docs):
        raise ValueError(f"n={n} documents asked for, {name} holds {len(docs)}")
    return requests(tokenizer, [d["document"] for d in docs[:n]], max_doc_tokens, request)


def synthetic_prompts(vocab_ids: list[int], n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens: random phrases (4-16 tokens) of which about half
    repeat an earlier phrase of the same prompt, so n-gram lookup has something to find.
    The same arguments give the same prompts."""
    if not vocab_ids:
        raise ValueError("synthetic_prompts: empty vocabulary")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks: list[int] = []
        phrases: list[list[int]] = []
        while len(toks) < length:
            if phrases and rng.random() < 0.5:
                phrase = rng.choice(phrases)
            else:
                phrase = [rng.choice(vocab_ids) for _ in range(rng.randint(4, 16))]
                phrases.append(phrase)
            toks.extend(phrase)
        out.append(toks[:length])
    return out


def plain_vocab(tokenizer, limit: int = 20000) -> list[int]:
    """Ordinary (non-special) token ids to draw synthetic prompts from."""
    special = set(tokenizer.all_special_ids)
    size = min(len(tokenizer), limit)
    return [i for i in range(size) if i not in special]


def random_vocab(vocab_size: int) -> list[int]:
    """The ids synthetic prompts for a model without a tokenizer draw from: 3 up to the first
    32,000 (past the usual special ids at the start, within any real vocabulary's common part)."""
    return list(range(3, min(vocab_size, 32000)))
