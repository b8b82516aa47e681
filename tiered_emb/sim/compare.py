"""The same trace through libCacheSim (the ``bench`` extra), for side-by-side hit ratios and speed.

The trace is written once as libCacheSim's ``oracleGeneral`` binary (unit object sizes,
next-access times for Belady) and each cache runs it with ``process_trace``, libCacheSim's
own C loop: the fastest path its Python binding offers.  Cache sizes are object counts
(``obj_size = 1``), so a size means the same thing on both sides.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tiered_emb.errors import ConfigError, MissingExtraError
from tiered_emb.sim.engine import check_policy
from tiered_emb.sim.traces import write_oracle_general

LOG = logging.getLogger(__name__)

_S3FIFO_MIN_OBJECTS = 20


def import_libcachesim():
    try:
        import libcachesim
    except ImportError as err:
        raise MissingExtraError(
            "--compare libcachesim needs the libcachesim package, which is not installed",
            "pip install 'tiered-emb[bench]'",
        ) from err
    return libcachesim


#: libCacheSim's hash tables: "sized" to each cache (:func:`libcachesim_hashpower`, its
#: best setting for the sizes measured) or as its binding makes them by "default".
LIBCACHESIM_TABLES = ("sized", "default")


def libcachesim_hashpower(capacity: int, table: str = "sized") -> int | None:
    """libCacheSim's hash table size (log2 buckets) for a cache of ``capacity`` objects:
    with ``table="sized"`` at least twice the buckets, as our own index has; None with
    ``"default"`` (the binding's own, 24: 16M buckets, 128 MiB, which costs a smaller cache
    a fixed ~0.1 s a run and a cache miss a probe).  The table grows by itself when full,
    so the hits do not depend on it."""
    if table not in LIBCACHESIM_TABLES:
        raise ConfigError(f"unknown libCacheSim table {table!r}", f"choose from {', '.join(LIBCACHESIM_TABLES)}")
    return max(10, (2 * int(capacity) - 1).bit_length()) if table == "sized" else None


def _serve(path: str, n: int, table: str) -> None:
    """The worker: read ``NAME CAPACITY`` lines on stdin, answer ``SECONDS HITS`` lines."""
    lcs = import_libcachesim()
    for line in sys.stdin:
        name, cap = line.split()
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        power = libcachesim_hashpower(int(cap), table)
        cache = getattr(lcs, name)(cache_size=int(cap), **({} if power is None else {"hashpower": power}))
        t0 = time.perf_counter()
        miss_ratio, _ = cache.process_trace(reader)
        secs = time.perf_counter() - t0
        del cache, reader
        sys.stdout.write(f"{secs!r} {n - round(miss_ratio * n)}\n")
        sys.stdout.flush()


@contextmanager
def libcachesim_peer(trace: np.ndarray, workdir=None, table: str = "sized"):
    """A ``peer`` for :func:`tiered_emb.sim.bench.run_policies`: ``(policy, capacity) ->
    (seconds, hits)`` of one libCacheSim run of ``trace``, or None where it has no such
    policy (or cannot run it at that size).  ``table``: its hash tables, "sized" or
    "default" (:func:`libcachesim_hashpower`); ``run.table`` tells which.

    libCacheSim runs in a worker process of its own (``python -m tiered_emb.sim.compare``).
    Why: run in our process, its frees of a large cache slowed our next run (docs/policies.md),
    which no user of either engine would see; in its own process each engine runs as it would alone.
    """
    import subprocess

    libcachesim_hashpower(1, table)  # checks the name
    import_libcachesim()
    n = int(trace.shape[0])
    warned = set()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = Path(tmp) / "trace.oracleGeneral"
        write_oracle_general(path, trace)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiered_emb.sim.compare", str(path), str(n), table],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

        def run(policy: str, cap: int):
            name = check_policy(policy).libcachesim
            if name is None:
                return None
            if policy == "s3fifo" and cap < _S3FIFO_MIN_OBJECTS:
                if cap not in warned:  # libCacheSim would abort the process
                    warned.add(cap)
                    LOG.warning("libCacheSim S3FIFO skipped at %d objects (needs >= 20)", cap)
                return None
            proc.stdin.write(f"{name} {int(cap)}\n")
            proc.stdin.flush()
            answer = proc.stdout.readline().split()
            if len(answer) != 2:
                raise RuntimeError(f"the libCacheSim worker stopped (exit code {proc.poll()})")
            return float(answer[0]), int(answer[1])

        run.table = table
        try:
            yield run
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)
            proc.stdout.close()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), sys.argv[3])
