"""Tensor-parallel process group and the two collectives the parallel layers need: one process
per rank (rank 0 the engine); ``device_group`` (NCCL / gloo) for tensors, ``cpu_group`` (gloo)
for the pickled per-step batch header. Not created at ``tensor_parallel_size == 1``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class TPGroup:
    """This process's place in the group: ``rank`` in ``[0, size)``, ``device``."""

    rank: int
    size: int
    device: torch.device
    device_group: Any
    cpu_group: Any

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and the sampler; the others only run forwards."""
        return self.rank == 0


def init_tp_group(rank: int, size: int, init_method: str, device: str) -> TPGroup:
    """Join the ``size``-process group at ``init_method`` (``tcp://host:port``) as ``rank``
    on ``device`` (``cpu``: gloo; ``cuda``: NCCL on ``cuda:<rank>``); blocks until all join.
    RuntimeError when CUDA has fewer devices than ``size``."""
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process; "
                           "call its shutdown() first")
    # NOTE: a worker waits on the gloo group for the next batch for as long as the server is
    # idle, so that group must not time out (a dead peer still fails fast: its sockets close).
    idle = timedelta(days=365)
    if device.startswith("cuda"):
        if torch.cuda.device_count() < size:
            raise RuntimeError(f"tensor_parallel_size={size} needs {size} CUDA devices, "
                               f"found {torch.cuda.device_count()}")
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            device_id=dev if backend == "nccl" else None,
                            timeout=None if backend == "nccl" else idle)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=idle) if backend == "nccl" \
        else device_group
    return TPGroup(rank, size, dev, device_group, cpu_group)


def destroy_tp_group() -> None:
    """Leave the process group (so a later engine in this process can make a new one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``[..., n]`` on every rank -> ``[..., size * n]``, rank r's block at ``[r*n, (r+1)*n)``."""
    import torch.distributed as dist

    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = flat.new_empty(tp.size * flat.shape[0], flat.shape[1])  # ranks stacked on dim 0
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch<2.13
    gather(out, flat, group=tp.device_group)
    out = out.view(tp.size, flat.shape[0], flat.shape[1]).transpose(0, 1)
    return out.reshape(*x.shape[:-1], tp.size * x.shape[-1])
