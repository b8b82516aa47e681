"""Batch kernels of the step: dedupe (plan), gather and pool (forward), reduce (backward).

All are ``@njit`` over preallocated arrays.  Parallel loops run over *distinct* outputs
(rows, bags, unique ids) and every sum runs in batch-position order, so results are
bitwise the same for any thread count.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tiered_emb.cache.index import _hash_home

# Rows this many positions ahead are prefetched by the pooling loops: a row read at
# random from a large table misses the caches, and the loop's own loads cannot run far
# enough ahead to hide it (measured: 2.6 -> 1.9 ms for 8,192 bags x 20 rows of dim 128).
PREFETCH_DISTANCE = 8


@intrinsic
def _prefetch(typingctx, arr, idx):
    """LLVM's prefetch of ``arr[idx]`` (read, keep in all cache levels; ``idx`` an integer or
    a tuple of them, in bounds): a hint to the CPU, no effect on results."""
    def codegen(context, builder, signature, args):
        aty, ity = signature.args
        ary = context.make_array(aty)(context, builder, args[0])
        idxs = cgutils.unpack_tuple(builder, args[1]) if isinstance(ity, types.BaseTuple) else [args[1]]
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, idxs, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@intrinsic
def _local_f32(typingctx, n):
    """A float32 array of ``n`` (a compile-time integer) on the calling function's stack.

    Uninitialised, and valid only within the function (a prange body's array lives as
    long as its thread's share of the loop).  Where ``np.zeros(n)`` takes a heap block
    per call, this takes none, and a small fixed-size array stays in registers: a bag's
    running sum of 128 floats in 16 vector registers instead of a memory round trip per
    row (measured: the pooling kernel 1.6 -> 1.3 ms for 8,192 bags x 20 rows of dim 128).
    """
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value
    arrty = types.Array(types.float32, 1, "C")

    def codegen(context, builder, signature, args):
        ptr = cgutils.alloca_once(builder, ir.FloatType(), size=size)
        ary = context.make_array(arrty)(context, builder)
        intp = context.get_value_type(types.intp)
        context.populate_array(ary, data=ptr, shape=[intp(size)], strides=[intp(4)], itemsize=intp(4), meminfo=None)
        return ary._getvalue()
    return arrty(n), codegen


@numba.njit(inline="always")
def _prefetch_row(records, row):
    """Prefetch every 64-byte line of ``records[row]`` (float32)."""
    for c in range(0, records.shape[1], 16):
        _prefetch(records, (row, c))


@numba.njit(cache=True, nogil=True)
def _dedupe(ids, uniq, inverse):
    """Unique ids in first-occurrence order.

    ``ids`` int64 (n,); writes ``uniq`` int64 (>= k,) and ``inverse`` int64 (n,) with
    ``uniq[inverse[i]] == ids[i]``; returns k.
    """
    n = ids.shape[0]
    size = 16
    while size < 2 * n:
        size *= 2
    mask = size - 1
    keys = np.full(size, -1, dtype=np.int64)
    vals = np.empty(size, dtype=np.int32)
    k = 0
    for i in range(n):
        if i + 2 * PREFETCH_DISTANCE < n:  # the buckets of an id further on (1.30 -> 1.03 ms for 164k ids)
            ahead = _hash_home(ids[i + 2 * PREFETCH_DISTANCE], mask)
            _prefetch(keys, ahead)
            _prefetch(vals, ahead)
        key = ids[i]
        h = _hash_home(key, mask)
        while True:
            kk = keys[h]
            if kk == key:
                inverse[i] = vals[h]
                break
            if kk == -1:
                keys[h] = key
                vals[h] = k
                uniq[k] = key
                inverse[i] = k
                k += 1
                break
            h = (h + 1) & mask
    return k


def dedupe(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(uniq, inverse)`` of int64 ``ids`` (n,), uniq in first-occurrence order.

    Examples
    --------
    >>> u, inv = dedupe(np.array([5, 3, 5, 9]))
    >>> u.tolist(), inv.tolist()
    ([5, 3, 9], [0, 1, 0, 2])
    """
    uniq = np.empty(ids.shape[0], dtype=np.int64)
    inverse = np.empty(ids.shape[0], dtype=np.int64)
    k = _dedupe(ids, uniq, inverse)
    return uniq[:k], inverse


@numba.njit(parallel=True, cache=True, nogil=True)
def _gather_rows(records, slots, inverse, out):
    """``out[i] = records[slots[inverse[i]], :out.shape[1]]``; float32, (n, dim)."""
    dim = out.shape[1]
    for i in numba.prange(out.shape[0]):
        src = records[slots[inverse[i]]]
        dst = out[i]
        for j in range(dim):
            dst[j] = src[j]


@numba.njit(parallel=True, cache=True, nogil=True)
def _gather_positions(records, slots, inverse, positions, first, out):
    """``out[p] = records[slots[inverse[p] - first], :dim]`` for each p in ``positions``."""
    dim = out.shape[1]
    for q in numba.prange(positions.shape[0]):
        p = positions[q]
        src = records[slots[inverse[p] - first]]
        for j in range(dim):
            out[p, j] = src[j]


@numba.njit(inline="always")
def _group_starts(inverse, k, starts):
    """The counting sort's first half: ``starts`` (int64 (k+1,)) = where each unique index's
    positions begin; returns a copy of ``starts[:k]`` to fill from."""
    starts[:] = 0
    for i in range(inverse.shape[0]):
        starts[inverse[i] + 1] += 1
    for u in range(k):
        starts[u + 1] += starts[u]
    return starts[:k].copy()


@numba.njit(cache=True, nogil=True)
def _group_positions(inverse, k, starts, order):
    """Counting sort of positions by unique index, stable: ``order[starts[u]:starts[u+1]]``
    are the positions of unique ``u`` in batch order.  ``starts`` int64 (k+1,)."""
    fill = _group_starts(inverse, k, starts)
    for i in range(inverse.shape[0]):
        u = inverse[i]
        order[fill[u]] = i
        fill[u] += 1


# Blocks of unique ids each thread's share of the reduce is cut into.  A Zipf batch's
# first ids (first-occurrence order) hold most positions: split evenly by id, one thread
# got 85 % of the work for 8,192 bags x 20 ids at Zipf 1.05.
_REDUCE_BLOCKS = 64


@numba.njit(cache=True, nogil=True)
def _blocks_by_work(starts, blocks, bounds):
    """Cut unique ids ``0..k`` into ``blocks`` runs of about equal work (positions + ids).

    ``starts`` int64 (k+1,) as :func:`_group_positions`; writes ``bounds`` int64
    (blocks+1,), nondecreasing from 0 to k.  Only who computes what depends on it, never
    a result.
    """
    k = starts.shape[0] - 1
    total = starts[k] + k
    bounds[0] = 0
    lo = 0
    for b in range(1, blocks):
        target = total * b // blocks
        hi = k
        while lo < hi:  # first u with starts[u] + u >= target
            mid = (lo + hi) // 2
            if starts[mid] + mid < target:
                lo = mid + 1
            else:
                hi = mid
        bounds[b] = lo
    bounds[blocks] = k


@numba.njit(parallel=True, cache=True, nogil=True)
def _reduce_grads(grads, starts, order, bounds, out):
    """``out[u] = sum of grads[order[starts[u]:starts[u+1]]]`` in batch-position order (float32).

    ``bounds`` from :func:`_blocks_by_work`: each thread's share by positions, not ids.
    """
    dim = grads.shape[1]
    for blk in numba.prange(bounds.shape[0] - 1):
        for u in range(bounds[blk], bounds[blk + 1]):
            for j in range(dim):
                out[u, j] = 0.0
            for q in range(starts[u], starts[u + 1]):
                g = grads[order[q]]
                for j in range(dim):
                    out[u, j] += g[j]


def reduce_grads(grads: np.ndarray, inverse: np.ndarray, k: int) -> np.ndarray:
    """Sum gradient rows of duplicate ids: float32 (n, dim) -> (k, dim), in batch order per id."""
    starts = np.empty(k + 1, dtype=np.int64)
    order = np.empty(inverse.shape[0], dtype=np.int64)
    _group_positions(inverse, k, starts, order)
    bounds = np.empty(_REDUCE_BLOCKS + 1, dtype=np.int64)
    _blocks_by_work(starts, _REDUCE_BLOCKS, bounds)
    out = np.empty((k, grads.shape[1]), dtype=np.float32)
    _reduce_grads(grads, starts, order, bounds, out)
    return out


@numba.njit(cache=True, nogil=True)
def _last_occurrence(inverse, last):
    """``last[u]`` = the last batch position of unique ``u`` (a write's winner)."""
    for i in range(inverse.shape[0]):
        last[inverse[i]] = i


@numba.njit(cache=True, nogil=True)
def _all_finite(a):
    flat = a.reshape(-1)
    for i in range(flat.shape[0]):
        if not np.isfinite(flat[i]):
            return False
    return True


@numba.njit(parallel=True, cache=True, nogil=True)
def _pool_bags(rows, offsets, weights, use_weights, mean, out):
    """Pool ``rows`` (n, dim) into bags: ``out[b] = sum rows[offsets[b]:offsets[b+1]]``.

    In position order within each bag; ``weights`` (n,) scale rows when ``use_weights``;
    ``mean`` divides by the bag length (empty bags give zeros).  float32 (B, dim).
    """
    dim = rows.shape[1]
    for b in numba.prange(out.shape[0]):
        for j in range(dim):
            out[b, j] = 0.0
        lo = offsets[b]
        hi = offsets[b + 1]
        for i in range(lo, hi):
            w = weights[i] if use_weights else np.float32(1.0)
            for j in range(dim):
                out[b, j] += w * rows[i, j]
        if mean and hi > lo:
            inv = np.float32(1.0) / np.float32(hi - lo)
            for j in range(dim):
                out[b, j] *= inv


@numba.njit(parallel=True, cache=True, nogil=True)
def _unpool_grads(grad_out, offsets, weights, use_weights, mean, out):
    """Backward of :func:`_pool_bags`: each position's gradient row (n, dim) from its bag's."""
    dim = grad_out.shape[1]
    for b in numba.prange(grad_out.shape[0]):
        lo = offsets[b]
        hi = offsets[b + 1]
        scale = np.float32(1.0)
        if mean and hi > lo:
            scale = np.float32(1.0) / np.float32(hi - lo)
        for i in range(lo, hi):
            w = scale * (weights[i] if use_weights else np.float32(1.0))
            for j in range(dim):
                out[i, j] = w * grad_out[b, j]
