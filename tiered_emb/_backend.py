"""The array module of the HBM tier: CuPy when a GPU is usable, NumPy otherwise.

``TIERED_EMB_DEVICE=cpu`` (or ``TierConfig(device="cpu")``) forces NumPy;
``device="cuda"`` without a usable GPU raises :class:`DeviceError`; ``"auto"`` falls
back to NumPy with one :class:`DeviceFallbackWarning` per process.
"""
from __future__ import annotations

import os
import warnings

import numpy as np

from .errors import DeviceError


class DeviceFallbackWarning(UserWarning):
    """``device="auto"`` found no usable GPU and uses NumPy for the HBM tier."""


_warned = False


def _cupy_or_reason():
    try:
        import cupy
    except Exception as err:  # ImportError, or a broken CUDA install raising anything
        return None, f"CuPy is not importable ({type(err).__name__}: {err})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device"
    except Exception as err:
        return None, f"CUDA is not usable ({type(err).__name__}: {err})"
    return cupy, None


def resolve_xp(device: str):
    """Array module for ``device`` ("auto", "cpu" or "cuda")."""
    global _warned
    if device == "cpu" or os.environ.get("TIERED_EMB_DEVICE", "").lower() == "cpu":
        return np
    cupy, reason = _cupy_or_reason()
    if cupy is not None:
        return cupy
    if device == "cuda":
        raise DeviceError(f"device='cuda' was asked for but {reason}",
                          "install the 'gpu' extra on a machine with an NVIDIA GPU, or use device='cpu'")
    if not _warned:
        _warned = True
        warnings.warn(f"device='auto': {reason}; the HBM tier uses NumPy in host memory",
                      DeviceFallbackWarning, stacklevel=3)
    return np


def to_host(a) -> np.ndarray:
    """A NumPy array of ``a`` (a copy when ``a`` lives on a GPU)."""
    return a if isinstance(a, np.ndarray) else a.get()


def to_xp(xp, a: np.ndarray):
    return a if xp is np else xp.asarray(a)
