"""The model's own forward over the pages for one laid-out step: the stack every way of running a
step shares (eager, static buffers, compiled, captured; `steps.runner` picks the way).

Around the HF forward, `StepForward.active` switches the model's attention to the engine's
(attention.registry), makes the step's metadata current (attention.metadata; the compiled form for
compiled and captured steps) and puts on the step's mode: invariant mode (invariant.linears) or
else the LM head's faster layout (steps.head), the positions handed to embedders that count them
from a cache (attention.positions), and the recurrent mixers' rows (mixers.recurrent). A decode
step of a Llama-form model in invariant mode runs its decoder layers in C instead where they take
it (steps.c_layers; `StepForward.run`).

Example: an eager verify step of 2 rows of 5 tokens calls `run(layout, tensors, meta, keep)` with
`keep` = the 10 fed positions, and gets their logits, `[10, V]`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata, attention_context, compiled_step_context
from ..attention.positions import given_positions
from ..attention.registry import engine_attention
from ..base.device import input_device
from ..base.layout import StepLayout
from .head import HeadChooser, fast_head
from .head_screen import Argmax, Bans


class StepForward:
    """`head`: a `steps.head.HeadChooser` for the LM head (None: the model's own). `invariant`: an
    `invariant.linears.InvariantLinears`: every step in invariant mode (`head` unused). `c_layers`:
    the `steps.c_layers.CpuLayers` of invariant decode steps, or None. `embedders`: the model's
    position embedders that count positions from a cache. `mixers`: its recurrent mixers."""

    def __init__(self, model: torch.nn.Module, cache, backend: str, head: HeadChooser | None = None,
                 invariant=None, c_layers=None, embedders: list[torch.nn.Module] | None = None, mixers=None):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.head = head
        self.invariant = invariant
        self.c_layers = c_layers
        self.embedders = embedders or []
        self.mixers = mixers
        self.device = input_device(model)

    def metadata(self, tensors: dict[str, torch.Tensor], static_shapes: bool = False) -> AttentionMetadata:
        """The attention metadata over a step's uploaded arrays (`base.layout.step_tensors`)."""
        return AttentionMetadata.of(tensors, self.cache, self.backend, static_shapes=static_shapes,
                                    invariant=self.invariant is not None)

    @contextlib.contextmanager
    def active(self, layout: StepLayout, meta: AttentionMetadata, compiled: bool = False):
        """The model's forwards inside run as the step `layout` over the pages (`compiled`: the
        metadata reached as compiled and captured steps reach it)."""
        mode = self.invariant.active(layout, self.device) if self.invariant is not None else fast_head(self.head)
        embed = contextlib.nullcontext()
        if layout.embed_positions is not None:
            embed = given_positions(self.embedders, torch.from_numpy(layout.embed_positions).to(self.device))
        recurrent = self.mixers.active(layout.recurrent_rows()) if self.mixers else contextlib.nullcontext()
        step = compiled_step_context(meta) if compiled else attention_context(meta)
        with engine_attention(self.model), step, mode, embed, recurrent:
            yield

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | int = 0) -> torch.Tensor:
        """The HF forward on packed `input_ids`, `positions` ([T] each): logits at `keep` (row
        indices, or 0 for every row), `[N, V]`."""
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=None,
                         use_cache=False, logits_to_keep=keep)
        logits = out.logits[0]
        if isinstance(keep, torch.Tensor) and logits.shape[0] != len(keep):  # a model that ignores logits_to_keep
            logits = logits.index_select(0, keep.to(logits.device))  # (Whisper's decoder)
        return logits

    def run(self, layout: StepLayout, tensors: dict[str, torch.Tensor], meta: AttentionMetadata,
            keep: torch.Tensor | int, argmax: bool | Bans = False) -> torch.Tensor | Argmax:
        """The step eagerly: its decoder layers in C where they take it, else the modules. `keep`:
        as `logits`'s. `argmax`: only the greedy tokens are needed (the C layers may return
        `steps.head_screen.Argmax` instead of logits; a `Bans` names tokens the rows may not take)."""
        ids, pos = tensors["input_ids"], tensors["positions"]

        def modules() -> torch.Tensor:
            with self.active(layout, meta):
                return self.logits(ids, pos, keep)

        layers = self.c_layers
        if layers is not None and layers.takes(layout) and layout.embed_positions is None and not self.mixers:
            rows = torch.arange(len(ids)) if isinstance(keep, int) else keep
            return layers.run(layout, ids, pos, rows, self.cache, modules, argmax)
        return modules()


def keep_indices(layout: StepLayout, device: torch.device) -> torch.Tensor:
    """The rows whose logits a step keeps, on `device` (one unused row where it keeps none: a
    prompt chunk that does not end its prompt still runs the LM head on something)."""
    keep = layout.keep if len(layout.keep) else np.zeros(1, np.int64)
    return torch.from_numpy(keep).to(device, non_blocking=True)
