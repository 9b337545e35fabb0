"""Fixtures for the eval harness tests: tiny random Llama checkpoints with a word-level
tokenizer (one without, one with a chat template), saved once per session."""

from __future__ import annotations

import pytest

from .tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_plain"), chat=False)


@pytest.fixture(scope="session")
def tiny_chat_ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_chat"), chat=True)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """main(["--threads", "1"]) sets torch's global thread count; give it back afterwards."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
