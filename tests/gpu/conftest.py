"""GPU tests: every test here marked `gpu` is skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from hf_plookup.attention.flash import flash4_unavailable_reason, flash_unavailable_reason

HAS_CUDA = torch.cuda.is_available()
HAS_FLASH = HAS_CUDA and flash_unavailable_reason([torch.device("cuda")], [torch.bfloat16]) is None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def needs_flash():
    if not HAS_FLASH:
        pytest.skip("flash_attn is not installed")


@pytest.fixture
def needs_flash4():
    reason = flash4_unavailable_reason([torch.device("cuda")], [torch.bfloat16]) if HAS_CUDA else "needs a CUDA device"
    if reason is not None:
        pytest.skip(reason)
