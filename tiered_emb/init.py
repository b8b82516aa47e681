"""Lazy deterministic initial rows.

A row never written is stored nowhere.  Its first value is a pure function of
``(seed, table name, id)``: a counter-based hash (splitmix64) of those three and the
element index gives each element's random bits, so the value does not depend on the
order in which ids are first touched, on tier sizes, or on the thread count.  A table
with ``init_table`` and ``init_column`` (a column-wise shard) is keyed by that name, its
columns numbered from that column: it starts as exactly those columns of the whole row.
Optimizer state of a fresh row is zero.  A table of a narrower ``dtype`` rounds the
float32 draw to nearest (:mod:`tiered_emb.precision`).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from tiered_emb._jit import kernel
from tiered_emb.config import Normal, TableConfig
from tiered_emb.precision import encode

_KIND_UNIFORM = 0
_KIND_NORMAL = 1


def table_hash(name: str) -> int:
    """64-bit FNV-1a of the table name (stable across processes, unlike ``hash()``)."""
    h = 0xCBF29CE484222325
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@numba.njit(inline="always")
def _splitmix64(x: np.uint64) -> np.uint64:
    """One splitmix64 output for state ``x`` (uint64 -> uint64)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@kernel(parallel=True)
def _init_rows(
    out: npt.NDArray[np.float32],
    at: npt.NDArray[np.int64],
    ids: npt.NDArray[np.int64],
    seed: np.uint64,
    thash: np.uint64,
    col0: int,
    kind: int,
    a: float,
    b: float,
    dim: int,
) -> None:
    """Fill row ``at[r]`` of ``out`` (.., width) float32 (row ``r`` where ``at`` is empty)
    with the initial record of ``ids[r]``: its first ``dim`` columns from the hash, the
    rest (the optimizer state) zero.

    ``kind`` 0: Uniform(a, b); 1: Normal(mean=a, std=b).  Column ``j`` of the weights is
    column ``col0 + j`` of the keyed row.
    """
    n = ids.shape[0]
    width = out.shape[1]
    by_at = at.shape[0] > 0
    base = _splitmix64(np.uint64(seed)) ^ _splitmix64(np.uint64(thash))
    two_pi = 6.283185307179586
    for r in numba.prange(n):
        row = at[r] if by_at else np.int64(r)
        key = _splitmix64(base ^ _splitmix64(np.uint64(ids[r])))
        for jj in range(dim):
            j = jj + col0
            if kind == 0:
                x = _splitmix64(key + np.uint64(j + 1) * np.uint64(0x9E3779B97F4A7C15))
                u = np.float64(x >> np.uint64(11)) * 1.1102230246251565e-16  # [0, 1)
                out[row, jj] = np.float32(a + (b - a) * u)
            else:
                x1 = _splitmix64(key + np.uint64(2 * j + 1) * np.uint64(0x9E3779B97F4A7C15))
                x2 = _splitmix64(key + np.uint64(2 * j + 2) * np.uint64(0x9E3779B97F4A7C15))
                u1 = (np.float64(x1 >> np.uint64(11)) + 1.0) * 1.1102230246251565e-16  # (0, 1]
                u2 = np.float64(x2 >> np.uint64(11)) * 1.1102230246251565e-16
                z = np.sqrt(-2.0 * np.log(u1)) * np.cos(two_pi * u2)
                out[row, jj] = np.float32(a + b * z)
        for jj in range(dim, width):
            out[row, jj] = np.float32(0.0)


_NO_AT = np.empty(0, dtype=np.int64)


def _fill(table: TableConfig, ids: np.ndarray, seed: int, out: np.ndarray, at: np.ndarray) -> None:
    """:func:`_init_rows` of ``ids`` into the float32 records ``out`` (rows ``at``, or all)."""
    init = table.init
    if isinstance(init, Normal):
        kind, a, b = _KIND_NORMAL, float(init.mean), float(init.std)
    else:
        kind, a, b = _KIND_UNIFORM, float(init.low), float(init.high)
    _init_rows(
        out,
        at,
        np.ascontiguousarray(ids, dtype=np.int64),
        np.uint64(seed & (2**64 - 1)),
        np.uint64(table_hash(table.init_table or table.name)),
        table.init_column,
        kind,
        a,
        b,
        table.dim,
    )


def init_rows(table: TableConfig, ids: npt.NDArray[np.integer[Any]], seed: int) -> npt.NDArray[np.float32]:
    """Initial records of ``ids`` in ``table``.

    Parameters
    ----------
    table : TableConfig
    ids : int64 array (n,)
    seed : int

    Returns
    -------
    float32 array (n, table.record_width): weights from the initialiser (in the table's
    dtype, rounded to nearest), state zeros.

    Examples
    --------
    >>> t = TableConfig("t", dim=4)
    >>> bool((init_rows(t, np.array([7]), 0) == init_rows(t, np.array([3, 7]), 0)[1]).all())
    True
    """
    if table.dtype == "float32":
        out = np.empty((ids.shape[0], table.record_width), dtype=np.float32)
        if ids.shape[0]:
            _fill(table, ids, seed, out, _NO_AT)
        return out
    out = np.zeros((ids.shape[0], table.record_width), dtype=np.float32)
    if ids.shape[0]:
        weights = np.empty((ids.shape[0], table.dim), np.float32)
        _fill(table, ids, seed, weights, _NO_AT)
        encode(table.dtype, weights, out)
    return out


def init_rows_into(table: TableConfig, ids: np.ndarray, seed: int, out: np.ndarray, at: np.ndarray) -> None:
    """:func:`init_rows` of ``ids`` written into rows ``at`` (int64, one per id) of the float32
    records ``out`` (.., record_width): the same values, no buffer of their own."""
    if not ids.shape[0]:
        return
    at = np.ascontiguousarray(at, dtype=np.int64)
    if table.dtype != "float32":  # (the weights drawn apart, encoded into the rows; the state zeros)
        weights = np.empty((ids.shape[0], table.dim), np.float32)
        _fill(table, ids, seed, weights, _NO_AT)
        out[at, table.weight_words :] = 0
        encode(table.dtype, weights, out, at)
        return
    _fill(table, ids, seed, out, at)
