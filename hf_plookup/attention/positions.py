"""Positions for models that count them from their cache instead of taking `position_ids`.

BART's family (BART, mBART, PLBART, Blenderbot, Pegasus, Marian, BigBird-Pegasus) and Whisper's
decoder add a position embedding that their decoder computes as `arange(T) + cache length`: their
causal-LM `forward` has no `position_ids` parameter, so HF's `generate` gives them none, and a
left-padded row's pads count as positions (its first real token sits at position = its pads).
The engine feeds no cache object and packs many rows into one step, so that count would be wrong.
Instead, inside engine forwards, each such `embed_positions` module is handed the step's own
positions: every fed token's column in HF's padded layout (its position in the row plus the
row's left pads). Every one of these modules already takes `position_ids` and uses them in place
of the count; outside engine forwards nothing changes.

Example: a batch of two prompts, [a b c] and [d] left-padded to [pad pad d]. HF embeds `d` at
position 2 and the token after it at 3; the engine feeds `d` at cache position 0 and hands its
embedder position 0 + 2 pads = 2.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch


def position_embedders(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `embed_positions` modules that must be handed positions: on a model whose forward
    takes no `position_ids`, each module named `embed_positions` whose forward takes them. []
    for every model that takes `position_ids` (the engine passes its positions directly)."""
    if "position_ids" in inspect.signature(model.forward).parameters:
        return []
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "embed_positions"
            and "position_ids" in inspect.signature(m.forward).parameters]


def left_padded(mask: torch.Tensor) -> bool:
    """Whether every row of `mask` ([B, W], 1 = token) is pads then tokens: a row's tokens are its
    last ones, so their columns are its pads plus their positions."""
    m = mask.bool()
    return bool((m[:, 1:] >= m[:, :-1]).all())


def _with_positions(forward, positions: torch.Tensor, x, cache_length=0, position_ids=None):
    return forward(x, cache_length, position_ids=positions)


@contextlib.contextmanager
def given_positions(modules: list[torch.nn.Module], positions: torch.Tensor):
    """Inside, each of `modules` embeds `positions` ([T] int64, one per fed token) whatever its
    caller computed; the modules' own `forward` is restored on exit."""
    saved = [m.__dict__.get("forward") for m in modules]
    for m, own in zip(modules, saved):  # an instance forward (accelerate's hook) still runs
        m.forward = functools.partial(_with_positions, own or functools.partial(type(m).forward, m), positions)
    try:
        yield
    finally:
        for m, old in zip(modules, saved):
            if old is None:
                del m.forward
            else:
                m.forward = old
