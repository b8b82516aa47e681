"""The array module of the HBM tier: CuPy when a GPU is usable, NumPy otherwise.

``TIERED_EMB_DEVICE=cpu`` (or ``TierConfig(device="cpu")``) forces NumPy;
``device="cuda"`` without a usable GPU raises :class:`DeviceError`; ``"auto"`` falls
back to NumPy with one :class:`DeviceFallbackWarning` per process.  A GPU is usable when
CuPy sees a device: CuPy's NVRTC compiles the step's CUDA C kernels
(:mod:`tiered_emb.step.device.native`).  Their numba-cuda twins (``TIERED_EMB_CUDA_KERNELS=numba``)
need numba-cuda besides; both come with the ``gpu-cuda12`` / ``gpu-cuda13`` extras (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from tiered_emb.errors import DeviceError


class DeviceFallbackWarning(UserWarning):
    """``device="auto"`` found no usable GPU and uses NumPy for the HBM tier."""


_warned = False


def _cupy_or_reason() -> tuple[ModuleType | None, str | None]:
    try:
        import cupy
    except Exception as err:  # ImportError, or a broken CUDA install raising anything
        return None, f"CuPy is not importable ({type(err).__name__}: {err})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device"
    except Exception as err:  # no driver, or a driver older than the CUDA CuPy was built for
        return None, f"CUDA is not usable ({type(err).__name__}: {err})"
    return cupy, None


GPU_HINT = (
    "install the extra that matches the CUDA major version your driver runs (`nvidia-smi` shows it): "
    "pip install 'tiered-emb[gpu-cuda12]' or 'tiered-emb[gpu-cuda13]' (docs/gpu.md); or use device='cpu'"
)


def resolve_xp(device: str) -> ModuleType:
    """Array module for ``device`` ("auto", "cpu" or "cuda")."""
    global _warned
    if device == "cpu" or os.environ.get("TIERED_EMB_DEVICE", "").lower() == "cpu":
        return np
    cupy, reason = _cupy_or_reason()
    if cupy is not None:
        return cupy
    if device == "cuda":
        raise DeviceError(
            f"device='cuda' was asked for but {reason}",
            GPU_HINT,
        )
    if not _warned:
        _warned = True
        warnings.warn(
            f"device='auto': {reason}; the HBM tier uses NumPy in host memory", DeviceFallbackWarning, stacklevel=3
        )
    return np


def to_host(a: Any) -> npt.NDArray[Any]:
    """A NumPy array of ``a`` (a copy when ``a`` lives on a GPU)."""
    if isinstance(a, np.ndarray):
        return a
    host: npt.NDArray[Any] = a.get()
    return host


def to_xp(xp: ModuleType, a: npt.NDArray[Any]) -> Any:
    """``a`` as an array of ``xp`` (itself when ``xp`` is NumPy, a device copy otherwise)."""
    return a if xp is np else xp.asarray(a)


_HUGE_PAGE_BYTES = 2 << 20


def host_zeros(shape: tuple[int, int]) -> npt.NDArray[np.float32]:
    """Zeroed float32 host array for a tier's records, on transparent huge pages where Linux
    offers them (:func:`host_full`)."""
    return host_full(shape, np.float32, 0)


def host_full(shape: Any, dtype: Any, fill: Any) -> npt.NDArray[Any]:
    """A host array of ``shape`` filled with ``fill``, on transparent huge pages where Linux offers them.

    A step reads rows, index buckets and slot state at random across whole arrays; with
    4 KiB pages nearly every such read also misses the TLB, and a prefetch that misses the
    TLB does not hide the miss.  2 MiB pages (``MADV_HUGEPAGE``, honoured when
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) take that
    miss out of the pooled forward and the tiers' decisions (docs/training.md,
    docs/benchmarks.md).  The price: memory is committed 2 MiB at a time, so a tier's
    resident size approaches its capacity sooner.  Small arrays, and systems without
    ``madvise``, get ``np.full``.
    """
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE_PAGE_BYTES or advice is None:
        return np.full(shape, fill, dtype=dt)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without THP: the mapping is still good, with small pages
        buf.madvise(advice)
    out = np.frombuffer(buf, dtype=dt).reshape(shape)
    if fill != 0:  # (fresh anonymous pages are zero)
        out.fill(fill)
    return out
