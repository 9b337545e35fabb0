"""Timers that wait for the device: engine step times during a `generate` call, the median of
repeated calls, GPU kernels per call, device copy and read bandwidth (the bound of a decode
step that reads every weight once: weight bytes / bandwidth), and the multiply-add rate of a
GEMM (the bound of a step whose arithmetic outweighs its reading: multiply-adds / rate)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def sync(device) -> None:
    """Wait for `device`'s queued work (CUDA); nothing to wait for on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Times every engine forward (device-synchronised) while active, as (is_decode, sequences,
    tokens per sequence q, seconds) in `steps`:

        with StepTimer(device) as timer:
            wrapped.generate(...)
        seconds, q = timer.decode_median(batch)   # decode steps that ran all `batch` sequences
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.steps: list[tuple[bool, int, int, float]] = []
        self._orig = None

    def __enter__(self):
        from hf_plookup.steps.runner import ModelRunner

        timer, orig = self, ModelRunner.run
        self._orig = orig

        def run(runner, layout, *args):
            sync(timer.device)
            t0 = time.perf_counter()
            out = orig(runner, layout, *args)
            sync(timer.device)
            timer.steps.append((layout.is_decode, layout.num_seqs, layout.max_query_len, time.perf_counter() - t0))
            return out

        ModelRunner.run = run
        return self

    def __exit__(self, *exc):
        from hf_plookup.steps.runner import ModelRunner

        ModelRunner.run = self._orig

    def outside_per_step(self, seconds: float) -> float | None:
        """Seconds per decode step that a call of `seconds` spent outside its forwards (the
        engine's host work: drafting, laying out, accepting; where steps replay CUDA graphs, a
        cost the GPU waits through), or None where no decode step ran.

        Example: a call of 1.0 s whose prompt forward took 0.1 s and 100 decode steps 0.8 s:
        0.1 s / 100 = 1 ms a step."""
        n = sum(1 for decode, *_ in self.steps if decode)
        return (seconds - sum(t for *_, t in self.steps)) / n if n else None

    def decode_steps(self, batch: int) -> list[tuple[int, float]]:
        """(q, seconds) of the decode steps that ran all `batch` sequences."""
        return [(q, t) for d, b, q, t in self.steps if d and b == batch]

    def decode_median(self, batch: int) -> tuple[float | None, int | None]:
        """Median seconds and q of decode steps that ran all `batch` sequences."""
        s = self.decode_steps(batch)
        if not s:
            return None, None
        return statistics.median(t for _, t in s), max(q for q, _ in s)


def timed(fn, device, iters: int) -> float:
    """Median seconds of `iters` calls of `fn`, each synchronised with `device`."""
    return statistics.median(interleaved({0: fn}, device, iters)[0])


def interleaved(fns: dict, device, rounds: int) -> dict:
    """Seconds of each of `fns`' calls over `rounds` rounds in which every fn runs once, in turn:
    {key: [seconds per round]}. Side by side like this, a shared machine's slow spells fall on every
    fn alike, so ratios of one round's times hold better than ratios of medians taken apart."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return times


def count_kernels(fn, device) -> int | None:
    """GPU kernels launched by one call of `fn` (None off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def top_kernels(fn, device, n: int = 12) -> dict:
    """Where one call of `fn` spends its time (torch.profiler): wall seconds, GPU kernel seconds
    and launches, and the `n` largest GPU kernels and host ops by their own time, as
    {"wall_s", "device_s", "kernels", "device_top": [[name, seconds, calls]], "host_top": [...],
    "lines": printable summary}. On CPU only host ops are seen."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def own(e, kind: str) -> float:  # microseconds of an event's own time on the device or host
        if kind == "device":
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
        return e.self_cpu_time_total

    top = {}
    for kind in ("device", "host"):
        rows = sorted(events, key=lambda e: -own(e, kind))[:n]
        top[kind] = [[e.key[:100], own(e, kind) / 1e6, e.count] for e in rows if own(e, kind) > 0]
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_s = sum(own(e, "device") for e in events) / 1e6
    lines = [f"wall {wall:.3f} s, GPU kernels {len(kernels)} taking {device_s:.3f} s"]
    for kind in ("device", "host"):
        lines += [f"{kind:6s} {t * 1e3:9.2f} ms {c:6d}x  {name}" for name, t, c in top[kind]]
    return {"wall_s": wall, "device_s": device_s, "kernels": len(kernels), "device_top": top["device"],
            "host_top": top["host"], "lines": lines}


def gemm_rate(device, n: int = 512) -> float:
    """Multiply-adds per second of an fp32 n x n by n x n matmul (default 2 MB of operands, in
    cache): the fastest of 10, at torch's current thread count. What the vendor's GEMM (MKL on CPU)
    gets from the cores, close to what a loop of nothing but independent FMAs makes there
    (docs/results.md, "CPU verify steps: the bound, and the ideas tried"), so it is the rate a
    step's own kernels can hope to approach."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device)
    b, c = torch.randn(n, n, device=device), torch.empty(n, n, device=device)
    return n**3 / _fastest(lambda: torch.mm(a, b, out=c), device)


def _fastest(fn, device) -> float:
    """Seconds of the fastest of 10 calls of `fn` on `device`, after 3 untimed ones."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _llc_bytes() -> int:
    """The CPU's last-level cache in bytes as sysfs gives it (0 where it does not): on a VM this is
    the host's whole cache, which the guest's buffers may still hit."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip()
            units = {"K": 2**10, "M": 2**20, "G": 2**30}
            best = max(best, int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
        except (OSError, ValueError):
            continue
    return best


def _buffer_bytes(device: torch.device, cpu_bytes: int) -> int:
    """A buffer well past the last-level cache: 1 GiB on a GPU; elsewhere `cpu_bytes`, or the
    last-level cache's size where that is larger (a VM can see a host's cache of hundreds of MB,
    and a buffer that fits times the cache, not the memory)."""
    return 2**30 if device.type == "cuda" else max(cpu_bytes, _llc_bytes())


def read_bandwidth(device, nbytes: int | None = None) -> float:
    """Bytes per second of reading `nbytes` once (a sum over them; default 1 GiB on a GPU, 256 MiB
    elsewhere): the fastest of 10 reads. A step reads its weights and writes little, and some
    machines (a shared 2-core EPYC) read alone at well under what a copy moves in both directions,
    so this is the bound such a step can approach there; `copy_bandwidth`'s stays the printed one."""
    device = torch.device(device)
    nbytes = nbytes or _buffer_bytes(device, 2**28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / _fastest(src.sum, device)


def copy_bandwidth(device, nbytes: int | None = None) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (default 1 GiB on a GPU, 256 MiB
    or the last-level cache's size elsewhere: `_buffer_bytes`), counting bytes read and written:
    the fastest of 10 copies (a bound; on a shared machine the mean moves by a third between runs)."""
    device = torch.device(device)
    nbytes = nbytes or _buffer_bytes(device, 2**28)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _fastest(lambda: dst.copy_(src), device)
