"""Tensor-parallel models (`from_pretrained(..., tp_plan="auto")` under torchrun): what the
ranks must agree on so that every rank runs the same steps.

Each rank runs its own engine over its shard of the heads; the model's forward all-reduces
inside, so every rank sees the same logits. The engine's own decisions must then be identical
on all ranks, or their forwards (and collectives) part ways: the KV cache capacity (sized from
each rank's free memory: the ranks take the smallest), the random draws of sampling (a sampled
call's one seed, drafting.verify, is rank 0's on every rank, so a rank seeded differently, or
not at all, still draws what rank 0 draws), and no timing-based choices (the CPU head's layout
is not timed)."""

from __future__ import annotations

import torch


def tensor_parallel(model: torch.nn.Module) -> bool:
    """True when torch.distributed runs more than one rank and the model holds sharded (DTensor)
    parameters."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _comm_device() -> torch.device:
    """Where a tensor for a collective of the default group must live (NCCL: the current GPU)."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_min(value: int) -> int:
    """The smallest `value` over all ranks."""
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def agree_seed(seed: int) -> int:
    """Rank 0's `seed` (a sampled call's seed) on every rank."""
    t = torch.tensor([seed], dtype=torch.int64, device=_comm_device())
    torch.distributed.broadcast(t, src=0)
    return int(t.item())
