"""Belady's MIN (OPT): evict the resident whose next request is farthest away.

Ties, which only arise among ids never requested again, go to the one that entered that
state last (any choice among those gives the same hits).  The offline optimum every
policy is measured against; no store policy (the store's ``lookahead+*`` policies see
only a window of batches: :mod:`tiered_emb.sim.lookahead`).  :func:`next_use_of`, the
future it needs, is here too; the miss-ratio curves and traces use it.

>>> import numpy as np
>>> belady_hits(np.array([1, 2, 3, 1, 2, 3]), 2, np.zeros(0, np.uint8))
2
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._args import as_ids
from tiered_emb._jit import kernel, prefetch_hint
from tiered_emb.errors import ConfigError
from tiered_emb.sim.policies.base import PREFETCH_AHEAD, dense_ok, id_range, ix_del, ix_find, ix_prefetch, ix_put
from tiered_emb.sim.policies.buffers import kernel_state, scratch


@numba.njit(cache=True)
def _next_use(trace, order, next_use, never):
    """``next_use[i]`` = position of the next request of ``trace[i]``, or ``never``.

    ``order`` (int64 (n,)) is a *stable* argsort of ``trace``: equal ids appear in time
    order, so each one's successor in ``order`` is its next request.
    """
    n = trace.shape[0]
    for j in range(n):
        i = order[j]
        if j + 1 < n and trace[order[j + 1]] == trace[i]:
            next_use[i] = order[j + 1]
        else:
            next_use[i] = never


@numba.njit(cache=True)
def _next_use_dense(trace, last, next_use):
    """The same from the end in one pass: ``last`` (int32 or int64 (max id + 1,), filled
    with ``n``) holds each id's earliest request seen so far."""
    # twice the kernels' distance: a request costs so little here that more loads fit in
    # flight
    for i in range(trace.shape[0] - 1, -1, -1):
        if i >= 2 * PREFETCH_AHEAD:
            prefetch_hint(last, trace[i - 2 * PREFETCH_AHEAD])
        k = trace[i]
        next_use[i] = last[k]
        last[k] = i


def next_use_of(trace: np.ndarray, dtype=np.int64, max_id: int | None = None) -> np.ndarray:
    """Position of each request's next request of the same id, or ``len(trace)`` if none.

    One backward pass over a dense array of last positions when the ids are bounded
    (:func:`dense_ok`), else a stable argsort (O(n log n)).

    Parameters
    ----------
    trace : integer array (n,) (any ids: negative ones take the argsort)
    dtype : np.int64, or np.int32 for half the memory when ``n < 2**31`` (Belady's own)
    max_id : int, optional, the largest id, when the caller has checked the ids (all >= 0)
        and knows it: saves a pass over the trace

    Returns
    -------
    ``dtype`` array (n,)

    Examples
    --------
    >>> next_use_of(np.array([5, 6, 5, 5])).tolist()
    [2, 4, 3, 4]
    """
    trace = as_ids(trace)
    n = trace.shape[0]
    if np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)) or (np.dtype(dtype) == np.int32 and n >= 2**31):
        raise ConfigError(
            f"dtype={dtype!r} cannot hold the positions of {n} requests",
            "use np.int64 (or np.int32 below 2**31 requests)",
        )
    out = np.empty(n, dtype=dtype)
    _next_use_into(trace, out, max_id)
    return out


def _next_use_into(trace: np.ndarray, out: np.ndarray, max_id: int | None) -> None:
    """:func:`next_use_of` of ``trace`` (checked int64 ids) into ``out``."""
    n = trace.shape[0]
    lo, hi = id_range(trace) if max_id is None else (0, max_id)
    if lo >= 0 and dense_ok(hi, n):
        with scratch("last", hi + 1, np.int32 if n < 2**31 else np.int64) as last:
            last.fill(n)
            _next_use_dense(trace, last, out)
    else:
        order = np.argsort(trace, kind="stable").astype(np.int64)
        _next_use(trace, order, out, n)


@numba.njit(inline="always")
def _opt_sift_up(heap, hpos, i):
    x = heap[i]
    while i > 0:
        parent = (i - 1) >> 2
        q = heap[parent]
        if q >= x:
            break
        heap[i] = q
        hpos[q & 0xFFFFFFFF] = i
        i = parent
    heap[i] = x
    hpos[x & 0xFFFFFFFF] = i


@numba.njit(inline="always")
def _opt_sift_down(heap, hpos, i, n):
    x = heap[i]
    while True:
        c = 4 * i + 1
        if c >= n:
            break
        # the largest of up to four children (adjacent: one or two cache lines)
        hc = heap[c]
        for j in range(c + 1, min(c + 4, n)):
            if heap[j] > hc:
                c = j
                hc = heap[j]
        if hc <= x:
            break
        heap[i] = hc
        hpos[hc & 0xFFFFFFFF] = i
        i = c
    heap[i] = x
    hpos[x & 0xFFFFFFFF] = i


@kernel
def _belady_simulate(trace, next_use, capacity, ix, slot_ids, heap, hpos, dead, hit_flags):
    """Belady's MIN: a 4-ary max-heap (int64 (capacity,)) of ``next use << 32 | slot``
    over the residents that will be requested again, and a stack ``dead`` int32
    (capacity,) of those that will not.

    Four children per node halve the depth of a binary heap (a hit moves its slot up),
    and the four are adjacent in memory (an eviction moves the new slot down).  Packing
    the key makes the heap order one integer compare on the heap array itself, with no
    indirection through the slot; ``hpos`` int32 (capacity,) is each heap slot's position.

    Why the stack: a resident never requested again is the first to go (any of them: none
    can hit again, so which one leaves changes no hit), and on skewed traces they are
    most of a large cache (a last request is often a hit).  In the heap each would climb
    to the root, through ties broken by slot, and sit above the live ones; on the stack
    it costs one store, and the heap holds only live residents.  A hit's old key is the
    current position, the smallest in the heap, so its slot is a leaf: a new key only
    moves it up, and removing it (its last request) moves the heap's last entry into the
    leaf and up.
    """
    record = hit_flags.shape[0] > 0
    hits = 0
    used = 0  # slots handed out
    live = 0  # heap entries
    n_dead = 0
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        s = ix_find(ix, key)
        nu = np.int64(next_use[i])
        if s >= 0:
            hits += 1
            if record:
                hit_flags[i] = 1
            h = hpos[s]
            if nu < n:
                heap[h] = (nu << 32) | s  # later than before: moves up
            else:
                live -= 1
                dead[n_dead] = s
                n_dead += 1
                if h == live:
                    continue
                heap[h] = heap[live]
            _opt_sift_up(heap, hpos, h)
            continue
        if used < capacity:
            s = used
            used += 1
        elif n_dead > 0:
            n_dead -= 1
            s = dead[n_dead]
            ix_del(ix, slot_ids[s])
        else:
            # evict the farthest next use: the root gives way to the new entry if it is
            # live, else to the heap's last entry
            s = heap[0] & 0xFFFFFFFF
            ix_del(ix, slot_ids[s])
            slot_ids[s] = key
            ix_put(ix, key, s)
            if nu < n:
                heap[0] = (nu << 32) | s
            else:
                live -= 1
                heap[0] = heap[live]
                dead[n_dead] = s
                n_dead += 1
            if live > 0:
                _opt_sift_down(heap, hpos, 0, live)
            continue
        slot_ids[s] = key
        ix_put(ix, key, s)
        if nu < n:
            heap[live] = (nu << 32) | s
            live += 1
            _opt_sift_up(heap, hpos, live - 1)
        else:
            dead[n_dead] = s
            n_dead += 1
    return hits


def belady_hits(trace, capacity, hit_flags, next_use=None, index="auto", max_id=None):
    """Hits of Belady's MIN; ``next_use`` (from :func:`next_use_of`) is computed when not
    given (``max_id``: the largest id when the caller knows it and has checked the ids are >= 0).

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    if next_use is None:
        n = trace.shape[0]
        with scratch("next_use", n, np.int32 if n < 2**31 else np.int64) as nu:
            _next_use_into(trace, nu, max_id)
            return belady_hits(trace, capacity, hit_flags, nu, index, max_id)
    with kernel_state(trace, capacity, index, max_id) as (ix, idt):
        return _belady_simulate(
            trace,
            next_use,
            capacity,
            ix,
            np.empty(capacity, idt),
            np.empty(capacity, np.int64),
            np.empty(capacity, np.int32),
            np.empty(capacity, np.int32),
            hit_flags,
        )
