"""Row precision: the bytes a table's weights take in every tier, and the rounding into them.

A record is 32-bit words: the weights packed in the table's ``dtype``, then the optimizer
state (float32, as :mod:`tiered_emb.optimizers` lays it out).  The tiers move words and
never look inside; the step decodes the rows it reads into float32, and encodes the rows
it writes back:

==========  ==========================  =============================================
dtype       weight words                layout
==========  ==========================  =============================================
float32     ``dim``                     the floats
float16     ``ceil(dim / 2)``           IEEE binary16, two a word, the low half first;
                                        an odd dim's last half-word is zero
bfloat16    ``ceil(dim / 2)``           the top 16 bits of a float32, as float16
int8        ``2 + ceil(dim / 4)``       scale (float32), bias (float32), then one
                                        uint8 code a column, value = code * scale + bias
                                        (FBGEMM's fused 8-bit rows), zero padded
==========  ==========================  =============================================

The int8 row starts with its scale, never a NaN, so a row's first word is never a
deleted row's mark (:data:`tiered_emb.tiers.ssd.codec.TOMBSTONE_WORD`).

Rounding.  First values, ``write()`` and imported rows round to nearest (16-bit floats:
ties to even, IEEE's overflow to infinity; int8: ties up, scale ``(max - min) / 255``).
An optimizer update rounds stochastically: the value goes to the upper of its two
neighbours with probability its distance from the lower over their gap, from 32 random
bits that are a pure function of (seed, table, id, column, step, the update's number in
the step): the same bytes on any tier sizes, thread count, prefetch depth or after a
resume.  The rounding is unbiased to 2**-32 of a gap; a 16-bit value beyond the largest
finite one saturates there rather than becoming infinite.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from tiered_emb._jit import kernel, local_f32
from tiered_emb.config import DTYPES, TableConfig, weight_words
from tiered_emb.errors import ConfigError

#: names the command line and TorchRec's ``DataType`` give for each dtype
ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "int8": "int8",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
}


# The unit a 16-bit float rounds to, in three numbers: the smallest normal exponent, the
# mantissa bits, the exponent bias; and the largest finite value.
F16 = (-14, 10, 15, 65504.0)
BF16 = (-126, 7, 127, 3.3895313892515355e38)


def _lut16(dtype: str) -> np.ndarray:
    """The float32 value of every 16-bit pattern; a NaN quiet, as the CPU's conversion makes it."""
    h = np.arange(65536, dtype=np.uint32)
    if dtype == "bfloat16":
        v = h << np.uint32(16)
    else:
        v = h.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    nan = (v & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    nan &= (v & np.uint32(0x007FFFFF)) != 0
    return (v | np.where(nan, np.uint32(0x00400000), np.uint32(0))).view(np.float32)


#: dtype -> float32 (65536,): the value of each 16-bit pattern (a decode is a lookup)
LUT = {"float16": _lut16("float16"), "bfloat16": _lut16("bfloat16")}


def canonical(dtype: str, where: str = "dtype") -> str:
    """The dtype's name in :data:`DTYPES` for any of :data:`ALIASES`; ConfigError otherwise."""
    name = ALIASES.get(dtype) if isinstance(dtype, str) else None
    if name is None:
        raise ConfigError(f"{where}={dtype!r} is not a row precision", f"use one of {', '.join(DTYPES)}")
    return name


def is_lossless(src: str, dst: str) -> bool:
    """True when every value of ``src`` is one of ``dst`` (a conversion loses nothing)."""
    return src == dst or (dst == "float32" and src in ("float16", "bfloat16"))


# --------------------------------------------------------------------------- kernels
@numba.njit(inline="always")
def _splitmix64(x):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(inline="always")
def row_key(key, id_):
    """The key of one row's random bits: (key, id)."""
    return _splitmix64(key ^ _splitmix64(np.uint64(id_)))


@numba.njit(inline="always")
def pair_bits(row, pair):
    """64 random bits of (a row's key, a pair of columns): the high half for column
    ``2 * pair``, the low half for the next (one hash serves two values)."""
    return _splitmix64(row + np.uint64(pair + 1) * np.uint64(0x9E3779B97F4A7C15))


@numba.njit(inline="always")
def row_bits(bits, row, col0, n):
    """The random bits of columns ``col0 .. col0 + n - 1`` of a row (its key ``row``) into
    ``bits`` (uint32, at least n + 2), one :func:`pair_bits` a pair of columns, the pairs
    counted from an even column; returns the offset of column ``col0``'s bits (0 or 1).  A
    loop the compiler vectorizes, where :func:`column_bits` hashes once a column."""
    odd = col0 & 1
    for p in range((n + odd + 1) >> 1):
        x = pair_bits(row, (col0 >> 1) + p)
        bits[2 * p] = np.uint32(x >> np.uint64(32))
        bits[2 * p + 1] = np.uint32(x & np.uint64(0xFFFFFFFF))
    return odd


@numba.njit(inline="always")
def column_bits(row, col):
    """32 random bits of (a row's key, column): its half of :func:`pair_bits`."""
    x = pair_bits(row, col >> 1)
    if col & 1:
        return np.uint32(x & np.uint64(0xFFFFFFFF))
    return np.uint32(x >> np.uint64(32))


@numba.njit(inline="always")
def rounds_up(frac, r):
    """Whether a value ``frac`` (in [0, 1)) of the gap above its lower neighbour rounds up,
    given 32 random bits ``r``: when ``r + frac * 2**32`` carries past 2**32, which is what
    adding ``r``'s top bits below a float's kept bits and truncating does."""
    return np.float64(r) >= (1.0 - frac) * 4294967296.0


@numba.njit(inline="always")
def round16(x, r, stochastic, emin, mbits, ebias, fmax):
    """The 16-bit pattern of float32 ``x`` rounded to the format (emin, mbits, ebias, fmax)."""
    xf = np.float64(x)
    inf_bits = (2 * ebias + 1) << mbits
    if np.isnan(xf):
        return np.uint16(inf_bits | (1 << (mbits - 1)))
    sign = 0x8000 if math.copysign(1.0, xf) < 0.0 else 0
    a = abs(xf)
    if a == 0.0:
        return np.uint16(sign)
    if np.isinf(a):
        return np.uint16(sign | inf_bits)
    e = math.frexp(a)[1]  # a in [2**(e-1), 2**e)
    ex = max(e - 1, emin)
    ulp = math.ldexp(1.0, ex - mbits)
    q = a / ulp
    fl = math.floor(q)
    frac = q - fl
    if stochastic:
        up = rounds_up(frac, r)
    else:
        up = frac > 0.5 or (frac == 0.5 and int(fl) % 2 == 1)
    v = (fl + (1.0 if up else 0.0)) * ulp
    if v > fmax:
        if stochastic:  # saturate: an update never makes a row infinite
            return np.uint16(sign | (inf_bits - 1))
        return np.uint16(sign | inf_bits)
    if v < math.ldexp(1.0, emin):
        return np.uint16(sign | int(v / math.ldexp(1.0, emin - mbits)))
    m, e2 = math.frexp(v)
    return np.uint16(sign | ((e2 - 1 + ebias) << mbits) | int((2.0 * m - 1.0) * (1 << mbits)))


@numba.njit(inline="always")
def nearest16(b, bf16):
    """:func:`round16`'s pattern, rounded to nearest, of the float32 bits ``b`` where they
    decide alone (bfloat16: every finite value; float16: its normal range, 2**-14 <= |x| <
    2**16); 0x10000 elsewhere."""
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    a = b & np.uint32(0x7FFFFFFF)
    e = a >> np.uint32(23)
    if bf16:
        if e == 255:
            return np.uint32(0x10000)
        return sign | ((a + np.uint32(0x7FFF) + ((a >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    if e < 113 or e > 142:
        return np.uint32(0x10000)
    h = ((e - np.uint32(112)) << np.uint32(10)) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
    low = a & np.uint32(0x1FFF)
    if low > 0x1000 or (low == 0x1000 and (h & np.uint32(1))):
        h += np.uint32(1)
    return sign | h


@numba.njit(inline="always")
def sr16_slow(b, bf16):
    """Whether :func:`sr16` leaves the float32 bits ``b`` to :func:`round16`: a NaN or an
    infinity, and for float16 a value other than zero below 2**-54 (a uint32, 0 or 1)."""
    a = b & np.uint32(0x7FFFFFFF)
    if bf16:
        return np.uint32(a >= np.uint32(0x7F800000))
    return np.uint32(a >= np.uint32(0x7F800000)) | (np.uint32(a != 0) & np.uint32(a < np.uint32(73 << 23)))


@numba.njit(inline="always")
def sr16(b, r, bf16):
    """:func:`round16`'s stochastic 16-bit pattern of the float32 bits ``b`` with the random
    bits ``r``, exact wherever :func:`sr16_slow` is 0, in operations without a branch (a
    loop of them vectorizes).  Adding ``r``'s top bits below the kept ones and truncating
    rounds up exactly when :func:`rounds_up` does; float16's subnormals are the value in
    units of 2**-24 as a 32.32 fixed-point number to which ``r`` is added (the float64
    arithmetic is exact down to 2**-54); above float16's range, its largest finite."""
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    a = b & np.uint32(0x7FFFFFFF)
    if bf16:
        return sign | min((a + (r >> np.uint32(16))) >> np.uint32(16), np.uint32(0x7F7F))
    e = a >> np.uint32(23)
    t = a + (r >> np.uint32(19))
    normal = ((t >> np.uint32(23)) - np.uint32(112)) << np.uint32(10) | ((t >> np.uint32(13)) & np.uint32(0x3FF))
    normal = min(normal, np.uint32(0x7BFF))
    m = np.uint64((a & np.uint32(0x7FFFFF)) | np.uint32(0x800000))
    shift = np.uint64(min(max(np.int64(126) - np.int64(e), np.int64(0)), np.int64(63)))
    sub = np.uint32((((m << np.uint64(32)) >> shift) + np.uint64(r)) >> np.uint64(32))
    h = normal if e >= np.uint32(113) else sub
    h = np.uint32(0x7BFF) if e > np.uint32(142) else h
    h = np.uint32(0) if a == np.uint32(0) else h
    return sign | h


@kernel(parallel=True)
def _encode16(vals, bits, out16, slots, ids, key, col0, stochastic, bf16, generic):
    """``out16[slots[i], :]`` = the 16-bit patterns of ``vals[i]`` (float32 (k, dim), ``bits``
    its uint32 view); ``slots`` of length 0: row i itself.  ``generic`` takes
    :func:`round16` for every value (what the tests check the fast path against)."""
    dim = vals.shape[1]
    for i in numba.prange(vals.shape[0]):
        s = slots[i] if slots.shape[0] else np.int64(i)
        row = row_key(key, ids[i])
        for j in range(dim):
            r = column_bits(row, col0 + j) if stochastic else np.uint32(0)
            if generic:
                h = np.uint32(0x10000)
            elif stochastic:
                h = np.uint32(0x10000) if sr16_slow(bits[i, j], bf16) else sr16(bits[i, j], r, bf16)
            else:
                h = nearest16(bits[i, j], bf16)
            if h != 0x10000:
                out16[s, j] = np.uint16(h)
            elif bf16:
                out16[s, j] = round16(vals[i, j], r, stochastic, BF16[0], BF16[1], BF16[2], BF16[3])
            else:
                out16[s, j] = round16(vals[i, j], r, stochastic, F16[0], F16[1], F16[2], F16[3])
        for j in range(dim, 2 * ((dim + 1) // 2)):
            out16[s, j] = 0


@kernel(parallel=True)
def _decode16(in16, slots, lut, out):
    """``out[i] = lut[in16[slots[i], :dim]]`` (``slots`` length 0: row i itself)."""
    dim = out.shape[1]
    for i in numba.prange(out.shape[0]):
        s = slots[i] if slots.shape[0] else np.int64(i)
        for j in range(dim):
            out[i, j] = lut[in16[s, j]]


@numba.njit(inline="always")
def row_range(vals):
    """``(min, max)`` of ``vals`` (float32 (n,)) as the loop over them in order gives them
    (``lo = min(lo, v)``, ``hi = max(hi, v)``: a NaN is passed over unless it comes first,
    and of equal values the first is kept): sixteen running pairs side by side, which the
    compiler vectorizes, where one pair is a chain of dependent compares.  The pairs give
    the loop's answer but where it picks between a zero and a negative zero (the order
    decides) or where a NaN begins a lane (which then passes over the lane's values, the
    loop only that NaN): such a range is taken again in order."""
    n = vals.shape[0]
    lo = vals[0]
    hi = vals[0]
    if n >= 32:
        los = local_f32(16)
        his = local_f32(16)
        for lane in range(16):
            los[lane] = vals[lane]
            his[lane] = vals[lane]
        whole = n - n % 16
        for b in range(16, whole, 16):
            for lane in range(16):
                v = vals[b + lane]
                los[lane] = min(los[lane], v)
                his[lane] = max(his[lane], v)
        lo = los[0]
        hi = his[0]
        poisoned = False  # (a lane begun by a NaN kept it, and passed its other values over)
        for lane in range(1, 16):
            poisoned |= los[lane] != los[lane]
            lo = min(lo, los[lane])
            hi = max(hi, his[lane])
        for j in range(whole, n):
            lo = min(lo, vals[j])
            hi = max(hi, vals[j])
        if lo != 0.0 and hi != 0.0 and not poisoned:
            return lo, hi
        lo = vals[0]
        hi = vals[0]
    for j in range(1, n):
        lo = min(lo, vals[j])
        hi = max(hi, vals[j])
    return lo, hi


@kernel(parallel=True)
def _encode8(vals, out32, out8, slots, ids, key, col0, stochastic):
    """Quantize each row of ``vals`` (float32 (k, dim)) into ``slots``' records: scale and
    bias (words 0 and 1), then a uint8 code a column from byte 8."""
    dim = vals.shape[1]
    for i in numba.prange(vals.shape[0]):
        s = slots[i] if slots.shape[0] else np.int64(i)
        lo, hi = row_range(vals[i])
        scale = np.float32((hi - lo) / np.float32(255.0))
        if not scale > 0.0:  # (a constant row: every code 0, the value its bias)
            scale = np.float32(1.0)
        out32[s, 0] = scale
        out32[s, 1] = lo
        row = row_key(key, ids[i])
        for j in range(dim):
            t = (np.float64(vals[i, j]) - np.float64(lo)) / np.float64(scale)
            fl = math.floor(t)
            frac = t - fl
            if stochastic:
                up = rounds_up(frac, column_bits(row, col0 + j))
            else:
                up = frac >= 0.5
            q = fl + (1.0 if up else 0.0)
            out8[s, 8 + j] = np.uint8(min(max(q, 0.0), 255.0))
        for j in range(8 + dim, 8 + 4 * ((dim + 3) // 4)):
            out8[s, j] = 0


@kernel(parallel=True)
def _decode8(in32, in8, slots, out):
    dim = out.shape[1]
    for i in numba.prange(out.shape[0]):
        s = slots[i] if slots.shape[0] else np.int64(i)
        scale = in32[s, 0]
        bias = in32[s, 1]
        for j in range(dim):
            out[i, j] = np.float32(in8[s, 8 + j]) * scale + bias


_ALL = np.empty(0, dtype=np.int64)


def decode(dtype: str, words: np.ndarray, slots: np.ndarray | None, dim: int) -> np.ndarray:
    """The float32 weights (k, dim) of records ``words`` (float32 words (n, W)), at ``slots``
    (None: every row).  Exact: every value of a dtype is a float32."""
    at = _ALL if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
    k = words.shape[0] if slots is None else at.shape[0]
    if dtype == "float32":
        return np.ascontiguousarray(words[:, :dim] if slots is None else words[at, :dim])
    out = np.empty((k, dim), dtype=np.float32)
    if dtype == "int8":
        _decode8(words, words.view(np.uint8), at, out)
    else:
        _decode16(words.view(np.uint16), at, LUT[dtype], out)
    return out


def encode(
    dtype: str,
    values: np.ndarray,
    words: np.ndarray,
    slots: np.ndarray | None = None,
    ids: np.ndarray | None = None,
    key: int | None = None,
    generic: bool = False,
    col0: int = 0,
) -> None:
    """Write ``values`` (float32 (k, dim)) as the weights of records ``words`` (float32 words
    (n, W)) at ``slots`` (None: rows 0..k-1): to nearest, or with ``key``
    (:func:`rounding_key`) stochastically from the bits of (key, ``ids[i]``, column).
    ``generic`` rounds every value by the arithmetic path (the same bits; for tests).
    ``col0``: the column the first value is in the keyed row (a column-wise shard's first)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    dim = values.shape[1]
    if dtype == "float32":
        if slots is None:
            words[: values.shape[0], :dim] = values
        else:
            words[slots, :dim] = values
        return
    at = _ALL if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
    stochastic = key is not None
    id_arr = np.ascontiguousarray(ids, dtype=np.int64) if stochastic else np.zeros(values.shape[0], np.int64)
    k = np.uint64(key if stochastic else 0)
    if dtype == "int8":
        _encode8(values, words, words.view(np.uint8), at, id_arr, k, col0, stochastic)
    else:
        bits = values.view(np.uint32)
        _encode16(values, bits, words.view(np.uint16), at, id_arr, k, col0, stochastic, dtype == "bfloat16", generic)


def rounding_key(seed: int, table_hash: int, step: int, update: int) -> int:
    """The key of an update's random bits: (seed, table, step, the update's number in the step)."""
    m = (1 << 64) - 1
    h = _mix((seed ^ 0x5EED5EED0D15EA5E) & m)
    h = _mix(h ^ (table_hash & m))
    h = _mix(h ^ (step & m))
    return _mix(h ^ (update & m))


def _mix(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def state_key(key: int, array: int) -> int:
    """The key of the rounding bits of a narrow state's ``array``-th array (0: Adagrad's sum
    or Adam's ``m``, 1: Adam's ``v``) in the update of rounding ``key``: its own bits, apart
    from the weights'."""
    return _mix(key ^ (array + 1))


def values_of(cfg: TableConfig, records: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
    """Records (float32 words (n, record_width)) at ``slots`` (None: all) read as float32
    values (k, value_width): the weights and the state arrays decoded, a row's single
    words (row-wise Adagrad's, Adam's step, the expiry step) as they are."""
    if not cfg.packed:
        return np.ascontiguousarray(records if slots is None else records[slots], dtype=np.float32)
    rows = records if slots is None else records[slots]
    out = np.empty((rows.shape[0], cfg.value_width), dtype=np.float32)
    dim, per = cfg.dim, weight_words(cfg.state_dtype, cfg.dim)
    out[:, :dim] = decode(cfg.dtype, rows, None, dim)
    at = cfg.weight_words
    for a in range(cfg.state_arrays):
        out[:, dim * (1 + a) : dim * (2 + a)] = decode(cfg.state_dtype, rows[:, at : at + per], None, dim)
        at += per
    out.view(np.uint32)[:, dim * (1 + cfg.state_arrays) :] = rows[:, at : cfg.record_width].view(np.uint32)
    return out


def records_of(
    cfg: TableConfig, values: np.ndarray, ids: np.ndarray | None = None, key: int | None = None, col0: int = 0
) -> np.ndarray:
    """Float32 values (k, value_width) as records (float32 words (k, record_width)): the
    weights and the state arrays rounded as :func:`encode` does (each array from bits of its
    own key), a row's single words as they are.  ``col0`` as :func:`encode`'s."""
    if not cfg.packed:
        return np.ascontiguousarray(values, dtype=np.float32)
    out = np.zeros((values.shape[0], cfg.record_width), dtype=np.float32)
    dim, per = cfg.dim, weight_words(cfg.state_dtype, cfg.dim)
    encode(cfg.dtype, values[:, :dim], out, None, ids, key, col0=col0)
    at = cfg.weight_words
    for a in range(cfg.state_arrays):
        words = np.zeros((values.shape[0], per), dtype=np.float32)
        skey = None if key is None else state_key(key, a)
        encode(cfg.state_dtype, values[:, dim * (1 + a) : dim * (2 + a)], words, None, ids, skey, col0=col0)
        out[:, at : at + per] = words
        at += per
    tail = np.ascontiguousarray(values[:, dim * (1 + cfg.state_arrays) :])
    out.view(np.uint32)[:, at:] = tail.view(np.uint32)
    return out


__all__ = [
    "ALIASES",
    "DTYPES",
    "canonical",
    "decode",
    "encode",
    "is_lossless",
    "records_of",
    "rounding_key",
    "state_key",
    "values_of",
]
