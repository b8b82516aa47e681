"""Row-wise optimizers applied by the store, in place, on the HBM slots of a batch.

A row's record is ``[weights (dim) | optimizer state (state_width)]`` in one float32 row,
so the state travels with its row through every tier and into LMDB.  Updates are
*deterministic*: gradients of duplicate ids are summed in batch-position order
(:func:`tiered_emb.kernels.reduce_grads`), then each unique row is updated exactly once,
in parallel only across distinct rows; no atomics, no order that depends on threads.

State layouts (after the ``dim`` weights):

=================  ==============  ================================================
optimizer          state_width     contents
=================  ==============  ================================================
``SGD``            0               none
``Adagrad``        dim             element-wise sum of g*g
``RowWiseAdagrad`` 1               one scalar per row: sum over steps of mean(g*g)
``Adam``           2*dim + 1       m (dim), v (dim), the row's own step count
=================  ==============  ================================================

``Adam`` is the *lazy* (sparse) variant: a row's moments and step count advance only on
steps where the row receives a gradient, and bias correction uses the row's own count,
as FBGEMM's row-sparse Adam does.  The count is held as float32, exact up to 2**24
(16.7 M) updates of one row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from tiered_emb.errors import ConfigError


def _check_positive(cls: str, field: str, value: float, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{cls}.{field}={value!r} is invalid", f"use a finite number {'>= 0' if allow_zero else '> 0'}")


@dataclass(frozen=True)
class SGD:
    """Plain SGD: ``w -= lr * g``."""

    lr: float = 0.01
    name = "sgd"

    def __post_init__(self):
        _check_positive("SGD", "lr", self.lr)

    def state_width(self, dim: int) -> int:
        return 0

    def params(self) -> np.ndarray:
        return np.array([self.lr], dtype=np.float32)


@dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad: ``s += g*g; w -= lr * g / (sqrt(s) + eps)`` (torch.optim.Adagrad)."""

    lr: float = 0.01
    eps: float = 1e-10
    name = "adagrad"

    def __post_init__(self):
        _check_positive("Adagrad", "lr", self.lr)
        _check_positive("Adagrad", "eps", self.eps, allow_zero=True)

    def state_width(self, dim: int) -> int:
        return dim

    def params(self) -> np.ndarray:
        return np.array([self.lr, self.eps], dtype=np.float32)


@dataclass(frozen=True)
class RowWiseAdagrad:
    """Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD).

    ``s += mean(g*g)`` over the row; ``w -= lr * g / (sqrt(s) + eps)``.  One scalar of
    state per row instead of ``dim``.
    """

    lr: float = 0.01
    eps: float = 1e-8
    name = "rowwise_adagrad"

    def __post_init__(self):
        _check_positive("RowWiseAdagrad", "lr", self.lr)
        _check_positive("RowWiseAdagrad", "eps", self.eps, allow_zero=True)

    def state_width(self, dim: int) -> int:
        return 1

    def params(self) -> np.ndarray:
        return np.array([self.lr, self.eps], dtype=np.float32)


@dataclass(frozen=True)
class Adam:
    """Lazy (row-sparse) Adam with per-row bias correction; see the module docstring."""

    lr: float = 0.001
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    name = "adam"

    def __post_init__(self):
        _check_positive("Adam", "lr", self.lr)
        _check_positive("Adam", "eps", self.eps, allow_zero=True)
        b = self.betas
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(x, (int, float)) and 0.0 <= x < 1.0 for x in b)):
            raise ConfigError(f"Adam.betas={b!r} is invalid", "give two numbers in [0, 1), e.g. (0.9, 0.999)")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))

    def state_width(self, dim: int) -> int:
        return 2 * dim + 1

    def params(self) -> np.ndarray:
        return np.array([self.lr, self.betas[0], self.betas[1], self.eps], dtype=np.float32)


OPTIMIZERS = {cls.name: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam)}


def optimizer_from_dict(d: dict):
    """Rebuild an optimizer from :func:`optimizer_to_dict` output (manifest)."""
    d = dict(d)
    name = d.pop("name")
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer name={name!r} is unknown", f"use one of {sorted(OPTIMIZERS)}")
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    return OPTIMIZERS[name](**d)


def optimizer_to_dict(opt) -> dict:
    d = {"name": opt.name}
    d.update({k: getattr(opt, k) for k in opt.__dataclass_fields__})
    if "betas" in d:
        d["betas"] = list(d["betas"])
    return d


# --------------------------------------------------------------------------- kernels
# Each kernel updates records[slots[k]] with grads[k] for k in range(len(slots)),
# parallel over distinct rows (slots are distinct by construction: one per unique id).
# All arithmetic is float32 except the row-wise mean, accumulated in float64 in a fixed
# order, so results do not depend on the thread count.

@numba.njit(parallel=True, cache=True, nogil=True)
def _sgd_update(records, slots, grads, params):
    lr = params[0]
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        r = records[slots[k]]
        for j in range(dim):
            r[j] = r[j] - lr * grads[k, j]


@numba.njit(parallel=True, cache=True, nogil=True)
def _adagrad_update(records, slots, grads, params):
    lr = params[0]
    eps = params[1]
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        r = records[slots[k]]
        for j in range(dim):
            g = grads[k, j]
            s = r[dim + j] + g * g
            r[dim + j] = s
            r[j] = r[j] - lr * (g / (np.sqrt(s) + eps))


@numba.njit(parallel=True, cache=True, nogil=True)
def _rowwise_adagrad_update(records, slots, grads, params):
    lr = params[0]
    eps = params[1]
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        r = records[slots[k]]
        acc = 0.0
        for j in range(dim):
            g = np.float64(grads[k, j])
            acc += g * g
        s = r[dim] + np.float32(acc / dim)
        r[dim] = s
        step = lr / (np.sqrt(s) + eps)
        for j in range(dim):
            r[j] = r[j] - step * grads[k, j]


@numba.njit(parallel=True, cache=True, nogil=True)
def _adam_update(records, slots, grads, params):
    lr = params[0]
    b1 = params[1]
    b2 = params[2]
    eps = params[3]
    one = np.float32(1.0)
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        r = records[slots[k]]
        t = r[3 * dim] + one
        r[3 * dim] = t
        c1 = one - np.float32(np.float64(b1) ** np.float64(t))
        c2 = one - np.float32(np.float64(b2) ** np.float64(t))
        for j in range(dim):
            g = grads[k, j]
            m = b1 * r[dim + j] + (one - b1) * g
            v = b2 * r[2 * dim + j] + (one - b2) * g * g
            r[dim + j] = m
            r[2 * dim + j] = v
            r[j] = r[j] - lr * ((m / c1) / (np.sqrt(v / c2) + eps))


_CPU_KERNELS = {"sgd": _sgd_update, "adagrad": _adagrad_update,
                "rowwise_adagrad": _rowwise_adagrad_update, "adam": _adam_update}


def _no_update() -> None:
    """The update of an empty batch (what a prepared update is when there is nothing to do)."""


def apply_update(opt, records, slots, grads, xp=np) -> None:
    """Update ``records[slots]`` in place with ``grads`` (one row per distinct slot).

    Parameters
    ----------
    opt : SGD | Adagrad | RowWiseAdagrad | Adam
    records : float32 array (capacity, dim + state_width) on the ``xp`` device
    slots : int64 array (k,), distinct
    grads : float32 array (k, dim), host (numpy) for the CPU path
    """
    if xp is np:
        _CPU_KERNELS[opt.name](records, slots, grads, opt.params())
        return
    _apply_update_xp(opt, records, slots, grads, xp)


def _apply_update_xp(opt, records, slots, grads, xp) -> None:
    """The same arithmetic in array form, for the CuPy backend (float32 throughout)."""
    p = [xp.float32(x) for x in opt.params()]
    dim = grads.shape[1]
    g = xp.asarray(grads, dtype=xp.float32)
    s = xp.asarray(slots)
    r = records[s]
    w = r[:, :dim]
    if opt.name == "sgd":
        w = w - p[0] * g
    elif opt.name == "adagrad":
        st = r[:, dim:2 * dim] + g * g
        r[:, dim:2 * dim] = st
        w = w - p[0] * (g / (xp.sqrt(st) + p[1]))
    elif opt.name == "rowwise_adagrad":
        acc = (g.astype(xp.float64) ** 2).sum(axis=1) / dim
        st = r[:, dim] + acc.astype(xp.float32)
        r[:, dim] = st
        w = w - (p[0] / (xp.sqrt(st) + p[1]))[:, None] * g
    else:
        one = xp.float32(1.0)
        t = r[:, 3 * dim] + one
        r[:, 3 * dim] = t
        c1 = (one - (xp.float64(p[1]) ** t.astype(xp.float64)).astype(xp.float32))[:, None]
        c2 = (one - (xp.float64(p[2]) ** t.astype(xp.float64)).astype(xp.float32))[:, None]
        m = p[1] * r[:, dim:2 * dim] + (one - p[1]) * g
        v = p[2] * r[:, 2 * dim:3 * dim] + (one - p[2]) * g * g
        r[:, dim:2 * dim] = m
        r[:, 2 * dim:3 * dim] = v
        w = w - p[0] * ((m / c1) / (xp.sqrt(v / c2) + p[3]))
    r[:, :dim] = w
    records[s] = r
