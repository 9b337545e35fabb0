"""A CPU model's weights on 2 MB pages (Linux transparent huge pages).

A CPU decode step streams every weight from memory once (`cpu.kernels`). On 4 KB pages
each 4 KB of that stream needs a TLB entry of its own, and the hardware prefetchers stop at every
page's end. On 2 MB pages the stream needs a 512th of the entries and runs on across 2 MB, which
the step bench measured as a faster weight stream and a faster 1-token step (docs/results.md,
"Huge pages").

`to_huge_pages(model)` copies the model's parameters (those on the CPU, plain `nn.Parameter`s)
into one anonymous private mapping advised for huge pages, and points each parameter at its copy.
Values, dtypes, shapes and strides stay as they were, and so does aliasing: parameters that shared
a storage (tied embeddings and LM heads) share the copy of it. Every storage gets a storage object
of its own within the mapping, so `save_pretrained` sees the same separate tensors as before.

Example: SmolLM2-135M in fp32 has 272 parameters (its LM head is its embedding) in 538 MB.
After `to_huge_pages(model)` they lie end to end in one 538 MB mapping, each storage at a 64-byte
boundary, and `/proc/self/smaps_rollup` counts 512 MB of it as `AnonHugePages` (the whole 2 MB
pages within it).

A no-op where the kernel offers no transparent huge pages (`enabled` set to "never", or not Linux),
where the mapping cannot be had (no memory for it), and for a model moved before (its parameters
already in a mapping of this module).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGN = 64  # each storage starts on a cache line


def available() -> bool:
    """Whether anonymous memory advised with MADV_HUGEPAGE can get huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a whole number of ALIGN-byte cache lines (where the next storage starts)."""
    return -(-nbytes // ALIGN) * ALIGN


def huge_buffer(nbytes: int) -> mmap.mmap | None:
    """An anonymous private mapping of nbytes, advised for 2 MB pages before its first touch (so the
    pages come huge); None where the kernel offers no such pages or the memory cannot be had."""
    if not available():
        return None
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return None
    return buf


def _moved(model: torch.nn.Module) -> bool:
    mapping = getattr(model, "_hf_plookup_huge_pages", None)
    return mapping is not None and all(_within(p, mapping) for p in model.parameters() if type(p) is torch.nn.Parameter)


def _within(p: torch.Tensor, mapping: tuple[int, int]) -> bool:
    lo, hi = mapping
    return lo <= p.untyped_storage().data_ptr() < hi


def held_elsewhere(model: torch.nn.Module) -> set[int]:
    """The ids of `model`'s parameters that another library holds: those in a module whose
    `_parameters` is a container of that library's, not torch's dict (compressed-tensors' offload
    caches, filled at a checkpoint's first forward, which its forward reads the weights from).
    Neither packing (cpu.packed_weight) nor moving them here touches them: the library's
    container would refuse the write or its forward break on the tensor it finds."""
    return {id(p) for m in model.modules() if type(m._parameters) is not dict
            for p in m._parameters.values() if p is not None}


def to_huge_pages(model: torch.nn.Module) -> bool:
    """Move `model`'s CPU parameters onto 2 MB pages (see the module docstring), but those another
    library holds (`held_elsewhere`); returns whether it moved any."""
    if not available() or _moved(model):
        return False
    storages: dict[int, list[torch.nn.Parameter]] = {}  # storage address -> the parameters on it
    elsewhere = held_elsewhere(model)
    for p in model.parameters():
        if (type(p) is torch.nn.Parameter and p.device.type == "cpu" and p.untyped_storage().nbytes()
                and id(p) not in elsewhere):
            storages.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    if not storages:
        return False
    places, total = [], 0  # (the parameters on a storage, its bytes, its offset in the mapping)
    for ps in storages.values():
        n = ps[0].untyped_storage().nbytes()
        places.append((ps, n, total))
        total += aligned(n)
    buf = huge_buffer(total)
    if buf is None:  # no memory for a second copy, or the advice refused: the weights stay where they are
        return False
    with torch.no_grad():
        for ps, n, off in places:
            # a storage of its own within the mapping (torch.frombuffer keeps `buf` alive)
            copy = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off)
            copy.copy_(torch.empty(0, dtype=torch.uint8).set_(ps[0].untyped_storage()))
            for p in ps:
                p.data = copy.view(p.dtype).as_strided(p.shape, p.stride(), p.storage_offset())
    lo = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    model._hf_plookup_huge_pages = (lo, lo + total)
    return True
