"""GPU tests: every test here marked `gpu` is skipped cleanly without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_FLASH = HAS_CUDA and importlib.util.find_spec("flash_attn") is not None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def needs_flash():
    if not HAS_FLASH:
        pytest.skip("flash_attn is not installed")
