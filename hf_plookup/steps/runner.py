"""Runs one laid-out step (`ModelRunner.run`): the one entry to every way a step runs.

A uniform decode step that the `GraphRunner` (steps.graphs) takes runs there, on its bucket's
static buffers (replayed as a CUDA graph, compiled, or plain); every other step (prompt chunks,
rows feeding different numbers of tokens, batches past the largest bucket, or no graphs at all)
runs eagerly through `StepForward` (steps.forward). `last_path` and `last_reason` say how the last
step ran and, for a decode step that missed the graphs, why (`SpecStats.decode_steps_by_path`)."""

from __future__ import annotations

import torch

from ..base.layout import StepLayout, step_tensors
from .forward import StepForward, keep_indices
from .head import HeadChooser
from .head_screen import Argmax, Bans


class ModelRunner:
    """`graphs`: a `GraphRunner` for the uniform decode steps it supports, or None; `grad_mode`:
    the context every step runs in (torch.inference_mode; torch.no_grad for a model whose forward
    fails in inference mode, engine.plan.EnginePlan.grad_mode). The other arguments are
    `StepForward`'s, for the eager steps."""

    def __init__(self, model: torch.nn.Module, cache, backend: str = "sdpa", graphs=None,
                 head: HeadChooser | None = None, invariant=None, c_layers=None,
                 embedders: list[torch.nn.Module] | None = None, mixers=None, grad_mode=torch.inference_mode):
        self.forward = StepForward(model, cache, backend, head, invariant, c_layers, embedders, mixers)
        self.grad_mode = grad_mode
        self.graphs = graphs
        self.last_path = "eager"
        self.last_reason: str | None = None

    def run(self, layout: StepLayout, argmax: bool | Bans = False) -> torch.Tensor | Argmax:
        """One forward. Returns the logits at `layout.keep`, `[N, V]`, or, where `argmax` says only
        the greedy tokens are needed (a `Bans`: those of the logits with the tokens it names taken
        out) and the step computed only those, an `Argmax` of them."""
        with self.grad_mode():
            return self._run(layout, argmax)

    def _run(self, layout: StepLayout, argmax: bool | Bans) -> torch.Tensor | Argmax:
        self.last_path, self.last_reason = "eager", None
        if self.graphs is not None:
            reason = self.graphs.unsupported(layout)
            if reason is None:
                self.last_path = self.graphs.path
                return self.graphs.run(layout)
            if not layout.prefill.all():  # a decoding row runs eagerly
                self.last_reason = reason
        device = self.forward.device
        tensors = step_tensors(layout, device)
        logits = self.forward.run(layout, tensors, self.forward.metadata(tensors), keep_indices(layout, device), argmax)
        return logits[:0] if len(layout.keep) == 0 else logits  # (the C layers take only steps with kept rows)
