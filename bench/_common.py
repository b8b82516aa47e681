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

#: Vector extensions worth naming: figures from CPUs that differ in them do not compare.
_VECTOR_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "asimd",
    "sve",
    "sve2",
)


def cpu() -> dict:
    """The CPU's model name and vector extensions (Linux's /proc/cpuinfo; the platform's
    processor string elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and value.strip():
                model = value.strip()
            elif key in ("flags", "Features"):
                flags = set(value.split())
            if model and flags:
                break
    return {"model": model, "vector_extensions": [f for f in _VECTOR_FLAGS if f in flags]}


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
        "cpu": cpu(),
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


def fbgemm_tbe(rows: int, dim: int, on_gpu: bool, lr: float, eps: float, weights_precision: str = "FP32"):
    """FBGEMM's TBE over one table with EXACT_ROWWISE_ADAGRAD, in host memory on the CPU or in
    device memory on the GPU, its rows in ``weights_precision`` (a ``SparseType`` name: FP32,
    FP16); None (said on stderr) where fbgemm_gpu does not import."""
    import warnings

    try:
        with warnings.catch_warnings():  # (fbgemm_gpu warns about its optional ops)
            warnings.simplefilter("ignore")
            from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                ComputeDevice,
                SplitTableBatchedEmbeddingBagsCodegen,
            )
    except Exception as err:  # not installed, or a build that does not load here
        print(f"fbgemm_gpu not usable ({type(err).__name__}: {err}); skipping it", file=sys.stderr)
        return None
    where = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if on_gpu else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, *where)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr,
        eps=eps,
        weights_precision=SparseType[weights_precision],
    )
