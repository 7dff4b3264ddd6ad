"""Spawning a few ``torch.distributed`` ranks for a test, each writing its results as JSON.

A worker is ``worker(rank, world, port, out_dir)`` at module level of its test (spawn pickles it by
name): it calls :func:`join` first and :func:`leave` with its results last, in a ``finally``.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)


def leave(rank: int, out_dir: str, result: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(worker: Callable[..., None], world: int, out_dir: Path) -> list[dict[str, Any]]:
    """Run ``worker`` on ``world`` spawned ranks; their results in rank order."""
    torch.multiprocessing.spawn(worker, args=(world, free_port(), str(out_dir)), nprocs=world,
                                join=True)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
