"""What a measurement ran on: versions, the device, threads, the CPU and its vector extensions."""

from __future__ import annotations

import ctypes
import gc
import os
import platform

import torch


def cpu_model() -> str:
    """The CPU's name and the vector extensions that decide which kernels run fast (torch's
    bf16 GEMM, for one, needs AVX-512 BF16 or AMX), e.g. "AMD EPYC (avx2)"."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]
    return f"{name} ({', '.join(f for f in wanted if f in flags) or 'no avx2'})"


def package_version(name: str) -> str | None:
    """An installed distribution's version, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info(device) -> dict:
    """Versions (torch, transformers, python), the device, torch's threads and the CPU; on CUDA
    also the GPU's name, CUDA's version and flash-attn's where installed."""
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
        info["flash_attn"] = package_version("flash_attn")
    info["cpu"] = cpu_model()
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        pass
    return info


def busy_warning(load: float | None = None, cores: int | None = None) -> str | None:
    """A line for the user when the machine's load (the last minute's average, from the OS) exceeds
    its cores: other processes then share them, and timings come out slower than on a quiet
    machine, often several times so. None when the load fits (or the OS does not report it).

    Example: busy_warning(3.4, 2) says the load of 3.4 exceeds the 2 cores and suggests --threads 1."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # pragma: no cover - no load average on this OS
            return None
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if load <= cores:
        return None
    return (f"warning: this machine's load ({load:.1f} over the last minute) exceeds its {cores} cores: other "
            "processes share them, so this run will be slower than on a quiet machine (several times, where "
            "they use every core); ratios against HF hold better than absolute times. Pass --threads 1 to take "
            "one core, or run when the machine is quieter.")



def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc/self/statm; 0 elsewhere), after a garbage
    collection and glibc's `malloc_trim(0)`, so that memory freed but kept by the allocator (a
    model's load leaves gigabytes so) is not counted as held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0

