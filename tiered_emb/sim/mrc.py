"""Miss-ratio curves: the exact LRU curve for every cache size in one pass, and Belady's.

LRU has the stack property (a cache of ``c`` objects holds the ``c`` most recently used
ones), so one pass that measures each request's *stack distance*, the number of distinct
ids used since the previous request of the same id, gives the hits of every size at once
(Mattson et al., 1970): a request hits in a cache of ``c`` objects iff its distance is at
most ``c``.  The distance is a count of "last occurrence" marks between two positions of
the trace: a bit per position, a Fenwick tree over blocks of 512 positions, popcounts for
nearby positions (see :func:`_sweep_chunk`); each request's previous request from a dense
array of last positions kept in the same pass (from a stable argsort when the ids are
unbounded).  The two halves of the trace are swept at once, on two cores, and a short
pass over the second half's first request of each id joins them
(:func:`_stack_distance_histogram`); the curve is exact with any number of threads.

Belady's MIN has a stack property too, but its one-pass algorithms are far slower than
running it once per size, so :func:`opt_curve` does that, sharing the next-use array.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from ..kernels import _prefetch
from .policies import PREFETCH_AHEAD, belady_hits, dense_ok, id_range, next_use_of


@intrinsic
def _popcount(typingctx, x):
    """Set bits of a uint64 (LLVM ctpop: one instruction)."""
    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])
    return types.uint64(types.uint64), codegen


@numba.njit(cache=True)
def _prev_use(trace, order, prev):
    """``prev[i]`` = position of the previous request of ``trace[i]``, or -1 (``order``: stable argsort)."""
    n = trace.shape[0]
    for j in range(n):
        i = order[j]
        if j > 0 and trace[order[j - 1]] == trace[i]:
            prev[i] = order[j - 1]
        else:
            prev[i] = -1


# Why this layout: a Fenwick tree over all n positions costs ~25 random steps in an
# 80 MiB array per query and per update.  Here a position's mark is one bit of ``bits``
# (n / 8 bytes: 2.5 MiB at 20M requests), and the tree counts marks per block of 512
# positions (8 words, one cache line of bits), 512x smaller than one over positions
# (160 KiB at 20M requests: it stays in the CPU cache); a block enters the tree once, when
# the pass leaves it; and a previous request at most ``_NEAR_WORDS`` words back, the
# common case on skewed traces, is answered by popcounts alone.
_NEAR_WORDS = 8
_BLOCK_SHIFT = 9  # 512 positions per block of the tree
_DEFER = 16  # histogram counts in flight (a power of 2)


@numba.njit(inline="always")
def _tree_add(tree, block, delta):
    """Add ``delta`` at ``block`` (0-based) of the Fenwick tree ``tree`` (1-based)."""
    k = block + 1
    while k < tree.shape[0]:
        tree[k] += delta
        k += k & (-k)


@numba.njit(inline="always")
def _marks_through(bits, tree, r):
    """Marks at positions ``0 .. r`` (``r`` in a closed block): the tree for the blocks
    before ``r``'s, popcounts for the words of its block up to ``r``."""
    rw = r >> 6
    s = np.int64(_popcount(bits[rw] << np.uint64(63 - (r & 63))))
    for j in range((r >> _BLOCK_SHIFT) << 3, rw):
        s += np.int64(_popcount(bits[j]))
    k = r >> _BLOCK_SHIFT
    while k > 0:
        s += tree[k]
        k -= k & (-k)
    return s


@numba.njit(inline="always")
def _count_later(hist, ring, deferred, d):
    """Add 1 at ``hist[d]`` once ``_DEFER`` more counts have come (``ring`` int64 (_DEFER,)
    holds them); returns the new number of counts.

    Why: a histogram over millions of distances misses the cache at each count, and
    waiting with the count while its line is prefetched hides the miss (at 20M requests
    the counts went from 40 % of the pass to 5 %).
    """
    _prefetch(hist, d)
    slot = deferred & (_DEFER - 1)
    if deferred >= _DEFER:
        hist[ring[slot]] += 1
    ring[slot] = d
    return deferred + 1


@numba.njit(inline="always")
def _count_rest(hist, ring, deferred):
    """The counts still waiting in ``ring``."""
    for j in range(max(deferred - _DEFER, 0), deferred):
        hist[ring[j & (_DEFER - 1)]] += 1


@numba.njit(nogil=True, cache=True)
def _sweep_chunk(trace, start, stop, last, prev, bits, tree, hist, cold):
    """Stack distances of the requests ``start .. stop - 1`` measured inside that chunk;
    returns the number of distinct ids in it.

    Each request's previous request of its id comes from ``last`` (int32 or int64
    (max id + 1,), -1 filled: each id's latest position so far in this chunk, kept here)
    or, when ``last`` is empty, from ``prev`` int64 (n,) (-1 for none).  The marks (one
    per id, on its latest request so far) are bits of ``bits`` uint64 (chunk / 64 + 1,),
    chunk-relative; ``tree`` int32 (chunk / 512 + 2,) is a Fenwick tree (1-based) of
    marks per closed block of 512 positions (all closed on return).  A request whose
    previous one lies in the chunk adds 1 at its distance in ``hist`` (int32 or int64;
    ``hist[d]``: distance ``d``, 1 = re-request of the most recent id).  The chunk's
    first request of each id instead writes, at ``cold[k]`` (int64, >= distinct ids,)
    with ``k`` the distinct ids of the chunk before it, its id (with ``last``) or its
    previous request's position (with ``prev``), for :func:`_join_chunks`.
    """
    dense = last.shape[0] > 0
    one = np.uint64(1)
    distinct = 0
    cur_b = 0
    ring = np.zeros(_DEFER, dtype=np.int64)
    deferred = 0
    for i in range(start, stop):
        if dense:
            if i + PREFETCH_AHEAD < stop:
                _prefetch(last, trace[i + PREFETCH_AHEAD])
            key = trace[i]
            p = np.int64(last[key])
            last[key] = i
        else:
            key = 0
            p = prev[i]
        r = i - start
        w = r >> 6
        b = r >> _BLOCK_SHIFT
        if b != cur_b:
            # close block cur_b: its marks enter the tree
            c = 0
            for j in range(cur_b << 3, (cur_b + 1) << 3):
                c += np.int64(_popcount(bits[j]))
            _tree_add(tree, cur_b, c)
            cur_b = b
        if p >= start:
            p -= start
            pw = p >> 6
            pb = np.uint64(p & 63)
            # marks after p (p's own mark excluded) in its word
            above = np.int64(_popcount(bits[pw] >> pb)) - 1
            pblock = p >> _BLOCK_SHIFT
            if w - pw <= _NEAR_WORDS:
                for j in range(pw + 1, w + 1):
                    above += np.int64(_popcount(bits[j]))
            else:
                # marks at or before p: closed blocks before p's (tree), the words of
                # p's block before p's word, then p's word up to p
                s = np.int64(_popcount(bits[pw])) - above
                for j in range(pblock << 3, pw):
                    s += np.int64(_popcount(bits[j]))
                k = pblock
                while k > 0:
                    s += tree[k]
                    k -= k & (-k)
                above = distinct - s
            deferred = _count_later(hist, ring, deferred, above + 1)
            bits[pw] &= ~(one << pb)
            if pblock != b:
                _tree_add(tree, pblock, -1)
        else:
            cold[distinct] = key if dense else p
            distinct += 1
        bits[w] |= one << np.uint64(r & 63)
    _count_rest(hist, ring, deferred)
    if stop > start:
        c = 0
        for j in range(cur_b << 3, (cur_b + 1) << 3):
            c += np.int64(_popcount(bits[j]))
        _tree_add(tree, cur_b, c)
    return distinct


@numba.njit(nogil=True, cache=True)
def _join_chunks(last, bits, tree, distinct, cold, n_cold, hist):
    """The distances of the second chunk's first request of each id, whose previous
    request (if any) lies in the first chunk; returns how many ids neither chunk had before.

    ``bits`` and ``tree`` hold the first chunk's marks at its end (one per id, on its
    last request there; ``distinct`` of them); ``cold`` (``n_cold`` of them, in time
    order) is what :func:`_sweep_chunk` wrote for the second chunk, and ``last`` the
    first chunk's last positions (empty when ``cold`` holds positions).  The ``k``-th
    first request comes after ``k`` distinct ids of its chunk; the other ids between it
    and its previous request ``p`` are the first chunk's marks after ``p`` whose ids have
    not come back yet: the pass removes each mark as its id comes back.
    """
    dense = last.shape[0] > 0
    one = np.uint64(1)
    new = 0
    marks = distinct
    ring = np.zeros(_DEFER, dtype=np.int64)
    deferred = 0
    for k in range(n_cold):
        if dense:
            if k + PREFETCH_AHEAD < n_cold:
                _prefetch(last, cold[k + PREFETCH_AHEAD])
            p = np.int64(last[cold[k]])
        else:
            p = cold[k]
        if p < 0:
            new += 1
            continue
        after = marks - _marks_through(bits, tree, p)
        deferred = _count_later(hist, ring, deferred, k + after + 1)
        bits[p >> 6] &= ~(one << np.uint64(p & 63))
        _tree_add(tree, p >> _BLOCK_SHIFT, -1)
        marks -= 1
    _count_rest(hist, ring, deferred)
    return new


@numba.njit(parallel=True, cache=True)
def _stack_distance_histogram(trace, last, prev, hist):
    """Count requests by LRU stack distance into ``hist`` (int32 or int64 (2, m), zeros):
    summed over its rows, ``hist[:, d]`` counts the requests at distance ``d``; returns
    the number of distinct ids.

    Why two chunks: the halves of the trace are swept at once, one per core, each with
    its own row of ``last`` (int32 or int64 (2, max id + 1), filled here; (2, 0) to take
    previous requests from ``prev`` int64 (n,) instead), then one short sequential pass
    joins them (:func:`_join_chunks`); the counts are exact whatever the number of
    threads (one runs the halves one after the other).
    """
    n = trace.shape[0]
    mid = n // 2
    bounds = np.array([0, mid, n], dtype=np.int64)
    words = ((n - mid) >> 6) + 1
    blocks = ((n - mid) >> _BLOCK_SHIFT) + 2
    bits = np.zeros((2, words), dtype=np.uint64)
    tree = np.zeros((2, blocks), dtype=np.int32)
    cold = np.empty((2, n - mid + 1), dtype=np.int64)
    distinct = np.zeros(2, dtype=np.int64)
    for c in numba.prange(2):
        last[c, :] = -1  # by the thread that uses it: the fill is parallel too
        distinct[c] = _sweep_chunk(trace, bounds[c], bounds[c + 1], last[c], prev, bits[c], tree[c], hist[c],
                                   cold[c])
    return distinct[0] + _join_chunks(last[0], bits[0], tree[0], distinct[0], cold[1], distinct[1], hist[1])


@dataclass(frozen=True)
class MissRatioCurve:
    """Hits of a policy against cache size.

    Attributes
    ----------
    sizes : int64 (m,), cache sizes in objects, increasing
    hits : int64 (m,), hits at each size
    requests : int, length of the trace
    distinct_ids : int
    """

    sizes: np.ndarray
    hits: np.ndarray
    requests: int
    distinct_ids: int

    @property
    def hit_ratio(self) -> np.ndarray:
        return self.hits / max(self.requests, 1)

    @property
    def miss_ratio(self) -> np.ndarray:
        return 1.0 - self.hit_ratio

    def at(self, sizes) -> np.ndarray:
        """Hits at ``sizes`` (each one in :attr:`sizes`)."""
        idx = np.searchsorted(self.sizes, np.asarray(sizes, dtype=np.int64))
        return self.hits[idx]


def lru_curve(trace: np.ndarray) -> MissRatioCurve:
    """The exact LRU hits for every cache size from 0 to the number of distinct ids.

    Parameters
    ----------
    trace : int64 array (n,)

    Returns
    -------
    MissRatioCurve with ``sizes = 0, 1, ..., distinct_ids``

    Examples
    --------
    >>> c = lru_curve(np.array([1, 2, 1, 3, 1, 2]))
    >>> c.hits.tolist()   # sizes 0, 1, 2, 3
    [0, 0, 2, 3]
    """
    trace = np.ascontiguousarray(trace, dtype=np.int64)
    n = trace.shape[0]
    lo, hi = id_range(trace)
    if lo >= 0 and dense_ok(hi, n):
        last = np.empty((2, hi + 1), dtype=np.int32 if n < 2**31 else np.int64)
        prev = np.zeros(0, dtype=np.int64)
        most = min(n, hi + 1)  # distances are at most the number of distinct ids
    else:
        last = np.zeros((2, 0), dtype=np.int64)
        prev = np.empty(n, dtype=np.int64)
        order = np.argsort(trace, kind="stable").astype(np.int64)
        _prev_use(trace, order, prev)
        del order
        most = n
    hist = np.zeros((2, most + 2), dtype=np.int32 if n < 2**31 else np.int64)
    distinct = int(_stack_distance_histogram(trace, last, prev, hist))
    hits = np.cumsum(hist[0, :distinct + 1] + hist[1, :distinct + 1], dtype=np.int64)
    return MissRatioCurve(np.arange(distinct + 1, dtype=np.int64), hits, n, distinct)


def opt_curve(trace: np.ndarray, sizes) -> MissRatioCurve:
    """Belady (MIN) hits at each of ``sizes`` (objects), one run per size, one next-use pass.

    Examples
    --------
    >>> opt_curve(np.array([1, 2, 3, 1, 2, 3]), [1, 2, 3]).hits.tolist()
    [0, 2, 3]
    """
    trace = np.ascontiguousarray(trace, dtype=np.int64)
    sizes = np.unique(np.asarray(sizes, dtype=np.int64))
    nxt = next_use_of(trace)
    empty = np.zeros(0, dtype=np.uint8)
    hits = np.array([belady_hits(trace, int(c), empty, nxt) if c > 0 else 0 for c in sizes], dtype=np.int64)
    distinct = int(np.count_nonzero(nxt == trace.shape[0]))  # one last request per id
    return MissRatioCurve(sizes, hits, trace.shape[0], distinct)
