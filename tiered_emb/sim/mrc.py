"""Miss-ratio curves: the exact LRU curve for every cache size in one pass, and Belady's.

LRU has the stack property (a cache of ``c`` objects holds the ``c`` most recently used
ones), so one pass that measures each request's *stack distance*, the number of distinct
ids used since the previous request of the same id, gives the hits of every size at once
(Mattson et al., 1970): a request hits in a cache of ``c`` objects iff its distance is at
most ``c``.  The distance is a count of "last occurrence" marks between two positions of
the trace: a bit per position, a Fenwick tree over 64-position words, popcounts for
nearby positions (see :func:`_stack_distance_histogram`); each request's previous
request from a dense array of last positions kept in the same pass (from a stable
argsort when the ids are unbounded).

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


@numba.njit(cache=True)
def _stack_distance_histogram(trace, last, prev, hist):
    """Count requests by LRU stack distance into ``hist`` (int32 or int64); returns distinct ids.

    Each request's previous request of its id comes from ``last`` (int32 or int64
    (max id + 1,), -1 filled: each id's latest position so far, kept here) or, when
    ``last`` is empty, from ``prev`` int64 (n,) (-1 for none).  The marks (one per id,
    on its latest request so far) are bits of ``bits`` uint64 (n / 64,); ``tree`` int32
    is a Fenwick tree (1-based) of marks per closed block of 512 positions.  ``hist[d]``
    counts requests at distance ``d`` (1 = re-request of the most recent id); cold
    requests are not counted.
    """
    n = trace.shape[0]
    dense = last.shape[0] > 0
    n_words = (n >> 6) + 1
    n_blocks = (n >> _BLOCK_SHIFT) + 1
    bits = np.zeros(n_words, dtype=np.uint64)
    tree = np.zeros(n_blocks + 1, dtype=np.int32)
    one = np.uint64(1)
    distinct = 0
    cur_b = 0
    for i in range(n):
        if dense:
            if i + PREFETCH_AHEAD < n:
                _prefetch(last, trace[i + PREFETCH_AHEAD])
            key = trace[i]
            p = np.int64(last[key])
            last[key] = i
        else:
            p = prev[i]
        w = i >> 6
        b = i >> _BLOCK_SHIFT
        if b != cur_b:
            # close block cur_b: its marks enter the tree
            c = 0
            for j in range(cur_b << 3, (cur_b + 1) << 3):
                c += np.int64(_popcount(bits[j]))
            k = cur_b + 1
            while k <= n_blocks:
                tree[k] += c
                k += k & (-k)
            cur_b = b
        if p >= 0:
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
            hist[above + 1] += 1
            bits[pw] &= ~(one << pb)
            if pblock != b:
                k = pblock + 1
                while k <= n_blocks:
                    tree[k] -= 1
                    k += k & (-k)
        else:
            distinct += 1
        bits[w] |= one << np.uint64(i & 63)
    return distinct


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
        last = np.full(hi + 1, -1, dtype=np.int32 if n < 2**31 else np.int64)
        prev = np.zeros(0, dtype=np.int64)
        most = min(n, hi + 1)  # distances are at most the number of distinct ids
    else:
        last = np.zeros(0, dtype=np.int64)
        prev = np.empty(n, dtype=np.int64)
        order = np.argsort(trace, kind="stable").astype(np.int64)
        _prev_use(trace, order, prev)
        del order
        most = n
    hist = np.zeros(most + 2, dtype=np.int32 if n < 2**31 else np.int64)
    distinct = _stack_distance_histogram(trace, last, prev, hist)
    hits = np.cumsum(hist[:distinct + 1], dtype=np.int64)
    return MissRatioCurve(np.arange(distinct + 1, dtype=np.int64), hits, n, int(distinct))


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
