"""Shared helpers of the benchmark scripts: machine description, timing, JSON output."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path


def machine() -> dict:
    versions = {}
    for pkg in (
        "numpy",
        "numba",
        "lmdb",
        "zstandard",
        "torch",
        "fbgemm-gpu-cpu",
        "libcachesim",
        "cupy-cuda12x",
        "cupy-cuda13x",
        "numba-cuda",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "versions": versions,
        "numba_threads": int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count() or 1)),
    }


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (after one warm-up call)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs) -> float:
    return statistics.median(xs)


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))
