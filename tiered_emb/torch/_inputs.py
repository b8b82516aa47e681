"""The inputs of the torch modules, coerced once: ids, offsets and ``per_sample_weights`` as
torch.nn.EmbeddingBag takes them, checked and copied into NumPy arrays."""

from __future__ import annotations

import numpy as np
import torch

from tiered_emb.errors import ConfigError, DeviceError, IdRangeError, IdTypeError

_MAX_INT64 = 2**63 - 1


def no_data(x, what: str) -> None:
    """A tensor on the ``meta`` device has a shape but no values to read."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        raise DeviceError(
            f"{what} are on the 'meta' device, which holds no data", "pass tensors with values (on the CPU or the GPU)"
        )


def as_numpy_ids(x, what: str, copy: bool = True) -> np.ndarray:
    """``x`` (a tensor or array of integer ids) as int64 NumPy, checked: a copy, or with
    ``copy=False`` a view of ``x`` where it is one already (no backward will read it)."""
    if isinstance(x, torch.Tensor):
        no_data(x, what)
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
            raise IdTypeError(f"{what} have dtype {x.dtype}", "pass integer ids (torch.long)")
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        a = x.numpy()
    else:
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise IdTypeError(f"{what} have dtype {a.dtype}", "pass integer ids")
    if a.dtype == np.uint64 and a.size and int(a.max()) > _MAX_INT64:  # would wrap to a negative int64
        raise IdRangeError(f"{what} hold {int(a.max())}, beyond int64", f"ids are int64 in [0, {_MAX_INT64}]")
    # A copy, never a view of the caller's tensor, where a backward reads the batch again:
    # an input changed in place after the forward must not change the update.
    if not copy:
        return np.ascontiguousarray(a, dtype=np.int64)
    return np.array(a, dtype=np.int64, order="C", copy=True)


def bags_of(input, offsets, include_last_offset: bool, copy: bool = True) -> tuple[np.ndarray, np.ndarray, tuple]:
    """``(ids (n,), offsets (B+1,), the input's shape)`` from torch.nn.EmbeddingBag's input
    conventions (``copy``: as :func:`as_numpy_ids`)."""
    ids = as_numpy_ids(input, "input ids", copy)
    shape = tuple(ids.shape)
    if ids.ndim == 2:
        if offsets is not None:
            raise ConfigError("offsets were given with a 2-D input", "pass offsets=None for 2-D (B, L) input")
        b, length = ids.shape
        return ids.reshape(-1), np.arange(b + 1, dtype=np.int64) * length, shape
    if ids.ndim != 1:
        raise IdTypeError(f"input ids have shape {tuple(ids.shape)}", "pass 1-D ids with offsets, or 2-D (B, L) ids")
    if offsets is None:
        raise ConfigError("a 1-D input needs offsets", "pass offsets (int64, one start per bag), or a 2-D input")
    off = as_numpy_ids(offsets, "offsets", copy)
    if off.ndim != 1:
        raise IdTypeError(f"offsets have shape {tuple(off.shape)}", "pass 1-D offsets")
    if not include_last_offset:
        off = np.concatenate([off, np.array([ids.shape[0]], dtype=np.int64)])
    return ids, off, shape


def weights_of(per_sample_weights, shape: tuple, mode: str):
    """float32 (n,) weights from ``per_sample_weights``, a tensor of the ids' ``shape`` (as in torch)."""
    if per_sample_weights is None:
        return None
    if mode != "sum":
        raise ConfigError(f"per_sample_weights with mode={mode!r}", "per_sample_weights need mode='sum' (as in torch)")
    w = per_sample_weights
    if not isinstance(w, torch.Tensor):
        raise ConfigError(
            f"per_sample_weights of type {type(w).__name__} are invalid",
            "pass a float tensor (torch.as_tensor(w, dtype=torch.float32)), as torch.nn.EmbeddingBag",
        )
    no_data(w, "per_sample_weights")
    if w.is_complex():  # its imaginary part would be dropped
        raise ConfigError(f"per_sample_weights have dtype {w.dtype}", "pass real weights (torch.float32)")
    if tuple(w.shape) != tuple(shape):
        raise ConfigError(
            f"per_sample_weights have shape {tuple(w.shape)} for input ids of shape {tuple(shape)}",
            "give one weight per id, in the input's shape (as torch.nn.EmbeddingBag)",
        )
    w = w.detach().reshape(-1)
    return np.array(w.cpu().numpy(), dtype=np.float32, order="C", copy=True)  # a copy: see as_numpy_ids
