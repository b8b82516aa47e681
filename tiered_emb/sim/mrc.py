"""Miss-ratio curves: the exact LRU curve for every cache size in one pass, and Belady's.

LRU has the stack property (a cache of ``c`` objects holds the ``c`` most recently used
ones), so one pass that measures each request's *stack distance*, the number of distinct
ids used since the previous request of the same id, gives the hits of every size at once
(Mattson et al., 1970): a request hits in a cache of ``c`` objects iff its distance is at
most ``c``.  The distance is a count of "last occurrence" marks between two positions of
the trace, kept in a Fenwick tree over positions: O(log n) per request.

Belady's MIN has a stack property too, but its one-pass algorithms are far slower than
running it once per size, so :func:`opt_curve` does that, sharing the next-use array.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from .policies import belady_hits, next_use_of


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


@numba.njit(cache=True)
def _stack_distance_histogram(prev, tree, hist):
    """Count requests by LRU stack distance into ``hist`` (int64 (n + 2,)); returns distinct ids.

    ``tree`` int32 (n + 1,) zeros, a Fenwick tree (1-based) of marks on the position of
    each id's latest request so far.  ``hist[d]`` counts requests at distance ``d``
    (1 = re-request of the most recent id); cold requests are not counted.
    """
    n = prev.shape[0]
    distinct = 0
    for i in range(n):
        p = prev[i]
        if p >= 0:
            # marks at positions <= p, inclusive of p's own mark
            s = 0
            k = p + 1
            while k > 0:
                s += tree[k]
                k -= k & (-k)
            hist[distinct - s + 1] += 1
            k = p + 1
            while k <= n:
                tree[k] -= 1
                k += k & (-k)
        else:
            distinct += 1
        k = i + 1
        while k <= n:
            tree[k] += 1
            k += k & (-k)
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
    order = np.argsort(trace, kind="stable").astype(np.int64)
    prev = np.empty(n, dtype=np.int64)
    _prev_use(trace, order, prev)
    del order
    hist = np.zeros(n + 2, dtype=np.int64)
    distinct = _stack_distance_histogram(prev, np.zeros(n + 1, dtype=np.int32), hist)
    hits = np.cumsum(hist[:distinct + 1])
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
