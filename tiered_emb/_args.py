"""Argument checks, once per call: the store's ids, rows and flags, and the simulator's arguments.

Every check raises a typed error from :mod:`tiered_emb.errors` naming the value and a hint.

Each check is O(1) or one vectorised O(n) pass, done once per call, never inside a kernel.
"""

from __future__ import annotations

import math
import operator
from decimal import Decimal
from typing import Any

import numpy as np
import numpy.typing as npt

from tiered_emb._backend import to_host
from tiered_emb.errors import ConfigError, IdRangeError, IdTypeError, RowDtypeError, RowShapeError

_INT64_MAX = 2**63 - 1
_COUNT_SUFFIX = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


_BYTE_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "B": 1}


def parse_bytes(text: object) -> int:
    """A size in bytes: ``"2GiB"``, ``"512MiB"``, ``"1.5KiB"``, ``"100B"`` (powers of 1024),
    or a count (:func:`parse_count`: ``"4M"`` is 4e6 bytes); ConfigError for anything else.

    Examples
    --------
    >>> parse_bytes("2GiB"), parse_bytes("1.5KiB"), parse_bytes("4M")
    (2147483648, 1536, 4000000)
    """
    t = str(text).strip()
    for unit, scale in _BYTE_UNITS.items():
        if t.endswith(unit):
            try:
                d = Decimal(t[: -len(unit)].strip().replace("_", "")) * scale
                ok = d.is_finite() and d >= 0 and d == d.to_integral_value() and d <= _INT64_MAX
            except ArithmeticError:  # not a number (decimal.InvalidOperation)
                ok = False
            if not ok:
                raise ConfigError(f"not a size in bytes: {text!r}", "write e.g. 2GiB, 512MiB, 1.5KiB, 100B or 4M")
            return int(d)
    return parse_count(t)


def parse_count(text: object) -> int:
    """A count in the command line's syntax: ``"20M"`` -> 20_000_000; ``"10k"``, ``"1.5G"``,
    ``"2_000"``, ``"1e6"`` and plain integers too.  A count that is not a whole number
    (``"1.0001K"``, ``"2.5"``) or beyond int64 is a :class:`ConfigError`, never rounded.

    Examples
    --------
    >>> parse_count("1.5M"), parse_count("2K"), parse_count("-1")
    (1500000, 2000, -1)
    """
    t = str(text).strip().replace("_", "")
    scale = 1
    if t and t[-1] in _COUNT_SUFFIX:
        t, scale = t[:-1], _COUNT_SUFFIX[t[-1]]
    try:
        d = Decimal(t)
        # bounded by the exponent first: 1e999999999 would take ages to expand, and a product
        # below the context's range would round to 0
        whole = d.is_finite() and (d == 0 or -13 < d.adjusted() < 19)
        value = d * scale if whole else Decimal(0)
        whole = whole and abs(value) <= _INT64_MAX and value == value.to_integral_value()
    except ArithmeticError:  # not a number (decimal.InvalidOperation)
        whole = False
    if not whole:
        raise ConfigError(f"not a count: {text!r}", "write a whole number, e.g. 20M, 1.5K, 10k or 5000")
    return int(value)


def int_arg(name: str, value: Any, lo: int | None = None, hi: int | None = None, hint: str | None = None) -> int:
    """``value`` as an int (a Python or NumPy integer; not a bool, not a float), within ``[lo, hi]``."""
    if isinstance(value, (bool, np.bool_)):
        ok = False
    else:
        try:
            v = operator.index(value)
            ok = True
        except TypeError:
            ok = False
    if not ok:
        raise ConfigError(f"{name}={value!r} is not an integer", hint or f"give {name} as an int")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ConfigError(f"{name}={v} is out of range", hint or f"give {name} {rng}")
    return v


def finite_arg(name: str, value: Any, lo: float | None = None, hint: str | None = None) -> float:
    """``value`` as a finite float, ``>= lo``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a number", hint or f"give {name} as a number") from None
    if not math.isfinite(v) or (lo is not None and v < lo):
        raise ConfigError(
            f"{name}={value!r} is invalid", hint or f"give a finite {name}" + ("" if lo is None else f" >= {lo}")
        )
    return v


def _all_ints(ids: Any) -> bool:
    try:
        flat = np.asarray(ids, dtype=object).ravel()
    except (ValueError, TypeError):
        return False
    return flat.size > 0 and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in flat)


def as_ids(ids: Any, what: str = "trace") -> npt.NDArray[np.int64]:
    """``ids`` as a contiguous int64 (n,) array, or an :class:`IdTypeError` (not integers,
    not 1-D) / :class:`IdRangeError` (beyond int64).  Float ids are never truncated; an
    empty array of any numeric dtype is an empty trace.  Negative ids pass (the caller
    decides: see :func:`check_nonneg`)."""
    try:
        a = np.asarray(ids)
    except OverflowError:
        raise IdRangeError(f"{what} holds an id beyond int64", "ids are int64 (>= 0 for the simulator)") from None
    except (ValueError, TypeError) as err:
        raise IdTypeError(f"{what} is not an array of ids ({err})", "pass a 1-D integer array") from None
    if a.ndim != 1:
        raise IdTypeError(f"{what} has shape {a.shape}", "pass a 1-D array of ids (ravel it)")
    kind = a.dtype.kind
    if a.shape[0] == 0 and kind in "iuf":
        return np.zeros(0, dtype=np.int64)
    if kind not in "iu":
        if kind in "fO" and not isinstance(ids, np.ndarray) and _all_ints(ids):
            # Python ints that NumPy could not hold as int64 (it made floats or objects of them)
            raise IdRangeError(f"{what} holds an id beyond int64", "ids are int64 (>= 0 for the simulator)")
        raise IdTypeError(
            f"{what} has dtype {a.dtype}",
            "pass integer ids, e.g. np.asarray(ids, dtype=np.int64); float ids are not rounded",
        )
    if kind == "u" and a.dtype.itemsize == 8 and int(a.max()) > _INT64_MAX:
        raise IdRangeError(
            f"id {int(a.max())} of {what} is beyond int64",
            "relabel the ids, e.g. np.unique(ids, return_inverse=True)[1]",
        )
    return np.ascontiguousarray(a, dtype=np.int64)


def check_nonneg(lo: int, what: str = "trace") -> None:
    """An :class:`IdRangeError` when the smallest id ``lo`` is negative (-1 is the hash index's empty key)."""
    if lo < 0:
        raise IdRangeError(f"ids must be >= 0, got {lo} in {what}", "offset or relabel the ids of the trace")


def int64_of(a: object, what: str) -> np.ndarray:
    """``a`` as int64, or IdTypeError (not integers) / IdRangeError (uint64 beyond int64): never truncated."""
    a = np.asarray(a)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise IdTypeError(f"{what} have dtype {a.dtype}", f"pass integer {what}, e.g. np.asarray(x, dtype=np.int64)")
    if a.dtype == np.uint64 and a.size and int(a.max()) > 2**63 - 1:
        raise IdRangeError(f"{what} hold {int(a.max())}, beyond int64", "ids are int64 >= 0")
    return np.ascontiguousarray(a, dtype=np.int64)


def table_ids(table: str, ids: object, num_rows: int | None) -> np.ndarray:
    """``ids`` of ``table`` as a contiguous int64 (n,) array, checked: integers, 1-D, ``>= 0``
    and below ``num_rows`` when it is set (IdTypeError / IdRangeError otherwise)."""
    try:
        a = np.asarray(ids)
    except (ValueError, TypeError) as err:  # ragged lists, say
        raise IdTypeError(
            f"ids for table {table!r} do not make an array ({err})",
            "pass a 1-D integer array, e.g. np.asarray(ids, dtype=np.int64)",
        ) from err
    a = as_ids(a, f"ids for table {table!r}")  # integers, 1-D, within int64
    if a.shape[0] == 0:
        return a
    lo, hi = int(a.min()), int(a.max())
    if lo < 0:
        raise IdRangeError(f"id {lo} of table {table!r} is negative", "ids are >= 0")
    if num_rows is not None and hi >= num_rows:
        raise IdRangeError(
            f"id {hi} of table {table!r} is not below num_rows={num_rows}",
            "check the id mapping, or create the table with a larger num_rows (or None)",
        )
    return a


def table_rows(table: str, rows: object, n: int, dim: int, what: str, keep_device: bool = False) -> np.ndarray:
    """``rows`` (host NumPy or a device array) as contiguous float32 (n, dim), or
    RowDtypeError / RowShapeError naming ``what`` (gradients, rows...).  ``keep_device``: a
    device array (CuPy) is checked where it is and returned as it is, not copied to the host."""
    on_device = not isinstance(rows, np.ndarray) and hasattr(rows, "get")
    if keep_device and on_device:
        r: Any = rows
    else:
        r = to_host(rows) if on_device else np.asarray(rows)
    if r.dtype != np.float32:
        raise RowDtypeError(
            f"{what} for table {table!r} have dtype {r.dtype}", "pass float32, e.g. np.asarray(x, dtype=np.float32)"
        )
    if r.shape != (n, dim):
        raise RowShapeError(
            f"{what} for table {table!r} have shape {r.shape}, expected {(n, dim)}",
            "pass one row of the table's dim per id",
        )
    return r if keep_device and on_device else np.ascontiguousarray(r)


def nonfinite_rule(nonfinite: object) -> str:
    """``nonfinite`` checked: ``"raise"``, ``"skip"`` or ``"zero"``."""
    if nonfinite not in ("raise", "skip", "zero"):
        raise ConfigError(f"nonfinite={nonfinite!r} is invalid", "use 'raise', 'skip' or 'zero'")
    return nonfinite


def extra_bytes(extra: object) -> None:
    """``extra`` (a trainer's bytes saved with a checkpoint) checked: None or bytes-like."""
    if extra is not None and not isinstance(extra, (bytes, bytearray, memoryview)):
        raise ConfigError(f"extra of type {type(extra).__name__} is invalid", "pass bytes (e.g. pickle.dumps(state))")


def snapshot_arg(snapshot: object, restore: str = "checkpoint") -> None:
    """ConfigError unless ``snapshot`` is None or a checkpoint's number (an int >= 0) and
    ``restore`` leaves it the restore point."""
    if snapshot is None:
        return
    if not isinstance(snapshot, int) or isinstance(snapshot, bool) or snapshot < 0:
        raise ConfigError(f"snapshot={snapshot!r} is invalid", "pass a checkpoint's number (store.snapshots())")
    if restore != "checkpoint":
        raise ConfigError(
            f"snapshot={snapshot} with restore={restore!r}", "a snapshot is a restore point: leave restore out"
        )
