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
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tiered_emb._args import as_ids, finite_arg, int_arg
from tiered_emb._jit import kernel
from tiered_emb.errors import ConfigError, IdRangeError, TraceFileError

#: Up to this many ids a Zipf draw searches the distribution's table (12 bytes an id with
#: its guide, 48 MiB here); above, it draws by rejection-inversion (:func:`zipf_ranks_rejection`) in memory
#: that does not grow with the id space.
CDF_MAX_IDS = 1 << 22
#: The most ids a Zipf draw takes: rejection-inversion's ranks are float64, exact up to 2**53.
MAX_IDS = 1 << 53
#: Draws of a rejection-inversion pass: its scratch memory (a few arrays of this many
#: floats).  Fixed, so a shorter trace is the start of a longer one with the same seed.
_REJECTION_CHUNK = 1 << 16


#: Bytes of distribution tables kept between draws (the least recently used dropped past
#: it): the tables of a job's 26 features of up to 300,000 ids each stay.
CDF_CACHE_BYTES = 96 << 20
_CDFS: OrderedDict[tuple[int, float], tuple[np.ndarray, np.ndarray]] = OrderedDict()
_CDFS_LOCK = threading.Lock()


def _zipf_cdf(n_ids: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """The distribution's table of ``n_ids`` ids and its guide (:func:`_search_cdf`), kept
    while the tables kept fit in :data:`CDF_CACHE_BYTES`."""
    key = (n_ids, alpha)
    with _CDFS_LOCK:
        kept = _CDFS.get(key)
        if kept is not None:
            _CDFS.move_to_end(key)
            return kept
    w = np.arange(1, n_ids + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    guide = np.empty(n_ids, dtype=np.int32)  # (n_ids <= CDF_MAX_IDS)
    _guide_cdf(cdf, guide)
    with _CDFS_LOCK:
        _CDFS[key] = (cdf, guide)
        while sum(c.nbytes + g.nbytes for c, g in _CDFS.values()) > CDF_CACHE_BYTES and len(_CDFS) > 1:
            _CDFS.popitem(last=False)
    return cdf, guide


@kernel
def _guide_cdf(cdf, guide):
    """``guide[k]`` (m entries) = the rank of ``(k - 1) / m``: at or below that of any draw
    ``u`` with ``int(u * m) == k`` (the product rounds, so ``u`` may lie a little under
    ``k / m``).  One walk of ``cdf``."""
    m = guide.shape[0]
    n = cdf.shape[0]
    j = 0
    guide[0] = 0
    for k in range(1, m):
        y = (k - 1) / m
        while j < n and cdf[j] <= y:
            j += 1
        guide[k] = j


@kernel
def _search_cdf(cdf, guide, u, out):
    """``out[i]`` = the first rank whose ``cdf`` exceeds ``u[i]`` (``np.searchsorted(cdf, u,
    side="right")``, the same answer), from the guide's lower bound up: a few entries read
    in order instead of a binary search's cache misses."""
    m = guide.shape[0]
    n = cdf.shape[0]
    for i in range(u.shape[0]):
        x = u[i]
        k = int(x * m)
        j = guide[min(k, m - 1)]
        while j < n and cdf[j] <= x:
            j += 1
        out[i] = j


def _h_integral(x: np.ndarray | float, q: float) -> np.ndarray:
    """The integral of ``t**-alpha`` from 1 to ``x`` (``q = 1 - alpha``): ``(x**q - 1) / q``,
    ``log(x)`` at ``q = 0``, written to stay exact near it."""
    lx = np.log(x)
    t = q * lx
    return np.where(np.abs(t) > 1e-8, np.expm1(t) / np.where(t == 0, 1.0, t), 1.0 + t / 2) * lx


def _h_integral_inverse(y: np.ndarray, q: float) -> np.ndarray:
    t = np.maximum(y * q, -1.0)
    return np.exp(np.where(np.abs(t) > 1e-8, np.log1p(t) / np.where(t == 0, 1.0, t), 1.0 - t / 2) * y)


def zipf_ranks_rejection(n_ids: int, alpha: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` ranks in ``[0, n_ids)`` with P(rank r) proportional to (r + 1)**-alpha, exactly,
    by rejection-inversion (Hoermann and Derflinger, 1996; as Apache Commons RNG's
    ``RejectionInversionZipfSampler``): a draw inverts the integral of ``x**-alpha`` and
    keeps the rank when it falls under the rank's own mass (most do for the skews of
    embedding ids).  Memory: the answer and a few arrays of ``_REJECTION_CHUNK`` draws,
    whatever ``n_ids``.  Deterministic: draws are made and kept in order, a chunk at a
    time, so the first ``m`` of ``size`` ranks are the ranks of ``size = m``."""
    q = 1.0 - alpha
    top = float(_h_integral(1.5, q)) - 1.0  # the integral's value at rank 1's upper edge, less rank 1's mass
    bottom = float(_h_integral(n_ids + 0.5, q))
    # ranks this close below x are accepted without the test (the bound of the method)
    s = 2.0 - float(_h_integral_inverse(np.array(_h_integral(2.5, q) - 2.0**-alpha), q))
    out = np.empty(size, dtype=np.int64)
    done = 0
    while done < size:
        u = bottom + rng.random(_REJECTION_CHUNK) * (top - bottom)
        x = _h_integral_inverse(u, q)
        k = np.clip(np.floor(x + 0.5), 1, n_ids)
        keep = (k - x <= s) | (u >= _h_integral(k + 0.5, q) - k**-alpha)
        got = (k[keep] - 1).astype(np.int64)[: size - done]
        out[done : done + got.shape[0]] = got
        done += got.shape[0]
    return out


def _check_zipf(n_ids, alpha, size, seed) -> tuple[int, float, int, int]:
    n_ids = int_arg("n_ids", n_ids, 1, hint="give at least 1 id (an int)")
    alpha = finite_arg("alpha", alpha, 0.0, hint="give a finite skew >= 0 (1.05 is typical; 0 is uniform)")
    size = int_arg("size", size, 0, hint="give a number of requests >= 0 (an int)")
    seed = int_arg("seed", seed, 0, hint="give a seed >= 0 (an int)")
    return n_ids, alpha, size, seed


def _scatter_multiplier(n_ids: int) -> int:
    """An odd multiplier coprime with ``n_ids``: rank -> (rank * a + b) mod n is a bijection."""
    a = 2654435761 % n_ids if n_ids > 2 else 1
    while math.gcd(a, n_ids) != 1 or a == 0:
        a += 1
    return a


def zipf_ids(n_ids: int, alpha: float, size: int, seed: int, scatter: bool = True) -> np.ndarray:
    """``size`` ids in ``[0, n_ids)`` with P(rank r) proportional to r**-alpha (exact, finite support).

    Up to :data:`CDF_MAX_IDS` ids a draw searches the distribution's table (12 bytes an id);
    above, it draws by rejection-inversion (:func:`zipf_ranks_rejection`, uniform draws at
    ``alpha`` 0), so a trace over 1e9 ids costs the trace alone.

    Parameters
    ----------
    n_ids : int, number of distinct ids (>= 1)
    alpha : float, skew (finite, >= 0; 1.05 is typical of recommendation features, 0 is uniform)
    size : int (>= 0)
    seed : int (>= 0), the only source of randomness
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
    n_ids, alpha, size, seed = _check_zipf(n_ids, alpha, size, seed)
    if n_ids > MAX_IDS:
        raise ConfigError(
            f"n_ids={n_ids:,} is more than a Zipf draw tells apart (its ranks are float64: 2**53 ids)",
            "use at most 2**53 ids",
        )
    rng = np.random.default_rng(seed)
    if alpha == 0:
        ranks = rng.integers(0, n_ids, size, dtype=np.int64) if n_ids > CDF_MAX_IDS else None
    else:
        ranks = zipf_ranks_rejection(n_ids, alpha, size, rng) if n_ids > CDF_MAX_IDS else None
    if ranks is None:
        cdf, guide = _zipf_cdf(n_ids, alpha)
        ranks = np.empty(size, dtype=np.int64)
        _search_cdf(cdf, guide, rng.random(size), ranks)
        np.minimum(ranks, n_ids - 1, out=ranks)
    if scatter:
        a = _scatter_multiplier(n_ids)
        if (n_ids - 1) * a + 12345 < 2**63:
            ranks = (ranks * a + 12345) % n_ids
        else:  # (an id space past ~3.4e9: the products need more than 64 bits)
            ranks = np.array([(int(r) * a + 12345) % n_ids for r in ranks], dtype=np.int64)
    return ranks


def drift_ids(
    n_ids: int, alpha: float, size: int, seed: int, period: int = 1_000_000, shift: int | None = None
) -> np.ndarray:
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
    n_ids, alpha, size, seed = _check_zipf(n_ids, alpha, size, seed)
    period = int_arg("period", period, hint="give the requests between two moves (an int > 0)")
    if period <= 0:
        raise ConfigError(f"period must be > 0, got {period}", "give the requests between two moves")
    if shift is None:
        shift = max(1, n_ids // 100)
    else:
        shift = int_arg("shift", shift, hint="give the ids the ranking moves by (an int)")
    ids = zipf_ids(n_ids, alpha, size, seed)
    epoch = np.arange(size, dtype=np.int64) // period
    return (ids + epoch * shift) % n_ids


def table_batches(
    n_ids: list[int],
    alphas: list[float],
    batch_size: int,
    pooling: list[int],
    n_batches: int,
    seed: int,
    table_bits: int = 40,
) -> np.ndarray:
    """Requests of recommendation-shaped batches over several tables, one table after another.

    Each batch holds, for every table ``t``, ``batch_size * pooling[t]`` Zipf ids drawn from
    ``n_ids[t]`` ids with skew ``alphas[t]``; ids of table ``t`` are tagged
    ``(t << table_bits) | id`` so tables never share a cache entry (each ``n_ids[t]`` must be
    at most ``2 ** table_bits``).  The stream is batch 0 (table 0, table 1, ...), batch 1, ...

    Returns
    -------
    int64 array (n_batches * batch_size * sum(pooling),)

    Examples
    --------
    >>> tr = table_batches([100, 1000], [1.2, 0.8], batch_size=4, pooling=[1, 2], n_batches=3, seed=0)
    >>> tr.shape, sorted(set((tr >> 40).tolist()))
    ((36,), [0, 1])
    """
    n_ids, alphas, pooling = list(n_ids), list(alphas), list(pooling)
    if not (len(n_ids) == len(alphas) == len(pooling)) or len(n_ids) == 0:
        raise ConfigError(
            f"n_ids, alphas and pooling must have one entry per table, got {len(n_ids)}, {len(alphas)}, {len(pooling)}",
            "give the same number of each",
        )
    batch_size = int_arg("batch_size", batch_size, 1, hint="give at least 1 sample per batch (an int)")
    n_batches = int_arg("n_batches", n_batches, 0, hint="give a number of batches >= 0 (an int)")
    seed = int_arg("seed", seed, 0, hint="give a seed >= 0 (an int)")
    table_bits = int_arg("table_bits", table_bits, 1, 62, hint="give table_bits in [1, 62]")
    if len(n_ids) - 1 >= 1 << (63 - table_bits):
        raise ConfigError(
            f"{len(n_ids)} tables do not fit in the {63 - table_bits} bits above table_bits={table_bits}",
            "use a smaller table_bits",
        )
    for t, (n, pf) in enumerate(zip(n_ids, pooling, strict=False)):
        n = int_arg(f"n_ids[{t}]", n, 1, hint="give each table at least 1 id (an int)")
        if n > 1 << table_bits:
            raise ConfigError(
                f"table {t} has {n} ids, more than 2**table_bits = {1 << table_bits}: its ids would "
                f"carry the tags of other tables",
                "use a larger table_bits or fewer ids",
            )
        int_arg(f"pooling[{t}]", pf, 1, hint="give at least 1 id per sample (an int)")
    parts = []
    for t, (n, a, pf) in enumerate(zip(n_ids, alphas, pooling, strict=False)):
        per_batch = batch_size * pf
        ids = zipf_ids(n, a, n_batches * per_batch, seed=seed * 1_000_003 + t)
        parts.append(ids.reshape(n_batches, per_batch) | (np.int64(t) << table_bits))
    return np.ascontiguousarray(np.concatenate(parts, axis=1).ravel())


# ---------------------------------------------------------------------------- files
def read_npy(path) -> np.ndarray:
    """A ``.npy`` file of integer ids (1-d, int64 or narrower, or uint64 below 2**63) as int64 (n,)."""
    path = Path(path)
    if not path.is_file():
        raise TraceFileError(f"trace file {str(path)!r} does not exist", "check the path")
    hint = "save a 1-d integer array (np.save(path, ids.astype(np.int64)))"
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, EOFError, ValueError) as err:  # empty, truncated, not .npy, object arrays
        raise TraceFileError(f"{str(path)!r} is not a readable .npy array ({err})", hint) from None
    if not isinstance(arr, np.ndarray):  # an .npz archive
        arr.close()
        raise TraceFileError(f"{str(path)!r} is an .npz archive, not one .npy array", hint)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TraceFileError(f"{str(path)!r} holds {arr.dtype} of shape {arr.shape}", hint)
    return as_ids(arr, f"{str(path)!r}")


def write_npy(path, ids: np.ndarray) -> None:
    """Write ids (integers (n,); never rounded from floats) as an int64 ``.npy``."""
    ids = as_ids(ids, "ids")
    try:
        np.save(Path(path), ids, allow_pickle=False)
    except OSError as err:
        raise TraceFileError(
            f"cannot write {str(path)!r}: {err.strerror or err}", "check that the directory exists and is writable"
        ) from None


def _open_text(path: Path):
    if not path.is_file():
        raise TraceFileError(f"trace file {str(path)!r} does not exist", "check the path")
    try:
        return open(path, encoding="utf-8", newline="")
    except OSError as err:
        raise TraceFileError(f"cannot read {str(path)!r}: {err.strerror or err}", "check its permissions") from None


def _not_text(path: Path, err: UnicodeDecodeError) -> TraceFileError:
    return TraceFileError(
        f"{str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start} of a chunk)",
        "give a text file of ids (npy:, oracle: read binary traces)",
    )


def _to_int64(path: Path, out: list) -> np.ndarray:
    try:
        return np.array(out, dtype=np.int64)
    except OverflowError:
        k = next(i for i, v in enumerate(out) if not -(2**63) <= v < 2**63)
        raise IdRangeError(
            f"{str(path)!r}: id number {k + 1} ({out[k]}) is beyond int64",
            "relabel the ids, e.g. with np.unique(ids, return_inverse=True)[1]",
        ) from None


def read_column(
    path, column: int = 0, delimiter: str | None = None, header: bool = False, base: int = 10
) -> np.ndarray:
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
    column = int_arg("column", column, 0, hint="give a 0-based column index (an int >= 0)")
    base = int_arg("base", base, 0, 36, hint="give base 10 for decimal ids, 16 for hex (2..36, or 0 for prefixes)")
    if base == 1:
        raise ConfigError("base=1 is invalid", "give base 10 for decimal ids, 16 for hex (2..36, or 0 for prefixes)")
    if delimiter is not None and (not isinstance(delimiter, str) or not delimiter):
        raise ConfigError(f"delimiter={delimiter!r} is invalid", "give a non-empty string, or None for any whitespace")
    if delimiter is None:
        delimiter = {".csv": ",", ".tsv": "\t"}.get(path.suffix.lower())
    out = []
    with _open_text(path) as f:
        try:
            for lineno, line in enumerate(f, 1):
                if header and lineno == 1:
                    continue
                line = line.rstrip("\r\n")
                if not line:
                    continue
                fields = line.split(delimiter)
                if column >= len(fields):
                    raise TraceFileError(
                        f"{str(path)!r} line {lineno} has {len(fields)} fields, no column {column}",
                        "give a 0-based column index that every row has",
                    )
                field = fields[column].strip()
                if not field:
                    continue
                try:
                    out.append(int(field, base))
                except ValueError as err:
                    raise TraceFileError(
                        f"{str(path)!r} line {lineno} column {column}: {field!r} is not an id",
                        "pick a column of integer ids (base=16 for hex)",
                    ) from err
        except UnicodeDecodeError as err:
            raise _not_text(path, err) from None
    return _to_int64(path, out)


CRITEO_CATEGORICAL = range(14, 40)


def read_criteo(path, columns=CRITEO_CATEGORICAL) -> np.ndarray:
    """The categorical columns of a Criteo-format TSV as one request stream.

    Criteo's display-advertising logs have 40 tab-separated fields: label, I1-I13, then
    C1-C26 as 8-hex-digit hashes (possibly empty).  Each non-empty categorical value is
    one request, row by row and, within a row, column by column; the id is
    ``(column << 32) | value`` so that equal hashes of different features stay apart
    (a value that is negative or wider than 32 bits is a :class:`TraceFileError`).

    Returns
    -------
    int64 array (n,)
    """
    path = Path(path)
    try:
        cols = [int_arg("column", c, 0, 2**31 - 1, hint="give 0-based field indexes below 2**31") for c in columns]
    except TypeError:
        raise ConfigError(f"columns={columns!r} is not a list of field indexes", "give e.g. range(14, 40)") from None
    if not cols:
        raise ConfigError("columns is empty", "give the categorical fields to read, e.g. range(14, 40)")
    need = max(cols) + 1
    out = []
    with _open_text(path) as f:
        try:
            for lineno, line in enumerate(f, 1):
                fields = line.rstrip("\r\n").split("\t")
                if len(fields) < need:
                    if not line.strip():
                        continue
                    raise TraceFileError(
                        f"{str(path)!r} line {lineno} has {len(fields)} fields",
                        "Criteo rows have 40 tab-separated fields",
                    )
                for c in cols:
                    v = fields[c]
                    if v:
                        try:
                            x = int(v, 16)
                        except ValueError as err:
                            raise TraceFileError(
                                f"{str(path)!r} line {lineno} field {c}: {v!r} is not hex",
                                "categorical fields must be hexadecimal hashes",
                            ) from err
                        if not 0 <= x <= 0xFFFFFFFF:  # (c << 32) | x would leave feature c
                            raise TraceFileError(
                                f"{str(path)!r} line {lineno} field {c}: {v!r} is not a 32-bit hash",
                                "categorical fields are hashes of at most 8 hex digits",
                            )
                        out.append((c << 32) | x)
        except UnicodeDecodeError as err:
            raise _not_text(path, err) from None
    return np.array(out, dtype=np.int64)


# libCacheSim's oracleGeneral: packed little-endian records of 24 bytes.
ORACLE_GENERAL_DTYPE = np.dtype(
    [("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access_vtime", "<i8")]
)


def write_oracle_general(path, ids: np.ndarray, clock_time: np.ndarray | None = None, obj_size: int = 1) -> None:
    """Write ids (integers (n,), >= 0) as a libCacheSim ``oracleGeneral`` binary trace.

    Each record is ``uint32 clock_time, uint64 obj_id, uint32 obj_size, int64
    next_access_vtime``; ``next_access_vtime`` is the index of the id's next request, -1
    when there is none (what libCacheSim's Belady reads).  ``clock_time`` (integers (n,)
    in uint32's range) defaults to the request index; ``obj_size`` is a uint32.
    """
    from tiered_emb.sim.policies import next_use_of

    ids = as_ids(ids, "ids")
    if ids.size and int(ids.min()) < 0:
        raise IdRangeError(
            f"ids must be >= 0 for oracleGeneral, got min {int(ids.min())}",
            "offset the ids so that they are non-negative",
        )
    n = ids.shape[0]
    obj_size = int_arg("obj_size", obj_size, 0, 2**32 - 1, hint="give an object size in [0, 2**32) (uint32)")
    if clock_time is not None:
        ct = np.asarray(clock_time)
        if ct.shape != (n,) or (n and ct.dtype.kind not in "iu"):
            raise ConfigError(
                f"clock_time has dtype {ct.dtype} and shape {ct.shape}, ids {n}",
                "give one integer time per request, or leave clock_time out",
            )
        if n and (int(ct.min()) < 0 or int(ct.max()) > 2**32 - 1):
            raise ConfigError(f"clock_time holds {int(ct.min())} .. {int(ct.max())}", "times are uint32: [0, 2**32)")
    path = Path(path)
    if not path.parent.is_dir():
        raise TraceFileError(
            f"cannot write {str(path)!r}: {str(path.parent)!r} is not a directory", "create the directory first"
        )
    rec = np.empty(n, dtype=ORACLE_GENERAL_DTYPE)
    rec["clock_time"] = np.arange(n, dtype=np.uint32) if clock_time is None else ct
    rec["obj_id"] = ids
    rec["obj_size"] = obj_size
    nxt = next_use_of(ids)
    nxt[nxt == n] = -1
    rec["next_access_vtime"] = nxt
    try:
        rec.tofile(path)
    except OSError as err:
        raise TraceFileError(
            f"cannot write {str(path)!r}: {err.strerror or err}", "check that the directory exists and is writable"
        ) from None


def read_oracle_general(path, with_next_access: bool = False):
    """Ids (int64 (n,)) of a libCacheSim ``oracleGeneral`` trace (uncompressed).

    ``obj_id`` is a uint64 there; an id of 2**63 or more is an :class:`IdRangeError`
    (never wrapped to a negative id), whose hint shows how to relabel them.

    With ``with_next_access``, also the int64 (n,) ``next_access_vtime`` field as stored
    (-1 or ``INT64_MAX`` for none).
    """
    path = Path(path)
    if not path.is_file():
        raise TraceFileError(f"trace file {str(path)!r} does not exist", "check the path")
    size = path.stat().st_size
    if size % ORACLE_GENERAL_DTYPE.itemsize:
        raise TraceFileError(
            f"{str(path)!r} has {size} bytes, not a multiple of 24",
            "oracleGeneral records are 24 bytes; decompress .zst files first",
        )
    try:
        rec = np.fromfile(path, dtype=ORACLE_GENERAL_DTYPE)
    except OSError as err:
        raise TraceFileError(f"cannot read {str(path)!r}: {err.strerror or err}", "check its permissions") from None
    if rec.shape[0] and int(rec["obj_id"].max()) > 2**63 - 1:
        raise IdRangeError(
            f"{str(path)!r} holds obj_id {int(rec['obj_id'].max())}, beyond int64",
            "relabel the ids: rec = np.fromfile(path, ORACLE_GENERAL_DTYPE); "
            "ids = np.unique(rec['obj_id'], return_inverse=True)[1]",
        )
    ids = rec["obj_id"].astype(np.int64)
    if with_next_access:
        return ids, rec["next_access_vtime"].astype(np.int64)
    return ids
