"""Ranks started by the job itself: ``world_size`` processes on this machine, each in a
process group (gloo, or NCCL when asked), running one function; what a command's
``--world-size N`` and the tests use.  On several machines, ``torchrun`` starts the ranks
instead and each calls :func:`init_from_env` (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tiered_emb.errors import ConfigError, DistributedError

#: How long a collective waits for a rank that does not come (a dead or hung rank) before
#: every other rank fails with an error instead of waiting forever.
DEFAULT_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port free on this machine now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_from_env(backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group torchrun (or :func:`run_ranks`) describes in the environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); returns ``(rank, world_size)``."""
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend={backend!r}", "use 'gloo' (CPU) or 'nccl' (GPU)")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise DistributedError(
            f"the environment lacks {missing} to join a process group",
            "start the job with torchrun --nproc-per-node N, or with --world-size N",
        )
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _rank_main(
    rank: int, fn: Callable, world_size: int, port: int, args: tuple, out: str, backend: str, timeout_s: float
):
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.enable()  # a rank killed by a signal shows where each of its threads was
    init_from_env(backend, timeout_s)
    try:
        result = fn(rank, world_size, *args)
        with open(Path(out) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        leave()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    allow_missing: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes joined in one
    process group; returns each rank's result (picklable), in rank order.

    ``fn`` must be importable by name (a module's top-level function).  A rank that raises
    makes this raise (torch's ``ProcessRaisedException``, with that rank's traceback); the
    others fail within ``timeout_s`` at their next collective.  A rank that ended without
    a result (it exited) is a :class:`DistributedError`, or None with ``allow_missing``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}", "use an int >= 1")
    with tempfile.TemporaryDirectory(prefix="tiered-emb-ranks-") as out:
        mp.start_processes(
            _rank_main,
            args=(fn, world_size, free_port(), args, out, backend, timeout_s),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        results = []
        for r in range(world_size):
            path = Path(out) / f"{r}.pkl"
            if not path.exists():
                if allow_missing:
                    results.append(None)
                    continue
                raise DistributedError(f"rank {r} ended without a result", "read that rank's output: it exited early")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


def barrier() -> None:
    """Wait for every rank of the default group."""
    dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable) on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def leave() -> None:
    """Leave the default group: once every rank is done with it, so that none tears it down
    under another (rank 0 hosts its store)."""
    with contextlib.suppress(RuntimeError):  # (a rank that died: nobody to wait for)
        dist.barrier()
    dist.destroy_process_group()


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "barrier",
    "broadcast_object",
    "free_port",
    "gather_objects",
    "init_from_env",
    "leave",
    "run_ranks",
]
