"""The step's kernels over rows of a narrow dtype (:mod:`tiered_emb.precision`), each fused:
the pooling reads the 16-bit or int8 words where they lie, and every optimizer updates a
row in one pass (decode, step, stochastic rounding; an int8 row quantized again), with no
float32 copy of the rows.

Each gives the bytes of the unfused path (rows decoded to float32, the float32 kernel of
:mod:`tiered_emb.step.update`, then :func:`tiered_emb.precision.encode`): the same float32
operations in the same order, the same random bits (the tests compare them).  A float32
table whose optimizer state alone is narrow takes that path.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from tiered_emb._compiles import made_by
from tiered_emb._jit import (
    HAS_F16C,
    ROW_PREFETCH_DISTANCE,
    f32_bits,
    f32_of_bits,
    f32_of_half,
    kernel,
    local_f32,
    local_u32,
    pow_by_squaring,
    prefetch_hint,
    prefetch_row_hint,
    square_sums4,
)
from tiered_emb.config import weight_words
from tiered_emb.precision import (
    BF16,
    F16,
    LUT,
    round16,
    rounds_up,
    row_bits,
    row_key,
    row_range,
    sr16,
    sr16_slow,
    state_key,
)

# How a kernel reads a 16-bit value (``kind``): the CPU's conversion, a shift, or the table.
_HALF, _BRAIN, _TABLE = 0, 1, 2


def _kind(dtype: str) -> int:
    if dtype == "bfloat16":
        return _BRAIN
    return _HALF if HAS_F16C else _TABLE


@numba.njit(inline="always")
def _dec(h, lut, kind):
    """The float32 value of 16-bit pattern ``h``: ``lut[h]``, by whichever way ``kind`` says."""
    if kind == 0:
        return f32_of_half(h)
    if kind == 1:
        return f32_of_bits(np.uint32(h) << np.uint32(16))
    return lut[h]


@numba.njit(inline="always")
def _prefetch_ahead(words, slots, k):
    """Hint every 64-byte line of record ``slots[k + ROW_PREFETCH_DISTANCE]`` of ``words``
    (the records as any 2-D view).  A narrow row's update (decode, step, a hash a pair of
    columns, rounding) is long enough that the CPU's own look-ahead does not reach the next
    rows' misses, which then cost more than the work (docs/benchmarks.md, "Kernel choices")."""
    if k + ROW_PREFETCH_DISTANCE < slots.shape[0]:
        prefetch_row_hint(words, slots[k + ROW_PREFETCH_DISTANCE])


@numba.njit(inline="always")
def _quad_start(w32, slots, grads, means, mode, u0, k):
    """The start of a quad of rows ``u0 .. u0 + 3`` (of ``k``) in a fused row-wise Adagrad
    kernel: the rows ahead prefetched, and where the quad is whole and its means of the
    squared gradient come from the gradients alone (none given, no L2 decay), those four
    means, formed side by side (:func:`square_sums4`): ``(True, means)``; else ``(False,
    zeros)``, the caller taking them row by row."""
    for u in range(u0, min(u0 + 4, k)):
        _prefetch_ahead(w32, slots, u)
    if not means.shape[0] and mode != 1.0 and u0 + 4 <= k:
        a = square_sums4(grads, u0)
        n = grads.shape[1]
        return True, (np.float32(a[0] / n), np.float32(a[1] / n), np.float32(a[2] / n), np.float32(a[3] / n))
    z = np.float32(0.0)
    return False, (z, z, z, z)


@numba.njit(inline="always")
def _store16(out16, s, new, bits, row, col0, bf16, off=0):
    """``out16[s, :]`` = the float32 values ``new`` (n,) rounded stochastically to 16-bit
    floats (``precision.encode``'s rule, bits of ``row``'s key), in two loops the compiler
    vectorizes: each column's random bits into ``bits`` (uint32, at least n + 2: one hash a
    pair of columns, the pairs counted from an even column), then the bit-level rounding of
    every value (:func:`~tiered_emb.precision.sr16`); the few values that leaves (a NaN, an
    infinity, a float16 below 2**-54) again by the arithmetic path.  ``off``: the 16-bit
    word the values start at (a state array's, after the weights)."""
    n = new.shape[0]
    odd = row_bits(bits, row, col0, n)
    slow = np.uint32(0)
    for j in range(n):
        b = f32_bits(new[j])
        out16[s, off + j] = np.uint16(sr16(b, bits[j + odd], bf16))
        slow |= sr16_slow(b, bf16)
    if slow:
        for j in range(n):
            r = bits[j + odd]
            if not sr16_slow(f32_bits(new[j]), bf16):
                continue
            if bf16:
                out16[s, off + j] = round16(new[j], r, True, BF16[0], BF16[1], BF16[2], BF16[3])
            else:
                out16[s, off + j] = round16(new[j], r, True, F16[0], F16[1], F16[2], F16[3])


def pool_kernel(dim: int, weighted: bool, int8: bool, kind: int = _TABLE):
    """The pooling kernel over narrow records, compiled once per (dim, weighted, int8, kind)."""
    found = _POOL.get((dim, weighted, int8, kind))
    if found is not None:
        return found

    @kernel(parallel=True)
    def _pool(w16, w8, w32, lut, slots, inverse, offsets, weights, mean, out):
        """``out[b] = sum_i w_i * row(slots[inverse[i]])`` over bag b in position order, each
        value decoded as it is read: 16-bit through ``lut``, int8 as code * scale + bias."""
        n = inverse.shape[0]
        words = 2 + (dim + 3) // 4 if int8 else (dim + 1) // 2  # (the row's weights, not its state)
        for b in numba.prange(out.shape[0]):
            acc = local_f32(dim)
            for j in range(dim):
                acc[j] = 0.0
            lo = offsets[b]
            hi = offsets[b + 1]
            for i in range(lo, hi):
                if i + ROW_PREFETCH_DISTANCE < n:  # the row's lines, as the float32 kernel does
                    ahead = slots[inverse[i + ROW_PREFETCH_DISTANCE]]
                    for c in range(0, words, 16):
                        prefetch_hint(w32, (ahead, c))
                r = slots[inverse[i]]
                w = weights[i] if weighted else np.float32(1.0)
                if int8:
                    scale = w32[r, 0]
                    bias = w32[r, 1]
                    src8 = w8[r]
                    for j in range(dim):
                        v = np.float32(src8[8 + j]) * scale + bias
                        if weighted:
                            acc[j] += w * v
                        else:
                            acc[j] += v
                else:
                    src = w16[r]
                    for j in range(dim):
                        if weighted:
                            acc[j] += w * _dec(src[j], lut, kind)
                        else:
                            acc[j] += _dec(src[j], lut, kind)
            if mean and hi > lo:
                inv = np.float32(1.0) / np.float32(hi - lo)
                for j in range(dim):
                    acc[j] *= inv
            for j in range(dim):
                out[b, j] = acc[j]

    _POOL[(dim, weighted, int8, kind)] = made_by(_pool, pool_kernel, dim, weighted, int8, kind)
    return _pool


_POOL: dict = {}
_NO_LUT = np.zeros(1, dtype=np.float32)


def pool(dtype: str, records: np.ndarray, slots, inverse, plan, weights: np.ndarray, out: np.ndarray) -> None:
    """Pool ``plan``'s bags from narrow ``records`` at ``slots`` (one a unique id; ``inverse``
    a position's) into ``out`` (float32 (B, dim)): bitwise pooling the decoded rows."""
    int8 = dtype == "int8"
    pool_k = pool_kernel(out.shape[1], plan.weights is not None, int8, _TABLE if int8 else _kind(dtype))
    lut = _NO_LUT if int8 else LUT[dtype]
    pool_k(
        records.view(np.uint16),
        records.view(np.uint8),
        records,
        lut,
        slots,
        inverse,
        plan.offsets,
        weights,
        plan.mean,
        out,
    )


@numba.njit(inline="always")
def _adagrad_row(vals, st, g_row, params):
    """Adagrad's step of one row: ``vals`` (its float32 weights) and ``st`` (its float32
    state array) in place; the float32 kernel's arithmetic."""
    lr, eps, wd, mode = params[0], params[1], params[2], params[3]
    c = np.float32(1.0) - lr * wd if mode == 2.0 else np.float32(1.0)
    for j in range(vals.shape[0]):
        w = vals[j]
        g = g_row[j] + wd * w if mode == 1.0 else g_row[j]
        acc = st[j] + g * g
        st[j] = acc
        vals[j] = c * w - lr * (g / (np.sqrt(acc) + eps))


@numba.njit(inline="always")
def _adam_row(vals, st, g_row, params):
    """Adam's step of one row: ``vals`` and ``st`` (``m``, ``v``, then the step count, float32)
    in place; the float32 kernel's arithmetic."""
    lr, b1, b2, eps, wd, mode = params[0], params[1], params[2], params[3], params[4], params[5]
    c = np.float32(1.0) - lr * wd if mode == 2.0 else np.float32(1.0)
    one = np.float32(1.0)
    dim = vals.shape[0]
    t = st[2 * dim] + one
    st[2 * dim] = t
    c1 = one - np.float32(pow_by_squaring(np.float64(b1), np.int64(t)))
    c2 = one - np.float32(pow_by_squaring(np.float64(b2), np.int64(t)))
    for j in range(dim):
        w = vals[j]
        g = g_row[j] + wd * w if mode == 1.0 else g_row[j]
        m = b1 * st[j] + (one - b1) * g
        v = b2 * st[dim + j] + (one - b2) * g * g
        st[j] = m
        st[dim + j] = v
        vals[j] = c * w - lr * ((m / c1) / (np.sqrt(v / c2) + eps))


@numba.njit(inline="always")
def _state_step(vals, w16, w32, s, state, skeys, id_, col0, g_row, params, st, bits):
    """Adagrad's or Adam's step of record ``s``, its state laid out as ``state`` =
    ``(sw, per, narrow_state, adam)`` says (:func:`update`): at word ``sw``, float32 words
    stepped where they lie, or (``narrow_state``) bfloat16 arrays of ``per`` words each
    read into ``st``, stepped, and rounded back, each array from the bits of its key in
    ``skeys`` (:func:`tiered_emb.precision.state_key`), Adam's step count as it is."""
    sw, per, narrow_state, adam = state
    dim = vals.shape[0]
    if not narrow_state:
        if adam:
            _adam_row(vals, w32[s, sw:], g_row, params)
        else:
            _adagrad_row(vals, w32[s, sw:], g_row, params)
        return
    arrays = 2 if adam else 1
    for a in range(arrays):
        for j in range(dim):
            st[a * dim + j] = f32_of_bits(np.uint32(w16[s, 2 * (sw + a * per) + j]) << np.uint32(16))
    if adam:
        st[2 * dim] = w32[s, sw + 2 * per]
        _adam_row(vals, st, g_row, params)
        w32[s, sw + 2 * per] = st[2 * dim]
    else:
        _adagrad_row(vals, st, g_row, params)
    for a in range(arrays):
        _store16(w16, s, st[a * dim : (a + 1) * dim], bits, row_key(skeys[a], id_), col0, True, 2 * (sw + a * per))


def update_kernels(dim: int, kind: int):
    """The fused 16-bit updates ``{optimizer: kernel}`` for rows of ``dim`` read the
    ``kind`` way, compiled once per (dim, kind) (a row's new values sit in a stack array of
    that size, as the pooling's sum)."""
    kernels = _UPDATE.get((dim, kind))
    if kernels is not None:
        return kernels
    state_len = 2 * dim + 1  # (Adam's m, v and step count read out of narrow state arrays)
    bits_len = dim + 2  # (a row's random bits: _store16)

    @numba.njit(inline="always")
    def _rowwise16_row(w16, w32, lut, slots, grads, params, col0, sw, bf16, u, mean, rkey):
        """Row ``u``'s step, given its mean of the squared gradient and its rounding key
        (:func:`~tiered_emb.precision.row_key`)."""
        lr, eps, wd, mode = params[0], params[1], params[2], params[3]
        c = np.float32(1.0) - lr * wd if mode == 2.0 else np.float32(1.0)
        s = slots[u]
        src = w16[s]
        st = w32[s, sw] + mean
        w32[s, sw] = st
        step = lr / (np.sqrt(st) + eps)
        new = local_f32(dim)
        for j in range(dim):
            w = _dec(src[j], lut, kind)
            g = grads[u, j] + wd * w if mode == 1.0 else grads[u, j]
            new[j] = c * w - step * g
        _store16(w16, s, new, local_u32(bits_len), rkey, col0, bf16)

    @kernel(parallel=True)
    def _rowwise16(w16, w32, lut, slots, ids, grads, params, key, col0, sw, bf16, means):
        """Row-wise Adagrad on 16-bit rows, rounded stochastically with ``key``'s bits; the
        state at word ``sw``; ``means`` (length 0: formed here) as the float32 kernel's:
        four rows' sums of squares side by side (:func:`square_sums4`), or, under L2 decay
        (whose sum reads the row), row by row."""
        wd, mode = params[2], params[3]
        k = slots.shape[0]
        for q in numba.prange((k + 3) // 4):
            u0 = 4 * q
            fused, quad = _quad_start(w32, slots, grads, means, mode, u0, k)
            if fused:
                for d in range(4):
                    rkey = row_key(key, ids[u0 + d])
                    _rowwise16_row(w16, w32, lut, slots, grads, params, col0, sw, bf16, u0 + d, quad[d], rkey)
                continue
            for u in range(u0, min(u0 + 4, k)):
                if means.shape[0]:
                    mean = means[u]
                else:
                    src = w16[slots[u]]
                    acc = 0.0
                    for j in range(dim):
                        g = grads[u, j] + wd * _dec(src[j], lut, kind) if mode == 1.0 else grads[u, j]
                        acc += np.float64(g) * np.float64(g)
                    mean = np.float32(acc / dim)
                rkey = row_key(key, ids[u])
                _rowwise16_row(w16, w32, lut, slots, grads, params, col0, sw, bf16, u, mean, rkey)

    @kernel(parallel=True)
    def _sgd16(w16, lut, slots, ids, grads, params, key, col0, bf16):
        lr, wd, mode = params[0], params[1], params[2]
        c = np.float32(1.0) - lr * wd if mode == 2.0 else np.float32(1.0)
        for k in numba.prange(slots.shape[0]):
            _prefetch_ahead(w16, slots, k)
            s = slots[k]
            new = local_f32(dim)
            for j in range(dim):
                w = _dec(w16[s, j], lut, kind)
                g = grads[k, j] + wd * w if mode == 1.0 else grads[k, j]
                new[j] = c * w - lr * g
            _store16(w16, s, new, local_u32(bits_len), row_key(key, ids[k]), col0, bf16)

    @kernel(parallel=True)
    def _state16(w16, w32, lut, slots, ids, grads, params, key, skeys, col0, state, bf16):
        """Adagrad or Adam on 16-bit rows, their state laid out as ``state`` says
        (:func:`_state_step`)."""
        for k in numba.prange(slots.shape[0]):
            _prefetch_ahead(w32, slots, k)
            s = slots[k]
            new = local_f32(dim)
            st = local_f32(state_len)
            for j in range(dim):
                new[j] = _dec(w16[s, j], lut, kind)
            bits = local_u32(bits_len)
            _state_step(new, w16, w32, s, state, skeys, ids[k], col0, grads[k], params, st, bits)
            _store16(w16, s, new, bits, row_key(key, ids[k]), col0, bf16)

    kernels = {"rowwise_adagrad": _rowwise16, "sgd": _sgd16, "state": _state16}
    _UPDATE[(dim, kind)] = kernels
    return kernels


_UPDATE: dict = {}


@numba.njit(inline="always")
def _load8(w8, w32, s, vals):
    """``vals`` = the float32 values of int8 record ``s`` (code * scale + bias)."""
    scale = w32[s, 0]
    bias = w32[s, 1]
    for j in range(vals.shape[0]):
        vals[j] = np.float32(w8[s, 8 + j]) * scale + bias


@numba.njit(inline="always")
def _store8(w8, w32, s, vals, bits, row, col0):
    """Record ``s`` = the float32 values ``vals`` quantized to int8 as
    :func:`tiered_emb.precision.encode` does (scale ``(max - min) / 255``, bias the min,
    codes rounded stochastically from ``row``'s bits), its padding zero.  In loops the
    compiler vectorizes, as :func:`_store16`: each column's random bits into ``bits``
    (uint32, at least n + 2), then every code, with no branch."""
    n = vals.shape[0]
    lo, hi = row_range(vals)
    scale = np.float32((hi - lo) / np.float32(255.0))
    if not scale > 0.0:
        scale = np.float32(1.0)
    w32[s, 0] = scale
    w32[s, 1] = lo
    odd = row_bits(bits, row, col0, n)
    lo64, scale64 = np.float64(lo), np.float64(scale)
    for j in range(n):
        t = (np.float64(vals[j]) - lo64) / scale64
        fl = math.floor(t)
        q = fl + (1.0 if rounds_up(t - fl, bits[j + odd]) else 0.0)
        w8[s, 8 + j] = np.uint8(min(max(q, 0.0), 255.0))
    for j in range(8 + n, 8 + 4 * ((n + 3) // 4)):
        w8[s, j] = 0


def update_kernels8(dim: int):
    """The fused int8 updates ``{optimizer: kernel}`` for rows of ``dim``: a row decoded
    into a stack array, stepped, and quantized again in one pass, compiled once per dim."""
    kernels = _UPDATE8.get(dim)
    if kernels is not None:
        return kernels
    state_len = 2 * dim + 1
    bits_len = dim + 2  # (a row's random bits, and a narrow state's: _store8, _store16)

    @numba.njit(inline="always")
    def _rowwise8_row(w8, w32, slots, grads, params, col0, sw, u, vals, mean, rkey):
        """Row ``u``'s step, its values decoded into ``vals``, given its mean of the squared
        gradient and its rounding key (:func:`~tiered_emb.precision.row_key`)."""
        lr, eps, wd, mode = params[0], params[1], params[2], params[3]
        c = np.float32(1.0) - lr * wd if mode == 2.0 else np.float32(1.0)
        s = slots[u]
        st = w32[s, sw] + mean
        w32[s, sw] = st
        step = lr / (np.sqrt(st) + eps)
        for j in range(dim):
            g = grads[u, j] + wd * vals[j] if mode == 1.0 else grads[u, j]
            vals[j] = c * vals[j] - step * g
        _store8(w8, w32, s, vals, local_u32(bits_len), rkey, col0)

    @kernel(parallel=True)
    def _rowwise8(w8, w32, slots, ids, grads, params, key, col0, sw, means):
        """Row-wise Adagrad on int8 rows, as :func:`_rowwise16` (four rows' means side by
        side where they need the gradients alone)."""
        wd, mode = params[2], params[3]
        k = slots.shape[0]
        for q in numba.prange((k + 3) // 4):
            u0 = 4 * q
            fused, quad = _quad_start(w32, slots, grads, means, mode, u0, k)
            if fused:
                for d in range(4):
                    vals = local_f32(dim)
                    _load8(w8, w32, slots[u0 + d], vals)
                    rkey = row_key(key, ids[u0 + d])
                    _rowwise8_row(w8, w32, slots, grads, params, col0, sw, u0 + d, vals, quad[d], rkey)
                continue
            for u in range(u0, min(u0 + 4, k)):
                vals = local_f32(dim)
                _load8(w8, w32, slots[u], vals)
                if means.shape[0]:
                    mean = means[u]
                else:
                    acc = 0.0
                    for j in range(dim):
                        g = grads[u, j] + wd * vals[j] if mode == 1.0 else grads[u, j]
                        acc += np.float64(g) * np.float64(g)
                    mean = np.float32(acc / dim)
                _rowwise8_row(w8, w32, slots, grads, params, col0, sw, u, vals, mean, row_key(key, ids[u]))

    @kernel(parallel=True)
    def _sgd8(w8, w32, slots, ids, grads, params, key, col0):
        lr, wd, mode = params[0], params[1], params[2]
        c = np.float32(1.0) - lr * wd if mode == 2.0 else np.float32(1.0)
        for k in numba.prange(slots.shape[0]):
            _prefetch_ahead(w32, slots, k)
            s = slots[k]
            vals = local_f32(dim)
            _load8(w8, w32, s, vals)
            for j in range(dim):
                g = grads[k, j] + wd * vals[j] if mode == 1.0 else grads[k, j]
                vals[j] = c * vals[j] - lr * g
            _store8(w8, w32, s, vals, local_u32(bits_len), row_key(key, ids[k]), col0)

    @kernel(parallel=True)
    def _state8(w8, w32, slots, ids, grads, params, key, skeys, col0, state):
        """Adagrad or Adam on int8 rows, their state laid out as ``state`` says
        (:func:`_state_step`)."""
        w16 = w32.view(np.uint16)
        for k in numba.prange(slots.shape[0]):
            _prefetch_ahead(w32, slots, k)
            s = slots[k]
            vals = local_f32(dim)
            st = local_f32(state_len)
            _load8(w8, w32, s, vals)
            bits = local_u32(bits_len)
            _state_step(vals, w16, w32, s, state, skeys, ids[k], col0, grads[k], params, st, bits)
            _store8(w8, w32, s, vals, bits, row_key(key, ids[k]), col0)

    kernels = {"rowwise_adagrad": _rowwise8, "sgd": _sgd8, "state": _state8}
    _UPDATE8[dim] = kernels
    return kernels


_UPDATE8: dict = {}
_NO_MEANS = np.empty(0, dtype=np.float32)
_NO_KEYS = np.zeros(2, dtype=np.uint64)


def update(cfg, records: np.ndarray, slots, ids, grads, key: int, row_means=None) -> bool:
    """The fused update of a narrow table's rows at ``slots`` (of ``ids``) with ``grads``,
    rounded stochastically from ``key``'s bits (a narrow state's arrays from their own keys,
    :func:`tiered_emb.precision.state_key`); False (nothing done) for a float32 table whose
    state alone is narrow: the caller takes the unfused path."""
    name = cfg.optimizer.name
    if cfg.dtype == "float32":
        return False
    params, k = cfg.optimizer.params(), np.uint64(key)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    means = row_means if name == "rowwise_adagrad" and row_means is not None else _NO_MEANS
    sw, col0, adam = cfg.weight_words, cfg.init_column, name == "adam"
    narrow_state = cfg.state_dtype != "float32"
    per = weight_words(cfg.state_dtype, cfg.dim)
    skeys = _NO_KEYS  # (the state arrays' own keys: a narrow state's alone needs them)
    if narrow_state and name in ("adagrad", "adam"):
        skeys = np.array([state_key(key, a) for a in range(2)], dtype=np.uint64)
    state = (int(sw), int(per), bool(narrow_state), bool(adam))  # (the state's layout: _state_step)
    if cfg.dtype == "int8":
        kernels8 = update_kernels8(cfg.dim)
        w8 = records.view(np.uint8)
        if name == "sgd":
            kernels8["sgd"](w8, records, slots, ids, grads, params, k, col0)
        elif name == "rowwise_adagrad":
            kernels8["rowwise_adagrad"](w8, records, slots, ids, grads, params, k, col0, sw, means)
        else:
            kernels8["state"](w8, records, slots, ids, grads, params, k, skeys, col0, state)
        return True
    kind = _kind(cfg.dtype)
    lut, bf16, w16 = LUT[cfg.dtype], cfg.dtype == "bfloat16", records.view(np.uint16)
    kernels = update_kernels(cfg.dim, kind)
    if name == "sgd":
        kernels["sgd"](w16, lut, slots, ids, grads, params, k, col0, bf16)
    elif name == "rowwise_adagrad":
        kernels["rowwise_adagrad"](w16, records, lut, slots, ids, grads, params, k, col0, sw, bf16, means)
    else:
        kernels["state"](w16, records, lut, slots, ids, grads, params, k, skeys, col0, state, bf16)
    return True


__all__ = ["pool", "pool_kernel", "update", "update_kernels", "update_kernels8"]
