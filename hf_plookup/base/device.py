"""Where a model's inputs go, and whether Triton kernels run under its CPU interpreter: facts the
engine, the step runners, the cache and the kernels all ask about."""

from __future__ import annotations

import os

import torch

# Under the interpreter (triton 3.9) tl.dot of bf16/fp16 operands returns garbage, so there the
# products are taken in fp32; on a GPU half-precision operands go to tensor cores as they are.
# fp32 caches always use exact fp32 products (not TF32), to stay close to HF's fp32 attention.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's input ids go: the input embeddings' device, or, when accelerate offloads
    them (weights on "meta", loaded by a hook), the hook's execution device."""
    emb = model.get_input_embeddings()
    hook = getattr(emb, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if emb.weight.device.type == "meta" and device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return emb.weight.device
