"""Host work per decode step on the static-buffer step path (what CUDA graphs replay), on CPU: a
call's time outside its forwards, and its parts, per decode step.

The engine runs its uniform verify steps on a GraphRunner without capture (the static buffers a CUDA
graph replays, run eagerly), with the width policy on, as on a GPU; the model is the test suite's
tiny Llama (`random:tiny-llama`), whose forward is cheap, so what remains is the host's work that a
GPU would wait through: scheduling and drafting, laying out and padding the step, uploading it,
accepting the step's tokens. The forwards are every forward of the call: the static-buffer steps'
and the eager ones' (its prompt chunks, and any step the graphs do not take), so a large batch's
long prefill is not counted as host work between decode steps. Each (batch size, k) runs one warm-up call, then `--repeats` calls of
which the fastest is reported: per decode step, the call's time, its forwards', the rest ("outside
forward"), each part's mean, and the medians of accepting (postprocess) and drafting (propose).

    python eval/host_work.py --batch-sizes 1 16 64 --k 0 4
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from eval.lib.cli import add_threads_option, set_threads, show_defaults
from eval.lib.models import load_model
from eval.lib.report import report, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:tiny-llama", help="a random:SHAPE of eval/lib/models.py or a checkpoint")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--k", type=int, nargs="+", default=[0, 4], help="prompt_lookup_num_tokens values (0: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per setting; the fastest is reported")
    p.add_argument("--json", default=None)
    add_threads_option(p, default_name="1", default_now=1)
    return show_defaults(p)


class Parts:
    """Seconds of each call of the engine's parts, by label, while installed (`install`)."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self._undo = []
        self._depth: dict[str, int] = {}  # label -> calls of it running now

    def wrap(self, owner, name: str, label: str) -> None:
        """Time `owner.name` under `label` (if the engine has it); where methods share a label, a
        call inside another of the same label counts once, in the outermost."""
        f = getattr(owner, name, None)
        if f is None:
            return
        depth = self._depth

        @functools.wraps(f)
        def timed(*a, **k):
            depth[label] = depth.get(label, 0) + 1
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                depth[label] -= 1
                if not depth[label]:
                    self.times.setdefault(label, []).append(time.perf_counter() - t)

        setattr(owner, name, timed)
        self._undo.append((owner, name, f))

    def install(self) -> None:
        from hf_plookup.engine import batch, engine, scheduler
        from hf_plookup.steps import forward, graphs, runner

        self.wrap(graphs.GraphRunner, "_forward", "forward")
        self.wrap(forward.StepForward, "run", "forward")  # eager steps (prompt chunks) too
        self.wrap(batch.Batch, "postprocess", "postprocess")
        self.wrap(batch.Batch, "propose", "propose")
        self.wrap(scheduler.Scheduler, "schedule", "schedule(+propose)")
        self.wrap(engine, "lay_out", "layout")
        self.wrap(engine, "lay_out_staged", "layout")  # a step laid out into its bucket's buffer
        self.wrap(graphs, "pad_layout", "pad_layout")
        self.wrap(runner.ModelRunner, "run", "runner.run")

    def remove(self) -> None:
        for owner, name, f in reversed(self._undo):
            setattr(owner, name, f)
        self._undo.clear()


def prompts(batch: int, vocab: int, seed: int = 3, period: int = 12, repeats: int = 20, pad_step: int = 3):
    """[batch, period * repeats] rows of a random phrase repeated, row i left-padded with i * pad_step
    pad tokens (0): (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, period), generator=g).repeat(1, repeats)
    mask = torch.ones_like(ids)
    for i in range(batch):
        ids[i, : i * pad_step] = 0
        mask[i, : i * pad_step] = 0
    return ids, mask


def measure(model, batch: int, k: int, args, parts: Parts) -> dict:
    """One setting's row: the fastest of args.repeats calls, per decode step."""
    import hf_plookup
    from hf_plookup.steps.graphs import GraphRunner

    wrapped = hf_plookup.wrap(model, max_cache_tokens=1 << 16, block_size=16, pad_drafts=True)
    eng = wrapped._engine
    eng._graphs = GraphRunner(wrapped, eng.cache(), "sdpa", eng.options.max_num_seqs, capture=False)
    eng.width_policy = True
    ids, mask = prompts(batch, model.config.vocab_size)
    kw = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=k or None,
              do_sample=False, eos_token_id=None, pad_token_id=0)
    wrapped.generate(ids, **kw)
    best = None
    for _ in range(args.repeats):
        parts.times.clear()
        t = time.perf_counter()
        wrapped.generate(ids, **kw)
        dt = time.perf_counter() - t
        if best is None or dt < best[0]:
            best = (dt, {name: list(v) for name, v in parts.times.items()})
    n = max(wrapped.last_stats.decode_steps, 1)
    hf_plookup.unwrap(wrapped)
    dt, times = best
    forward = sum(times.get("forward", []))
    return {"batch": batch, "k": k, "decode_steps": n, "step_s": dt / n, "forward_s": forward / n,
            "outside_s": (dt - forward) / n,
            "parts_s": {name: sum(v) / n for name, v in times.items() if name != "forward"},
            "medians_s": {name: statistics.median(times[name]) for name in ("postprocess", "propose") if name in times}}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    set_threads(args.threads if args.threads is not None else 1)
    parts = Parts()
    parts.install()
    rows = []
    try:
        for b in args.batch_sizes:
            for k in args.k:
                model, _ = load_model(args.model, torch.float32, "cpu")
                r = measure(model, b, k, args, parts)
                rows.append(r)
                ms = {name: f"{1e3 * s:.2f}" for name, s in r["parts_s"].items()}
                med = {name: f"{1e3 * s:.3f}" for name, s in r["medians_s"].items()}
                print(f"B={b:2d} k={k}: {r['decode_steps']} steps, per step: total {1e3 * r['step_s']:.2f} ms, forward "
                      f"{1e3 * r['forward_s']:.2f}, outside forward {1e3 * r['outside_s']:.2f} | {ms} | medians {med}",
                      flush=True)
    finally:
        parts.remove()
    if args.json:
        write_json(args.json, report("host_work", argv, args, "cpu", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
