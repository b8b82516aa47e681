"""Trace sources: seeded id streams for simulation, benchmarks and the main job.

Synthetic: :func:`zipf_ids`, :func:`drift_ids` (popularity that moves),
:func:`table_batches` (recommendation batches over several tables).  Files:
``.npy`` (:func:`read_npy`), a column of CSV / TSV / text (:func:`read_column`), the
categorical columns of a Criteo TSV (:func:`read_criteo`) and libCacheSim's
``oracleGeneral`` binary format (:func:`read_oracle_general`, :func:`write_oracle_general`).
Every source is seeded or read as is: the same arguments give the same ids.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import ConfigError, TraceFileError


@lru_cache(maxsize=4)
def _zipf_cdf(n_ids: int, alpha: float) -> np.ndarray:
    w = np.arange(1, n_ids + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return cdf


def _scatter_multiplier(n_ids: int) -> int:
    """An odd multiplier coprime with ``n_ids``: rank -> (rank * a + b) mod n is a bijection."""
    a = 2654435761 % n_ids if n_ids > 2 else 1
    while math.gcd(a, n_ids) != 1 or a == 0:
        a += 1
    return a


def zipf_ids(n_ids: int, alpha: float, size: int, seed: int, scatter: bool = True) -> np.ndarray:
    """``size`` ids in ``[0, n_ids)`` with P(rank r) proportional to r**-alpha (exact, finite support).

    Parameters
    ----------
    n_ids : int, number of distinct ids
    alpha : float, skew (> 0; 1.05 is typical of recommendation features)
    size : int
    seed : int, the only source of randomness
    scatter : bool, map ranks to ids by a fixed bijection so hot ids are not 0, 1, 2...

    Returns
    -------
    int64 array (size,)

    Examples
    --------
    >>> ids = zipf_ids(1000, 1.05, 10_000, seed=0)
    >>> ids.dtype, int(ids.min()) >= 0, int(ids.max()) < 1000
    (dtype('int64'), True, True)
    """
    rng = np.random.default_rng(seed)
    cdf = _zipf_cdf(int(n_ids), float(alpha))
    ranks = np.searchsorted(cdf, rng.random(size), side="right").astype(np.int64)
    np.minimum(ranks, n_ids - 1, out=ranks)
    if scatter:
        a = _scatter_multiplier(n_ids)
        ranks = (ranks * a + 12345) % n_ids
    return ranks


def drift_ids(n_ids: int, alpha: float, size: int, seed: int, period: int = 1_000_000,
              shift: int | None = None) -> np.ndarray:
    """Zipf ids whose popularity drifts: every ``period`` requests the ranking moves.

    Request ``i`` draws a rank as :func:`zipf_ids` does, then maps it to an id with an
    offset of ``(i // period) * shift``: the hot set slides through the id space, so a
    policy that keeps stale counts (LFU) pays for it.

    Parameters
    ----------
    n_ids, alpha, size, seed : as :func:`zipf_ids`
    period : int, requests between two moves (> 0)
    shift : int, ids the ranking moves by at each step (default ``max(1, n_ids // 100)``)

    Returns
    -------
    int64 array (size,)

    Examples
    --------
    >>> ids = drift_ids(1000, 1.0, 5000, seed=0, period=1000)
    >>> ids.shape, int(ids.max()) < 1000
    ((5000,), True)
    """
    if period <= 0:
        raise ConfigError(f"period must be > 0, got {period}", "give the requests between two moves")
    shift = max(1, n_ids // 100) if shift is None else int(shift)
    ids = zipf_ids(n_ids, alpha, size, seed)
    epoch = np.arange(size, dtype=np.int64) // period
    return (ids + epoch * shift) % n_ids


def table_batches(n_ids: list[int], alphas: list[float], batch_size: int, pooling: list[int],
                  n_batches: int, seed: int, table_bits: int = 40) -> np.ndarray:
    """Requests of recommendation-shaped batches over several tables, one table after another.

    Each batch holds, for every table ``t``, ``batch_size * pooling[t]`` Zipf ids drawn from
    ``n_ids[t]`` ids with skew ``alphas[t]``; ids of table ``t`` are tagged
    ``(t << table_bits) | id`` so tables never share a cache entry.  The stream is batch 0
    (table 0, table 1, ...), batch 1, ...

    Returns
    -------
    int64 array (n_batches * batch_size * sum(pooling),)

    Examples
    --------
    >>> tr = table_batches([100, 1000], [1.2, 0.8], batch_size=4, pooling=[1, 2], n_batches=3, seed=0)
    >>> tr.shape, sorted(set((tr >> 40).tolist()))
    ((36,), [0, 1])
    """
    if not (len(n_ids) == len(alphas) == len(pooling)) or len(n_ids) == 0:
        raise ConfigError(f"n_ids, alphas and pooling must have one entry per table, got "
                          f"{len(n_ids)}, {len(alphas)}, {len(pooling)}", "give the same number of each")
    parts = []
    for t, (n, a, pf) in enumerate(zip(n_ids, alphas, pooling)):
        per_batch = batch_size * pf
        ids = zipf_ids(n, a, n_batches * per_batch, seed=seed * 1_000_003 + t)
        parts.append(ids.reshape(n_batches, per_batch) | (np.int64(t) << table_bits))
    return np.ascontiguousarray(np.concatenate(parts, axis=1).ravel())


# ---------------------------------------------------------------------------- files
def read_npy(path) -> np.ndarray:
    """A ``.npy`` file of integer ids as int64 (n,)."""
    path = Path(path)
    if not path.is_file():
        raise TraceFileError(f"trace file {str(path)!r} does not exist", "check the path")
    arr = np.load(path, allow_pickle=False)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TraceFileError(f"{str(path)!r} holds {arr.dtype} of shape {arr.shape}",
                             "save a 1-d integer array (np.save(path, ids.astype(np.int64)))")
    return arr.astype(np.int64, copy=False)


def write_npy(path, ids: np.ndarray) -> None:
    """Write ids (int64 (n,)) as ``.npy``."""
    np.save(Path(path), np.ascontiguousarray(ids, dtype=np.int64), allow_pickle=False)


def _open_text(path: Path):
    if not path.is_file():
        raise TraceFileError(f"trace file {str(path)!r} does not exist", "check the path")
    return open(path, encoding="utf-8", newline="")


def read_column(path, column: int = 0, delimiter: str | None = None, header: bool = False,
                base: int = 10) -> np.ndarray:
    """One column of a CSV / TSV / whitespace-separated file as int64 ids, in row order.

    Parameters
    ----------
    path : file
    column : int, 0-based column index
    delimiter : str or None, ``None`` guesses from the suffix (``.csv`` ``,``, ``.tsv``
        tab, otherwise any whitespace)
    header : bool, skip the first line
    base : int, 10 for decimal ids, 16 for hexadecimal

    Rows whose field is empty are skipped.

    Returns
    -------
    int64 array (n,)
    """
    path = Path(path)
    if delimiter is None:
        delimiter = {".csv": ",", ".tsv": "\t"}.get(path.suffix.lower())
    out = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if header and lineno == 1:
                continue
            line = line.rstrip("\r\n")
            if not line:
                continue
            fields = line.split(delimiter)
            if column >= len(fields):
                raise TraceFileError(f"{str(path)!r} line {lineno} has {len(fields)} fields, no column {column}",
                                     "give a 0-based column index that every row has")
            field = fields[column].strip()
            if not field:
                continue
            try:
                out.append(int(field, base))
            except ValueError as err:
                raise TraceFileError(f"{str(path)!r} line {lineno} column {column}: {field!r} is not an id",
                                     "pick a column of integer ids (base=16 for hex)") from err
    return np.array(out, dtype=np.int64)


CRITEO_CATEGORICAL = range(14, 40)


def read_criteo(path, columns=CRITEO_CATEGORICAL) -> np.ndarray:
    """The categorical columns of a Criteo-format TSV as one request stream.

    Criteo's display-advertising logs have 40 tab-separated fields: label, I1-I13, then
    C1-C26 as 8-hex-digit hashes (possibly empty).  Each non-empty categorical value is
    one request, row by row and, within a row, column by column; the id is
    ``(column << 32) | value`` so that equal hashes of different features stay apart.

    Returns
    -------
    int64 array (n,)
    """
    path = Path(path)
    cols = list(columns)
    out = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) < max(cols) + 1:
                if not line.strip():
                    continue
                raise TraceFileError(f"{str(path)!r} line {lineno} has {len(fields)} fields",
                                     "Criteo rows have 40 tab-separated fields")
            for c in cols:
                v = fields[c]
                if v:
                    try:
                        out.append((c << 32) | int(v, 16))
                    except ValueError as err:
                        raise TraceFileError(f"{str(path)!r} line {lineno} field {c}: {v!r} is not hex",
                                             "categorical fields must be hexadecimal hashes") from err
    return np.array(out, dtype=np.int64)


# libCacheSim's oracleGeneral: packed little-endian records of 24 bytes.
ORACLE_GENERAL_DTYPE = np.dtype([("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"),
                                 ("next_access_vtime", "<i8")])


def write_oracle_general(path, ids: np.ndarray, clock_time: np.ndarray | None = None,
                         obj_size: int = 1) -> None:
    """Write ids (int64 (n,), >= 0) as a libCacheSim ``oracleGeneral`` binary trace.

    Each record is ``uint32 clock_time, uint64 obj_id, uint32 obj_size, int64
    next_access_vtime``; ``next_access_vtime`` is the index of the id's next request, -1
    when there is none (what libCacheSim's Belady reads).  ``clock_time`` defaults to the
    request index.
    """
    from .policies import next_use_of

    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size and int(ids.min()) < 0:
        raise TraceFileError(f"ids must be >= 0 for oracleGeneral, got min {int(ids.min())}",
                             "offset the ids so that they are non-negative")
    n = ids.shape[0]
    rec = np.empty(n, dtype=ORACLE_GENERAL_DTYPE)
    rec["clock_time"] = np.arange(n, dtype=np.uint32) if clock_time is None else clock_time
    rec["obj_id"] = ids
    rec["obj_size"] = obj_size
    nxt = next_use_of(ids)
    nxt[nxt == n] = -1
    rec["next_access_vtime"] = nxt
    rec.tofile(Path(path))


def read_oracle_general(path, with_next_access: bool = False):
    """Ids (int64 (n,)) of a libCacheSim ``oracleGeneral`` trace (uncompressed).

    With ``with_next_access``, also the int64 (n,) ``next_access_vtime`` field as stored
    (-1 or ``INT64_MAX`` for none).
    """
    path = Path(path)
    if not path.is_file():
        raise TraceFileError(f"trace file {str(path)!r} does not exist", "check the path")
    size = path.stat().st_size
    if size % ORACLE_GENERAL_DTYPE.itemsize:
        raise TraceFileError(f"{str(path)!r} has {size} bytes, not a multiple of 24",
                             "oracleGeneral records are 24 bytes; decompress .zst files first")
    rec = np.fromfile(path, dtype=ORACLE_GENERAL_DTYPE)
    ids = rec["obj_id"].astype(np.int64)
    if with_next_access:
        return ids, rec["next_access_vtime"].astype(np.int64)
    return ids
