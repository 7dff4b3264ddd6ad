"""``vitgraph bench --data-parallel``: the stream's vitgraph modes over a ``torchrun`` world.

Every rank runs the same seeded stream. Each vitgraph mode runs as itself on every rank alone and
as ``<mode>+dp`` through :func:`~vit_graph_backend.integrations.parallel.data_parallel`, so one
run shows 1 against N GPUs. Rank 0 reports; a ``+dp`` mode adds every rank's busy seconds, whose
spread is the assignment's imbalance.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["DP_SUFFIX", "LAUNCH_HINT", "gather_floats", "init_world", "is_rank_zero", "launched",
           "start_together"]

#: Suffix of a mode run data-parallel (``vitgraph+dp``).
DP_SUFFIX = "+dp"
#: The error of a ``data_parallel`` run outside ``torchrun``, naming the command that launches it.
LAUNCH_HINT = ("data_parallel=True needs a torchrun launch (RANK and WORLD_SIZE are unset): "
               "torchrun --nproc-per-node N -m vit_graph_backend bench --data-parallel ...")


def _group_up() -> bool:
    """A default process group exists (imports no torch)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def launched() -> bool:
    """True under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) or with a process group up;
    imports no torch."""
    return _group_up() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_world(device: str) -> tuple[int, int, str]:
    """Join the ``torchrun`` world (``nccl`` on CUDA, ``gloo`` on CPU) unless a process group is
    already up; returns ``(rank, world_size, this rank's device)``.

    Raises:
        ValueError: when the process was not launched by ``torchrun`` (no ``RANK`` in the
            environment), naming the command that does.
    """
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not _group_up():
        if not launched():
            raise ValueError(LAUNCH_HINT)
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        device = f"cuda:{local}"
    return dist.get_rank(), dist.get_world_size(), device


def is_rank_zero() -> bool:
    """True outside a process group, and on rank 0 inside one."""
    import torch.distributed as dist

    return not _group_up() or dist.get_rank() == 0


def gather_floats(value: float) -> list[float]:
    """``value`` from every rank, in rank order (``[value]`` outside a process group)."""
    import torch.distributed as dist

    if not _group_up():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, float(value))
    return [float(v) for v in values]


def start_together() -> None:
    """Wait until every rank is here (no-op outside a process group).

    Called before each timed call of a ``+dp`` mode: a data-parallel call ends with collectives,
    so one rank's untimed work (the equivalence check's copy to the host) would otherwise count
    in the next call's time on every other rank.
    """
    import torch.distributed as dist

    if _group_up():
        dist.barrier()
