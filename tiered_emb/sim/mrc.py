"""Miss-ratio curves: the exact LRU curve for every cache size in one pass, and Belady's.

LRU has the stack property (a cache of ``c`` objects holds the ``c`` most recently used
ones), so one pass that measures each request's *stack distance*, the number of distinct
ids used since the previous request of the same id, gives the hits of every size at once
(Mattson et al., 1970): a request hits in a cache of ``c`` objects iff its distance is at
most ``c``.  The distance is a count of "last occurrence" marks between two positions of
the trace: a bit per position and a few levels of counts above the bits (see
:func:`_sweep_chunk`); each request's previous request from a dense array of last
positions kept in the same pass (from a stable argsort when the ids are unbounded).  A
thread sweeps the second part of the trace while the caller sweeps the first, then joins
the second part's first request of each id to it as they come
(:func:`_stack_distance_histogram`); the curve is exact with any number of threads.

Belady's MIN has a stack property too, but its one-pass algorithms are far slower than
running it once per size, so :func:`opt_curve` does that, sharing the next-use array.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

from tiered_emb._args import as_ids, check_nonneg
from tiered_emb._jit import prefetch_hint
from tiered_emb.errors import ConfigError
from tiered_emb.sim.policies import PREFETCH_AHEAD, belady_hits, dense_ok, id_range, next_use_of


@intrinsic
def _popcount(typingctx, x):
    """Set bits of a uint64 (LLVM ctpop: one instruction)."""

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


@intrinsic
def _publish(typingctx, arr, i, v):
    """``arr[i] = v`` as a release store: a thread that reads it with :func:`_published`
    also sees every write made before it."""

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
        val = context.cast(builder, args[2], signature.args[2], aty.dtype)
        builder.store_atomic(val, ptr, "release", context.get_abi_sizeof(val.type))
        return context.get_dummy_value()

    return types.void(arr, i, v), codegen


@intrinsic
def _published(typingctx, arr, i):
    """``arr[i]`` as an acquire load (pairs with :func:`_publish`)."""

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1]], wraparound=False)
        return builder.load_atomic(ptr, "acquire", context.get_abi_sizeof(context.get_data_type(aty.dtype)))

    return arr.dtype(arr, i), codegen


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
# (n / 8 bytes: 2.5 MiB at 20M requests), and a few levels of plain counts sit above it:
# marks per block of 512 positions (8 words, one cache line of bits), then per 4 such
# blocks, per 16, and so on up to the chunk (160 KiB in all at 20M requests: it stays in
# the CPU cache).  Marks before a position are the popcounts of its block's words before
# it plus, at each level, the counts of the (at most 3) nodes before its own in their
# parent: every loop has a fixed trip count, so the query and the update are straight
# code with no branch to mispredict (the Fenwick tree's variable walks and a "nearby"
# shortcut cost about 1.5x more).  A node's count is written once, when the pass leaves
# it; the node the pass is in is never read, since a query only reads nodes before its own.
_BLOCK_SHIFT = 9  # positions per count of the first level: 512
_BLOCK_WORDS = 1 << (_BLOCK_SHIFT - 6)
_FAN_SHIFT = 2  # nodes per parent above it: 4 (the fastest of 4, 8, 16; docs/policies.md)
_FAN = 1 << _FAN_SHIFT
_COUNT_BATCH = 1 << 14  # distances buffered before they enter the histogram


@numba.njit(cache=True)
def _level_layout(m):
    """``(shifts, offsets)`` of the count levels over a chunk of ``m`` positions: level
    ``k`` counts marks per ``2 ** shifts[k]`` positions at ``offsets[k]`` of one flat
    array of ``offsets[-1]`` entries (each level padded to whole parents); the top
    level's nodes share one parent."""
    levels = 1
    s = _BLOCK_SHIFT
    while (np.int64(1) << (s + _FAN_SHIFT)) < m + 1:
        s += _FAN_SHIFT
        levels += 1
    shifts = np.empty(levels, dtype=np.int64)
    offsets = np.zeros(levels + 1, dtype=np.int64)
    s = _BLOCK_SHIFT
    for k in range(levels):
        shifts[k] = s
        offsets[k + 1] = offsets[k] + ((m >> s) // _FAN + 2) * _FAN
        s += _FAN_SHIFT
    return shifts, offsets


@numba.njit(inline="always")
def _marks_before(bits, counts, shifts, offsets, p):
    """Marks at positions ``0 .. p - 1``: popcounts of ``p``'s block up to ``p``, then
    at each level the nodes before ``p``'s in their parent (all closed)."""
    w = p >> 6
    s = np.int64(_popcount(bits[w] & ((np.uint64(1) << np.uint64(p & 63)) - np.uint64(1))))
    first = w & ~(_BLOCK_WORDS - 1)
    for j in range(_BLOCK_WORDS):
        c = np.int64(_popcount(bits[first + j]))
        s += c if first + j < w else 0
    for k in range(shifts.shape[0]):
        b = p >> shifts[k]
        first = offsets[k] + (b & ~(_FAN - 1))
        for j in range(_FAN):
            c = np.int64(counts[first + j])
            s += c if j < (b & (_FAN - 1)) else 0
    return s


@numba.njit
def _close_nodes(bits, counts, shifts, offsets, block, r):
    """The pass moves from first-level node ``block`` to position ``r`` (past the chunk:
    it leaves every node): write the count of each node it leaves."""
    c = 0
    for j in range(block * _BLOCK_WORDS, (block + 1) * _BLOCK_WORDS):
        c += np.int64(_popcount(bits[j]))
    counts[offsets[0] + block] = c
    node = block
    for k in range(1, shifts.shape[0]):
        node >>= _FAN_SHIFT
        if (r >> shifts[k]) == node:
            break
        first = offsets[k - 1] + (node << _FAN_SHIFT)
        c = 0
        for j in range(_FAN):
            c += counts[first + j]
        counts[offsets[k] + node] = c


@numba.njit
def _count_held(hist, batch, held):
    """Add 1 at ``hist[d]`` for each of the first ``held`` distances ``d`` of ``batch``.

    Why a batch: a histogram over millions of distances misses the cache at each count;
    inside the pass each miss stalls a long loop body, while this tight loop keeps many
    misses in flight (the counts went from about a third of the pass to about a sixth).
    """
    for j in range(held):
        hist[batch[j]] += 1


_PUBLISH_EVERY = 4096  # first requests of ids between two publications of the count
#: Share of the trace in the first chunk: the thread that sweeps it then joins the
#: second chunk's first requests while they come, so it gets less to sweep (the join
#: is about a seventh of a sweep on skewed traces).
_FIRST_SHARE = 0.46


@numba.njit(nogil=True, cache=True)
def _sweep_chunk(trace, start, stop, last, prev, bits, counts, shifts, offsets, hist, cold, progress):
    """Stack distances of the requests ``start .. stop - 1`` measured inside that chunk;
    returns the number of distinct ids in it.

    Each request's previous request of its id comes from ``last`` (int32 or int64
    (max id + 1,), filled here: each id's latest position so far in this chunk) or, when
    ``last`` is empty, from ``prev`` int64 (n,) (-1 for none).  The marks (one per id, on
    its latest request so far) are bits of ``bits`` uint64 (zeros, a whole number of
    blocks, > chunk / 64 words), chunk-relative; ``counts`` (zeros; levels from
    :func:`_level_layout` of at least the chunk's length: ``shifts``, ``offsets``) count
    them per node, every node closed on return.  A request whose previous one lies in the
    chunk adds 1 at its distance in ``hist`` (int32 or int64; ``hist[d]``: distance
    ``d``, 1 = re-request of the most recent id).  Unless ``cold`` is empty, the chunk's
    first request of each id instead writes, at ``cold[k]`` (int64, >= distinct ids,)
    with ``k`` the distinct ids of the chunk before it, its id (with ``last``) or its
    previous request's position (with ``prev``), for :func:`_join_chunks`, and
    publishes in ``progress`` int64 (2,) how many it wrote (``[0]``, as it goes) and that
    it is done (``[1] = 1``).
    """
    dense = last.shape[0] > 0
    listed = cold.shape[0] > 0
    if dense:
        last[:] = -1
    one = np.uint64(1)
    levels = shifts.shape[0]
    distinct = 0
    cur = 0
    batch = np.empty(_COUNT_BATCH, dtype=np.int64)
    held = 0
    # The hot path is written out here, not in helpers: numba's IR inlining of them, and
    # plain calls, made the pass slower (docs/policies.md).
    for i in range(start, stop):
        if dense:
            if i + PREFETCH_AHEAD < stop:
                prefetch_hint(last, trace[i + PREFETCH_AHEAD])
            key = trace[i]
            p = np.int64(last[key])
            last[key] = i
        else:
            key = 0
            p = prev[i]
        r = i - start
        if (r >> _BLOCK_SHIFT) != cur:
            _close_nodes(bits, counts, shifts, offsets, cur, r)
            cur = r >> _BLOCK_SHIFT
        if p >= start:
            p -= start
            # distance: the marks from p on (its own included), one per id since
            batch[held] = distinct - _marks_before(bits, counts, shifts, offsets, p)
            held += 1
            if held == _COUNT_BATCH:
                _count_held(hist, batch, held)
                held = 0
            # p's mark goes: its bit, and 1 from each closed node above it
            bits[p >> 6] &= ~(one << np.uint64(p & 63))
            for k in range(levels):
                node = p >> shifts[k]
                counts[offsets[k] + node] -= np.int64(node < (r >> shifts[k]))
        else:
            if listed:
                cold[distinct] = key if dense else p
                if (distinct + 1) % _PUBLISH_EVERY == 0:
                    _publish(progress, 0, distinct + 1)
            distinct += 1
        bits[r >> 6] |= one << np.uint64(r & 63)
    _count_held(hist, batch, held)
    _close_nodes(bits, counts, shifts, offsets, cur, np.int64(1) << 62)
    if listed:
        _publish(progress, 0, distinct)
        _publish(progress, 1, 1)
    return distinct


@numba.njit(nogil=True, cache=True)
def _join_chunks(last, bits, counts, shifts, offsets, cold, progress, state, hist):
    """The distances of the second chunk's first request of each id, whose previous
    request (if any) lies in the first chunk, as far as the second chunk's sweep has
    published them; returns whether that sweep is done and all of them are counted.

    ``bits`` and ``counts`` (levels ``shifts``, ``offsets``) hold the first chunk's marks
    at its end (one per id, on its last request there); ``cold`` and ``progress`` are
    what :func:`_sweep_chunk` writes for the second chunk, and ``last`` the first
    chunk's last positions (empty when ``cold`` holds positions).  ``state`` int64 (3,)
    carries from call to call: first requests counted, marks left (the first chunk's
    distinct ids at the start), ids neither chunk had before.  The ``k``-th first request
    comes after ``k`` distinct ids of its chunk; the other ids between it and its
    previous request ``p`` are the first chunk's marks after ``p`` whose ids have not
    come back yet: the pass removes each mark as its id comes back.
    """
    dense = last.shape[0] > 0
    one = np.uint64(1)
    done = _published(progress, 1)  # before the count: once done, the count is final
    n_cold = _published(progress, 0)
    k0, marks, new = state[0], state[1], state[2]
    batch = np.empty(_COUNT_BATCH, dtype=np.int64)
    held = 0
    for k in range(k0, n_cold):
        if dense:
            if k + PREFETCH_AHEAD < n_cold:
                prefetch_hint(last, cold[k + PREFETCH_AHEAD])
            p = np.int64(last[cold[k]])
        else:
            p = cold[k]
        if p < 0:
            new += 1
            continue
        # k ids of this chunk, then the marks from p on (its own included)
        batch[held] = k + marks - _marks_before(bits, counts, shifts, offsets, p)
        held += 1
        if held == _COUNT_BATCH:
            _count_held(hist, batch, held)
            held = 0
        bits[p >> 6] &= ~(one << np.uint64(p & 63))
        for j in range(shifts.shape[0]):  # every node is closed
            counts[offsets[j] + (p >> shifts[j])] -= 1
        marks -= 1
    _count_held(hist, batch, held)
    state[0], state[1], state[2] = max(k0, n_cold), marks, new
    return done == 1


def _stack_distance_histogram(trace: np.ndarray, last: np.ndarray, prev: np.ndarray, hist: np.ndarray) -> int:
    """Count requests by LRU stack distance into ``hist`` (int32 or int64 (2, m), zeros):
    summed over its rows, ``hist[:, d]`` counts the requests at distance ``d``; returns
    the number of distinct ids.

    ``last`` is int32 or int64 (2, max id + 1), one row per chunk, filled by the sweeps,
    or (2, 0) to take previous requests from ``prev`` int64 (n,) instead.

    Why two chunks: a thread sweeps the second part of the trace while this one sweeps
    the first (:data:`_FIRST_SHARE` of it), then joins the second chunk's first request
    of each id, as they come, to the first chunk's marks (:func:`_join_chunks`).  The
    counts are exact whatever the threads do; with ``numba.get_num_threads() == 1`` the
    chunks run one after the other here.
    """
    n = trace.shape[0]
    mid = int(n * _FIRST_SHARE)
    shifts, offsets = _level_layout(n - mid)  # the longer chunk's (the first fits too)
    words = (((n - mid) >> _BLOCK_SHIFT) + 1) * _BLOCK_WORDS
    bits = np.zeros((2, words), dtype=np.uint64)
    counts = np.zeros((2, offsets[-1]), dtype=hist.dtype)
    cold = np.empty(n - mid + 1, dtype=np.int64)
    progress = np.zeros(2, dtype=np.int64)
    failed = []

    def second():
        try:
            _sweep_chunk(trace, mid, n, last[1], prev, bits[1], counts[1], shifts, offsets, hist[1], cold, progress)
        except BaseException as e:  # raised in the caller's thread below
            failed.append(e)

    worker = None
    if numba.get_num_threads() > 1:
        worker = threading.Thread(target=second, name="tiered_emb-mrc", daemon=True)
        worker.start()
    else:
        second()
    try:
        distinct = _sweep_chunk(
            trace, 0, mid, last[0], prev, bits[0], counts[0], shifts, offsets, hist[0], cold[:0], progress[:0]
        )
        state = np.array([0, distinct, 0], dtype=np.int64)
        while not failed and not _join_chunks(
            last[0], bits[0], counts[0], shifts, offsets, cold, progress, state, hist[0]
        ):
            if worker is not None:
                worker.join(0.0005)  # let the sweep publish more
    finally:
        if worker is not None:
            worker.join()
    if failed:
        raise failed[0]
    return distinct + int(state[2])


@numba.njit(nogil=True, cache=True)
def _running_sum(hist, hits):
    """``hits[c]`` = requests at distance at most ``c``, summed over ``hist``'s two rows."""
    total = 0
    for d in range(hits.shape[0]):
        total += hist[0, d] + hist[1, d]
        hits[d] = total


def _as_int64_sizes(q: np.ndarray) -> np.ndarray:
    """Integer cache sizes as int64; unsigned ones past int64 become its largest (any size
    from the trace's length on has the same hits), not a wrapped negative."""
    if q.dtype.kind == "u" and q.dtype.itemsize == 8:
        q = np.minimum(q, np.uint64(2**63 - 1))
    return q.astype(np.int64)


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
        """Hits over requests at each size: float64 (m,)."""
        return self.hits / max(self.requests, 1)

    @property
    def miss_ratio(self) -> np.ndarray:
        """``1 - hit_ratio``: float64 (m,)."""
        return 1.0 - self.hit_ratio

    def at(self, sizes) -> np.ndarray:
        """Hits at ``sizes`` (an int or an array of them, >= 0), each one of :attr:`sizes`.

        A size above the last one answers the last one's hits when that last size is at
        least :attr:`distinct_ids`: a cache that holds every id never evicts, so any
        larger one hits the same.  That is always so for :func:`lru_curve` (sizes ``0 ..
        distinct_ids``), and for :func:`opt_curve` when asked up to ``distinct_ids``.
        Any other size is a :class:`ConfigError` (never the hits of a neighbouring size).
        """
        q = np.asarray(sizes)
        if q.dtype.kind not in "iu" and not (q.size == 0 and q.dtype.kind == "f"):
            raise ConfigError(f"sizes have dtype {q.dtype}", "give cache sizes as integers (objects)")
        shape = q.shape
        q = _as_int64_sizes(q).reshape(-1)
        if q.size and int(q.min()) < 0:
            raise ConfigError(f"cache size {int(q.min())} is negative", "give cache sizes >= 0")
        m = self.sizes.shape[0]
        if m and int(self.sizes[-1]) >= self.distinct_ids:
            q = np.minimum(q, self.sizes[-1])
        idx = np.searchsorted(self.sizes, q)
        found = idx < m
        found[found] = self.sizes[idx[found]] == q[found]
        if not found.all():
            bad = int(q[~found].ravel()[0])
            shown = self.sizes.tolist() if m <= 8 else self.sizes[:4].tolist() + ["..."] + self.sizes[-2:].tolist()
            raise ConfigError(
                f"cache size {bad} is not in this curve (sizes {shown}, {self.distinct_ids} distinct ids)",
                "ask for one of its sizes, or compute that size: opt_curve(trace, [size])",
            )
        return self.hits[idx].reshape(shape)


def lru_curve(trace: np.ndarray) -> MissRatioCurve:
    """The exact LRU hits for every cache size from 0 to the number of distinct ids.

    Parameters
    ----------
    trace : integer array (n,) (any int64 ids: no hash index is involved)

    Returns
    -------
    MissRatioCurve with ``sizes = 0, 1, ..., distinct_ids``

    Examples
    --------
    >>> c = lru_curve(np.array([1, 2, 1, 3, 1, 2]))
    >>> c.hits.tolist()   # sizes 0, 1, 2, 3
    [0, 0, 2, 3]
    """
    trace = as_ids(trace)
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
    distinct = _stack_distance_histogram(trace, last, prev, hist)
    hits = np.empty(distinct + 1, dtype=np.int64)
    _running_sum(hist, hits)
    return MissRatioCurve(np.arange(distinct + 1, dtype=np.int64), hits, n, distinct)


def opt_curve(trace: np.ndarray, sizes) -> MissRatioCurve:
    """Belady (MIN) hits at each of ``sizes`` (objects), one run per size, one next-use pass.

    ``trace``: integer ids >= 0 (:class:`IdRangeError` otherwise: the kernel's hash index
    keeps -1 for its empty buckets); ``sizes``: integers >= 0, in any order (the curve's
    are sorted and unique).

    Examples
    --------
    >>> opt_curve(np.array([1, 2, 3, 1, 2, 3]), [1, 2, 3]).hits.tolist()
    [0, 2, 3]
    """
    trace = as_ids(trace)
    n = trace.shape[0]
    lo, hi = id_range(trace)
    check_nonneg(lo)
    sizes = np.asarray(sizes)
    if sizes.ndim > 1 or (sizes.size and sizes.dtype.kind not in "iu"):
        raise ConfigError(
            f"sizes have dtype {sizes.dtype} and shape {sizes.shape}",
            "give a list of cache sizes in objects (integers)",
        )
    sizes = np.unique(_as_int64_sizes(sizes))
    if sizes.size and int(sizes[0]) < 0:
        raise ConfigError(f"cache size {int(sizes[0])} is negative", "give cache sizes >= 0")
    nxt = next_use_of(trace, max_id=hi)
    empty = np.zeros(0, dtype=np.uint8)
    # a cache of n objects never evicts: larger ones run as that one (same hits, its memory)
    hits = np.array(
        [belady_hits(trace, min(int(c), n), empty, nxt, max_id=hi) if c > 0 and n else 0 for c in sizes], dtype=np.int64
    )
    distinct = int(np.count_nonzero(nxt == n))  # one last request per id
    return MissRatioCurve(sizes, hits, n, distinct)
