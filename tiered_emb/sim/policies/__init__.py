"""Simulator-only eviction policies: one ``@njit`` kernel per policy over preallocated arrays.

Every kernel has the same shape: it runs a request trace (int64 ``(n,)``) through a cache
of ``capacity`` objects of unit size, admitting every missed id (demand paging, as
libCacheSim does), and returns the hit count.  ``hit_flags`` is either an empty uint8
array or a uint8 ``(n,)`` array that receives 1 at each hit (the tests compare it
request by request with :mod:`tiered_emb.testing.sim_reference`).

The store's own LRU and LFU are not here: :func:`tiered_emb.sim.simulate` runs them
through :func:`tiered_emb.cache.slots._simulate_requests`, the kernels the store uses.
The policies below follow libCacheSim's definitions so that hit ratios can be compared
with it request for request (see ``docs/policies.md`` for the few places where they do
not, and why):

- FIFO: evict the oldest insertion; hits change nothing.
- CLOCK: FIFO with one reference bit, set on a hit; the hand clears set bits (second
  chance) and evicts the first clear one.  (libCacheSim ``Clock``, 1-bit counter.)
- SIEVE: insertion order list, one visited bit; the hand walks from the oldest towards
  the newest, clearing bits, evicts the first unvisited object and stays where it was.
- S3-FIFO: small FIFO (10 %), main FIFO (90 %) with a 2-bit clock, ghost FIFO of ids
  (90 %); the variant of libCacheSim 0.3.x (``S3FIFO.c``), including its warm-up rule.
- ARC: T1/T2/B1/B2 with a float target ``p``, as libCacheSim's ``ARC.c``.
- Belady (OPT/MIN): evict the resident whose next request is farthest away; ties, which
  only arise among ids never requested again, go to the one that entered that state last
  (any choice among those gives the same hits).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from tiered_emb.errors import ConfigError
from tiered_emb.cache.index import _hash_home, _index_del, _index_find, _index_put, new_index
from tiered_emb.kernels import _prefetch
from tiered_emb._args import as_ids, finite_arg

NIL = -1

#: How many requests ahead the kernels prefetch the index entry of the id to come.
PREFETCH_AHEAD = 32
#: How many requests ahead the kernels prefetch the policy state of the slot to come,
#: when that state is too large for the CPU's own caches (more slots than ``PREFETCH_STATE_MIN``).
PREFETCH_STATE_AHEAD = 8
PREFETCH_STATE_MIN = 1 << 16

#: Largest id space given a dense index whatever the trace length (a 256 MiB int32 array);
#: longer traces may use up to ``DENSE_IDS_PER_REQUEST`` ids per request.
DENSE_MAX_IDS = 1 << 26
DENSE_IDS_PER_REQUEST = 4


# --------------------------------------------------------------------------- id -> slot index
# Every kernel finds, adds and removes ids through the three functions below, which take
# either index: the hash table of :mod:`tiered_emb.cache.index` as a tuple ``(keys, vals)`` (ids
# unbounded, memory in proportion to the cache), or a *dense* int32 array ``slot_of`` over
# the id space, -1 where absent (one random access instead of a hashed probe and a key
# compare, and a delete that is one store).  Numba compiles a kernel once per index type,
# so the choice costs nothing per request; the tests run both and compare hit flags.
def _ix_find(ix, key):
    """Slot of ``key`` or -1 (Numba only)."""
    raise NotImplementedError


def _ix_put(ix, key, slot):
    """Add ``key -> slot``; ``key`` must be absent (Numba only)."""
    raise NotImplementedError


def _ix_del(ix, key):
    """Remove ``key``, which must be present (Numba only)."""
    raise NotImplementedError


def _ix_prefetch(ix, key):
    """Start loading the index entry of ``key`` into the cache, without waiting (Numba only)."""
    raise NotImplementedError


@overload(_ix_prefetch)
def _ix_prefetch_impl(ix, key):
    # Why: a request's index entry is a random access into an array of tens of MiB, and
    # whether it hits decides a branch the CPU mispredicts half the time, discarding the
    # loads it had started ahead.  A prefetch issued PREFETCH_AHEAD requests early makes
    # the entry cached by then: 1.5-2x the requests per second at every cache size.
    if isinstance(ix, types.Array):
        return lambda ix, key: _prefetch(ix, key)

    def hashed(ix, key):
        h = _hash_home(key, ix[0].shape[0] - 1)
        _prefetch(ix[0], h)
        _prefetch(ix[1], h)
    return hashed


def _ix_peek(ix, key):
    """Slot of ``key`` from a dense index (a hint: -1 from the hash table) (Numba only)."""
    raise NotImplementedError


@overload(_ix_peek)
def _ix_peek_impl(ix, key):
    # Why: with a dense index, the slot of a request a few ahead (whose entry the prefetch
    # above has brought in) is one cached load, so a kernel can prefetch that slot's policy
    # state too; through the hash table that would cost a second probe, so it does not.
    if isinstance(ix, types.Array):
        return lambda ix, key: np.int64(ix[key])
    return lambda ix, key: np.int64(-1)


@overload(_ix_find)
def _ix_find_impl(ix, key):
    if isinstance(ix, types.Array):
        return lambda ix, key: np.int64(ix[key])
    return lambda ix, key: _index_find(ix[0], ix[1], key)


@overload(_ix_put)
def _ix_put_impl(ix, key, slot):
    if isinstance(ix, types.Array):
        def dense(ix, key, slot):
            ix[key] = slot
        return dense
    return lambda ix, key, slot: _index_put(ix[0], ix[1], key, slot)


@overload(_ix_del)
def _ix_del_impl(ix, key):
    if isinstance(ix, types.Array):
        def dense(ix, key):
            ix[key] = -1
        return dense
    return lambda ix, key: _index_del(ix[0], ix[1], key)


@numba.njit(cache=True)
def _id_range(trace):
    """``(min, max)`` of a non-empty int64 trace in one pass."""
    lo = hi = trace[0]
    for i in range(1, trace.shape[0]):  # min / max, no branch: the loop vectorizes (4x)
        lo = min(lo, trace[i])
        hi = max(hi, trace[i])
    return lo, hi


def id_range(trace: np.ndarray) -> tuple[int, int]:
    """``(min id, max id)`` of ``trace``; ``(0, -1)`` when it is empty."""
    if trace.shape[0] == 0:
        return 0, -1
    lo, hi = _id_range(trace)
    return int(lo), int(hi)


def dense_ok(max_id: int, n_requests: int) -> bool:
    """Whether ids up to ``max_id`` get a dense index: an id space of at most
    :data:`DENSE_MAX_IDS`, or of :data:`DENSE_IDS_PER_REQUEST` ids per request."""
    return max_id < min(max(DENSE_MAX_IDS, DENSE_IDS_PER_REQUEST * n_requests), 2**31 - 1)


# --------------------------------------------------------------------------- scratch arrays
#: Largest scratch array (bytes) a thread keeps for its next run; larger ones are freed.
SCRATCH_KEEP_BYTES = 1 << 28


class _Kept(threading.local):
    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}


_KEPT = _Kept()


@contextmanager
def scratch(role: str, n: int, dtype):
    """An uninitialised ``dtype`` array of ``n`` for one run, given back when the run ends:
    the previous run's of this thread and ``role`` when it is large enough.

    Why: the arrays over the id space (the dense index, Belady's next uses and last
    positions: 40-120 MiB at 10M ids and 20M requests) are the same size run after run, and
    a fresh one is paid for again at its first touch, one page fault per page.  On the
    machine measured that cost 0.02 s for 120 MiB in a quiet process and up to 0.23 s
    after another process had freed a few GiB (Belady at a 0.1 % cache: 0.44 s against
    0.6-0.7 s).  A sweep over policies and sizes now faults them in once.

    An array taken is not in the pool until given back, so two users of one role at once
    each get their own.  Arrays above :data:`SCRATCH_KEEP_BYTES` are not kept.
    """
    dtype = np.dtype(dtype)
    held = _KEPT.arrays.pop(role, None)
    if held is None or held.dtype != dtype or held.shape[0] < n:
        del held  # the old one is freed before the new one is made
        held = np.empty(max(n, 1), dtype=dtype)
    try:
        yield held[:n]
    finally:
        if held.nbytes <= SCRATCH_KEEP_BYTES:
            _KEPT.arrays[role] = held


def release_scratch() -> None:
    """Free the scratch arrays this thread keeps between runs (see :func:`scratch`)."""
    _KEPT.arrays.clear()


# --------------------------------------------------------------------------- next use
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
    # flight (about 8 % faster at 20M requests over 10M ids)
    for i in range(trace.shape[0] - 1, -1, -1):
        if i >= 2 * PREFETCH_AHEAD:
            _prefetch(last, trace[i - 2 * PREFETCH_AHEAD])
        k = trace[i]
        next_use[i] = last[k]
        last[k] = i


def next_use_of(trace: np.ndarray, dtype=np.int64, max_id: int | None = None) -> np.ndarray:
    """Position of each request's next request of the same id, or ``len(trace)`` if none.

    One backward pass over a dense array of last positions when the ids are bounded
    (:func:`dense_ok`), else a stable argsort (O(n log n), seconds at 20M requests).

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
        raise ConfigError(f"dtype={dtype!r} cannot hold the positions of {n} requests",
                          "use np.int64 (or np.int32 below 2**31 requests)")
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


# --------------------------------------------------------------------------- LRU
@numba.njit(cache=True)
def _lru_simulate(trace, capacity, ix, slot_ids, newer, older, hit_flags):
    """LRU over a list of slots (``newer`` / ``older`` int32 (capacity,)).

    The same decisions as the store's kernel (:func:`tiered_emb.cache.slots._simulate_requests`
    with LRU; the tests compare them request by request) with the list ends held in
    locals, which the compiler keeps in registers: several times faster.
    """
    record = hit_flags.shape[0] > 0
    hits = 0
    used = 0
    newest = NIL
    oldest = NIL
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        s = _ix_find(ix, key)
        if s >= 0:
            hits += 1
            if record:
                hit_flags[i] = 1
            if s == newest:
                continue
            a, b = older[s], newer[s]
            if a == NIL:
                oldest = b
            else:
                newer[a] = b
            older[b] = a
        elif used < capacity:
            s = used
            used += 1
            slot_ids[s] = key
            _ix_put(ix, key, s)
        else:
            s = oldest
            oldest = newer[s]
            if oldest != NIL:
                older[oldest] = NIL
            else:
                newest = NIL
            _ix_del(ix, slot_ids[s])
            slot_ids[s] = key
            _ix_put(ix, key, s)
        older[s] = newest
        newer[s] = NIL
        if newest == NIL:
            oldest = s
        else:
            newer[newest] = s
        newest = s
    return hits


# --------------------------------------------------------------------------- LFU
@numba.njit(inline="always")
def _bucket_unlink_item(bk, item, b, s):
    a, c = item[s, 2], item[s, 1]
    if a == NIL:
        bk[b, 2] = c
    else:
        item[a, 1] = c
    if c == NIL:
        bk[b, 1] = a
    else:
        item[c, 2] = a


@numba.njit(inline="always")
def _bucket_append_item(bk, item, b, s):
    t = bk[b, 1]
    item[s, 2] = t
    item[s, 1] = NIL
    if t == NIL:
        bk[b, 2] = s
    else:
        item[t, 1] = s
    bk[b, 1] = s
    item[s, 0] = b


@numba.njit(cache=True)
def _lfu_simulate(trace, capacity, ix, slot_ids, item, bk, bfree, hit_flags):
    """LFU in O(1) per request: buckets of equal use count, in increasing count order.

    A slot's row of ``item`` int32 (capacity, 4) is its bucket and its list links (newer,
    older); a bucket's row of ``bk`` (capacity + 1, 8), int32 for traces under 2**31
    requests, else int64, is its count, its items' newest and oldest slot, and the buckets
    above and below (one row per slot and per bucket: one cache line each, not one per
    field).  Free buckets are on the stack ``bfree``.  Each bucket lists its slots in
    order of last use, so the victim, the oldest slot of the lowest bucket,
    is the store's (lowest count, then least recently used; last uses are unique, so the
    slot tie-break never applies).  Counts restart at 1 on admission, as in the store and
    in libCacheSim.  The tests compare it with the store's kernel request by request.
    """
    record = hit_flags.shape[0] > 0
    hits = 0
    used = 0
    lowest = NIL
    n_bfree = bfree.shape[0]
    deep = capacity > PREFETCH_STATE_MIN
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        if deep and i + PREFETCH_STATE_AHEAD < n:
            t = _ix_peek(ix, trace[i + PREFETCH_STATE_AHEAD])
            if t >= 0:
                _prefetch(item, (t, 0))
        key = trace[i]
        s = _ix_find(ix, key)
        if s >= 0:
            hits += 1
            if record:
                hit_flags[i] = 1
            b = item[s, 0]
            up = bk[b, 3]
            if up == NIL or bk[up, 0] != bk[b, 0] + 1:
                if bk[b, 2] == s and bk[b, 1] == s:
                    bk[b, 0] += 1  # alone in its bucket: the bucket moves up
                    continue
                n_bfree -= 1
                nb = bfree[n_bfree]
                bk[nb, 0] = bk[b, 0] + 1
                bk[nb, 1] = NIL
                bk[nb, 2] = NIL
                bk[nb, 4] = b
                bk[nb, 3] = up
                if up != NIL:
                    bk[up, 4] = nb
                bk[b, 3] = nb
                up = nb
            _bucket_unlink_item(bk, item, b, s)
            _bucket_append_item(bk, item, up, s)
            if bk[b, 2] == NIL:
                d = bk[b, 4]
                bk[up, 4] = d
                if d == NIL:
                    lowest = up
                else:
                    bk[d, 3] = up
                bfree[n_bfree] = b
                n_bfree += 1
            continue
        if used < capacity:
            s = used
            used += 1
        else:
            b = lowest
            s = bk[b, 2]
            _bucket_unlink_item(bk, item, b, s)
            if bk[b, 2] == NIL:
                lowest = bk[b, 3]
                if lowest != NIL:
                    bk[lowest, 4] = NIL
                bfree[n_bfree] = b
                n_bfree += 1
            _ix_del(ix, slot_ids[s])
        slot_ids[s] = key
        _ix_put(ix, key, s)
        if lowest == NIL or bk[lowest, 0] != 1:
            n_bfree -= 1
            nb = bfree[n_bfree]
            bk[nb, 0] = 1
            bk[nb, 1] = NIL
            bk[nb, 2] = NIL
            bk[nb, 4] = NIL
            bk[nb, 3] = lowest
            if lowest != NIL:
                bk[lowest, 4] = nb
            lowest = nb
        _bucket_append_item(bk, item, lowest, s)
    return hits


# --------------------------------------------------------------------------- FIFO
@numba.njit(cache=True)
def _fifo_simulate(trace, capacity, ix, ring, hit_flags):
    """FIFO over a ring of ids (int64 (capacity,)); ``hand`` is the oldest position."""
    record = hit_flags.shape[0] > 0
    hits = 0
    used = 0
    hand = 0
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        if _ix_find(ix, key) >= 0:
            hits += 1
            if record:
                hit_flags[i] = 1
            continue
        if used < capacity:
            pos = used
            used += 1
        else:
            pos = hand
            _ix_del(ix, ring[pos])
            hand += 1
            if hand == capacity:
                hand = 0
        ring[pos] = key
        _ix_put(ix, key, pos)
    return hits


# --------------------------------------------------------------------------- CLOCK
@numba.njit(cache=True)
def _clock_simulate(trace, capacity, ix, ring, ref, hit_flags):
    """CLOCK: ring of ids and reference bits (uint8 (capacity,)).

    Positions from ``hand`` onwards, cyclically, are oldest to newest; a second chance
    passes the hand over an object, which makes it the newest, as libCacheSim's move to
    the head of its list does.
    """
    record = hit_flags.shape[0] > 0
    hits = 0
    used = 0
    hand = 0
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        s = _ix_find(ix, key)
        if s >= 0:
            hits += 1
            ref[s] = 1
            if record:
                hit_flags[i] = 1
            continue
        if used < capacity:
            pos = used
            used += 1
        else:
            while ref[hand]:
                ref[hand] = 0
                hand += 1
                if hand == capacity:
                    hand = 0
            pos = hand
            _ix_del(ix, ring[pos])
            hand += 1
            if hand == capacity:
                hand = 0
        ring[pos] = key
        ref[pos] = 0
        _ix_put(ix, key, pos)
    return hits


# --------------------------------------------------------------------------- SIEVE
@numba.njit(cache=True)
def _sieve_simulate(trace, capacity, ix, slot_ids, newer, older, visited, hit_flags):
    """SIEVE over a list of slots: ``newer`` / ``older`` (int32 (capacity,)) links.

    New objects go to the newest end; the hand walks from the oldest end towards the
    newest, wrapping to the oldest, and is left at the object newer than the victim.
    """
    record = hit_flags.shape[0] > 0
    hits = 0
    used = 0
    newest = NIL
    oldest = NIL
    hand = NIL
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        s = _ix_find(ix, key)
        if s >= 0:
            hits += 1
            visited[s] = 1
            if record:
                hit_flags[i] = 1
            continue
        if used < capacity:
            s = used
            used += 1
        else:
            v = hand if hand != NIL else oldest
            while visited[v]:
                visited[v] = 0
                v = newer[v]
                if v == NIL:
                    v = oldest
            hand = newer[v]
            # unlink v
            a, b = older[v], newer[v]
            if a == NIL:
                oldest = b
            else:
                newer[a] = b
            if b == NIL:
                newest = a
            else:
                older[b] = a
            _ix_del(ix, slot_ids[v])
            s = v
        slot_ids[s] = key
        visited[s] = 0
        older[s] = newest
        newer[s] = NIL
        if newest == NIL:
            oldest = s
        else:
            newer[newest] = s
        newest = s
        _ix_put(ix, key, s)
    return hits


# --------------------------------------------------------------------------- S3-FIFO
@numba.njit(inline="always")
def _ring_push(ring, meta, q, slot):
    """Append ``slot`` to queue ``q`` (meta[q] = [head, size]); ring rows are queues."""
    cap = ring.shape[1]
    pos = meta[q, 0] + meta[q, 1]
    if pos >= cap:
        pos -= cap
    ring[q, pos] = slot
    meta[q, 1] += 1


@numba.njit(inline="always")
def _ring_pop(ring, meta, q):
    """Remove and return the oldest slot of queue ``q``."""
    cap = ring.shape[1]
    slot = ring[q, meta[q, 0]]
    meta[q, 0] += 1
    if meta[q, 0] == cap:
        meta[q, 0] = 0
    meta[q, 1] -= 1
    return slot


@numba.njit(cache=True)
def _s3fifo_simulate(trace, small_cap, main_cap, ghost_cap, threshold, ix, slot_ids,
                     queue_of, freq, ring, qmeta, gids, gnewer, golder, gfree,
                     hit_flags):
    """S3-FIFO.

    Resident slots (``small_cap + main_cap`` of them) hold ``slot_ids``, ``queue_of``
    (0 small, 1 main) and ``freq``; ``ring`` int32 (2, capacity) with ``qmeta`` int64
    (2, 2) are the two FIFO queues.  The ghost is a FIFO list of ids over ``ghost_cap``
    nodes (``gids``, ``gnewer``, ``golder``, free stack ``gfree``), since a ghost hit
    removes an id from its middle.

    One index holds both: a resident id maps to its slot (>= 0), a ghost id to
    ``-2 - node`` (an id is never both: a ghost hit leaves the ghost before it is
    admitted).  Why: a miss must then ask whether the id is a ghost, and a second index
    was a second random access per miss, one the request prefetch does not cover
    (at a 0.1 % cache, half the requests miss: 0.96 s of 20M requests, 0.4 s with one index).
    """
    record = hit_flags.shape[0] > 0
    capacity = small_cap + main_cap
    hits = 0
    used = 0
    has_evicted = False
    g_newest = NIL
    g_oldest = NIL
    g_size = 0
    g_free_n = ghost_cap
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        s = _ix_find(ix, key)
        if s >= 0:
            hits += 1
            freq[s] += 1
            if record:
                hit_flags[i] = 1
            continue
        hit_on_ghost = s <= -2
        if hit_on_ghost:
            g = -2 - s
            _ix_del(ix, key)
            g_newest, g_oldest = _list_unlink(gnewer, golder, g_newest, g_oldest, g)
            gfree[g_free_n] = g
            g_free_n += 1
            g_size -= 1
        if qmeta[0, 1] + qmeta[1, 1] >= capacity:
            has_evicted = True
            if qmeta[1, 1] > main_cap or qmeta[0, 1] == 0:
                # main: a 2-bit clock in FIFO order
                while True:
                    v = _ring_pop(ring, qmeta, 1)
                    if freq[v] >= 1:
                        freq[v] = min(freq[v], 3) - 1
                        _ring_push(ring, qmeta, 1, v)
                    else:
                        _ix_del(ix, slot_ids[v])
                        s = v
                        break
            else:
                while True:
                    v = _ring_pop(ring, qmeta, 0)
                    if freq[v] >= threshold:
                        freq[v] = 0
                        queue_of[v] = 1
                        _ring_push(ring, qmeta, 1, v)
                        if qmeta[0, 1] == 0:
                            # small drained into main: the main clock frees a slot
                            while True:
                                w = _ring_pop(ring, qmeta, 1)
                                if freq[w] >= 1:
                                    freq[w] = min(freq[w], 3) - 1
                                    _ring_push(ring, qmeta, 1, w)
                                else:
                                    _ix_del(ix, slot_ids[w])
                                    s = w
                                    break
                            break
                    else:
                        vid = slot_ids[v]
                        _ix_del(ix, vid)
                        s = v
                        if ghost_cap > 0:
                            if g_size == ghost_cap:
                                g = g_oldest
                                g_oldest = gnewer[g]
                                if g_oldest == NIL:
                                    g_newest = NIL
                                else:
                                    golder[g_oldest] = NIL
                                _ix_del(ix, gids[g])
                                g_size -= 1
                            else:
                                g_free_n -= 1
                                g = gfree[g_free_n]
                            gids[g] = vid
                            golder[g] = g_newest
                            gnewer[g] = NIL
                            if g_newest == NIL:
                                g_oldest = g
                            else:
                                gnewer[g_newest] = g
                            g_newest = g
                            g_size += 1
                            _ix_put(ix, vid, -2 - g)
                        break
        else:
            s = used
            used += 1
        if hit_on_ghost:
            q = 1
        elif not has_evicted and qmeta[0, 1] >= small_cap:
            q = 1
        else:
            q = 0
        slot_ids[s] = key
        queue_of[s] = q
        freq[s] = 0
        _ring_push(ring, qmeta, q, s)
        _ix_put(ix, key, s)
    return hits


# --------------------------------------------------------------------------- ARC
T1 = 0
T2 = 1
B1 = 2
B2 = 3


@numba.njit(inline="always")
def _list_unlink(newer, older, newest, oldest, node):
    """Take ``node`` out of the list ``oldest`` .. ``newest``; returns the new ends."""
    a, b = older[node], newer[node]
    if a == NIL:
        oldest = b
    else:
        newer[a] = b
    if b == NIL:
        newest = a
    else:
        older[b] = a
    return newest, oldest


@numba.njit(inline="always")
def _list_push(newer, older, newest, oldest, node):
    """Append ``node`` at the newest end; returns the new ends."""
    older[node] = newest
    newer[node] = NIL
    if newest == NIL:
        oldest = node
    else:
        newer[newest] = node
    return node, oldest


@numba.njit(inline="always")
def _list_pop(newer, older, newest, oldest):
    """Take the oldest node out; returns it and the new ends."""
    v = oldest
    oldest = newer[v]
    if oldest == NIL:
        newest = NIL
    else:
        older[oldest] = NIL
    return v, newest, oldest


@numba.njit(cache=True)
def _arc_simulate(trace, capacity, ix, node_ids, where, newer, older, free, hit_flags):
    """ARC over ``2 * capacity + 1`` nodes, each in one of T1, T2, B1, B2 (``where`` int8).

    ``newer`` / ``older`` int32 (nodes,) link each list; its newest node, oldest node and
    length are locals (``h1``, ``o1``, ``n1`` for T1, and so on), which the compiler keeps
    in registers.  ``free`` int32 (nodes,) is a stack of unused nodes, all on it at the
    start.  The target size ``p`` of T1 is a float, adapted by ``max(|B2| / |B1|, 1)`` on
    a B1 hit (and the converse on a B2 hit), as in libCacheSim (and the ARC paper's
    reference code).
    """
    record = hit_flags.shape[0] > 0
    hits = 0
    p = 0.0
    n_free = free.shape[0]
    h1 = o1 = h2 = o2 = hb1 = ob1 = hb2 = ob2 = NIL
    n1 = n2 = nb1 = nb2 = 0
    deep = where.shape[0] > PREFETCH_STATE_MIN
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        if deep and i + PREFETCH_STATE_AHEAD < n:
            t = _ix_peek(ix, trace[i + PREFETCH_STATE_AHEAD])
            if t >= 0:
                _prefetch(where, t)
                _prefetch(newer, t)
                _prefetch(older, t)
            # the oldest nodes of T1 and B1 leave next (demoted, forgotten): their
            # successors' links and ids, and the index entry of B1's oldest id
            if o1 != NIL:
                t = newer[o1]
                if t != NIL:
                    _prefetch(newer, t)
                    _prefetch(older, t)
                    _prefetch(where, t)
            if ob1 != NIL:
                _ix_prefetch(ix, node_ids[ob1])
                t = newer[ob1]
                if t != NIL:
                    _prefetch(newer, t)
                    _prefetch(older, t)
                    _prefetch(node_ids, t)
        key = trace[i]
        node = _ix_find(ix, key)
        ghost_hit = False
        in_b2 = False
        if node >= 0:
            lst = where[node]
            if lst == T1 or lst == T2:
                hits += 1
                if record:
                    hit_flags[i] = 1
                if lst == T1:
                    h1, o1 = _list_unlink(newer, older, h1, o1, node)
                    n1 -= 1
                    n2 += 1
                    where[node] = T2
                elif node == h2:
                    continue
                else:
                    h2, o2 = _list_unlink(newer, older, h2, o2, node)
                h2, o2 = _list_push(newer, older, h2, o2, node)
                continue
            ghost_hit = True
            if lst == B1:
                p = min(p + max(nb2 / nb1, 1.0), float(capacity))
                hb1, ob1 = _list_unlink(newer, older, hb1, ob1, node)
                nb1 -= 1
            else:
                in_b2 = True
                p = max(p - max(nb1 / nb2, 1.0), 0.0)
                hb2, ob2 = _list_unlink(newer, older, hb2, ob2, node)
                nb2 -= 1
            _ix_del(ix, key)
            free[n_free] = node
            n_free += 1
        while n1 + n2 + 1 > capacity:
            # forget one node (B1's, T1's or B2's oldest) where the rules say so ...
            drop = NIL
            demote = True
            if not ghost_hit:
                if n1 + nb1 + 1 > capacity:
                    if nb1 > 0:
                        drop = B1
                    else:
                        drop = T1
                        demote = False
                elif n1 + n2 + nb1 + nb2 >= 2 * capacity and nb2 > 0:
                    drop = B2
            if drop != NIL:
                if drop == B1:
                    g, hb1, ob1 = _list_pop(newer, older, hb1, ob1)
                    nb1 -= 1
                elif drop == T1:
                    g, h1, o1 = _list_pop(newer, older, h1, o1)
                    n1 -= 1
                else:
                    g, hb2, ob2 = _list_pop(newer, older, hb2, ob2)
                    nb2 -= 1
                _ix_del(ix, node_ids[g])
                free[n_free] = g
                n_free += 1
            # ... then REPLACE of the ARC paper: demote T1's oldest to B1 or T2's to B2
            if demote:
                if (n1 > 0 and (n1 > p or (n1 == p and in_b2))) or n2 == 0:
                    v, h1, o1 = _list_pop(newer, older, h1, o1)
                    n1 -= 1
                    hb1, ob1 = _list_push(newer, older, hb1, ob1, v)
                    nb1 += 1
                    where[v] = B1
                else:
                    v, h2, o2 = _list_pop(newer, older, h2, o2)
                    n2 -= 1
                    hb2, ob2 = _list_push(newer, older, hb2, ob2, v)
                    nb2 += 1
                    where[v] = B2
        n_free -= 1
        node = free[n_free]
        node_ids[node] = key
        _ix_put(ix, key, node)
        if ghost_hit:
            h2, o2 = _list_push(newer, older, h2, o2, node)
            n2 += 1
            where[node] = T2
        else:
            h1, o1 = _list_push(newer, older, h1, o1, node)
            n1 += 1
            where[node] = T1
    return hits


# --------------------------------------------------------------------------- Belady
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


@numba.njit(cache=True)
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
    it costs one store, and the heap holds only live residents (4x faster at a 10 % cache
    of a Zipf 1.0 trace).  A hit's old key is the current position, the smallest in the
    heap, so its slot is a leaf: a new key only moves it up, and removing it (its last
    request) moves the heap's last entry into the leaf and up.
    """
    record = hit_flags.shape[0] > 0
    hits = 0
    used = 0  # slots handed out
    live = 0  # heap entries
    n_dead = 0
    n = trace.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        s = _ix_find(ix, key)
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
            _ix_del(ix, slot_ids[s])
        else:
            # evict the farthest next use: the root gives way to the new entry if it is
            # live, else to the heap's last entry
            s = heap[0] & 0xFFFFFFFF
            _ix_del(ix, slot_ids[s])
            slot_ids[s] = key
            _ix_put(ix, key, s)
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
        _ix_put(ix, key, s)
        if nu < n:
            heap[live] = (nu << 32) | s
            live += 1
            _opt_sift_up(heap, hpos, live - 1)
        else:
            dead[n_dead] = s
            n_dead += 1
    return hits


# --------------------------------------------------------------------------- drivers
def _flags(n: int, record: bool) -> np.ndarray:
    return np.zeros(n if record else 0, dtype=np.uint8)


@contextmanager
def _state(trace, capacity, index, max_id, entries=None):
    """``(index, id dtype)`` for a kernel run of ``entries`` ids (default ``capacity``), for
    the run's duration (a dense index is a :func:`scratch` array).

    ``index`` is "auto" (dense when :func:`dense_ok`), "dense" or "hash"; ``max_id`` is
    the trace's largest id when the caller knows it.  Ids are kept as int32 beside a dense
    index (they fit), as int64 beside the hash table.
    """
    entries = capacity if entries is None else entries
    if index != "hash" and max_id is None:
        max_id = id_range(trace)[1]
    if index == "hash" or not (index == "dense" or dense_ok(max_id, trace.shape[0])):
        yield new_index(entries), np.int64  # the store's hash table (keys, vals)
        return
    with scratch("index", max(max_id + 1, 1), np.int32) as ix:
        ix.fill(-1)
        yield ix, np.int32


def lru_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    with _state(trace, capacity, index, max_id) as (ix, idt):
        return _lru_simulate(trace, capacity, ix, np.empty(capacity, idt),
                             np.full(capacity, NIL, np.int32), np.full(capacity, NIL, np.int32), hit_flags)


def lfu_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    with _state(trace, capacity, index, max_id) as (ix, idt):
        nb = capacity + 1
        bk = np.full((nb, 8), NIL, np.int32 if trace.shape[0] < 2**31 else np.int64)
        bk[:, 0] = 0
        return _lfu_simulate(trace, capacity, ix, np.empty(capacity, idt), np.full((capacity, 4), NIL, np.int32), bk,
                             np.arange(nb - 1, -1, -1, dtype=np.int32), hit_flags)


def fifo_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    with _state(trace, capacity, index, max_id) as (ix, idt):
        return _fifo_simulate(trace, capacity, ix, np.empty(capacity, idt), hit_flags)


def clock_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    with _state(trace, capacity, index, max_id) as (ix, idt):
        return _clock_simulate(trace, capacity, ix, np.empty(capacity, idt),
                               np.zeros(capacity, np.uint8), hit_flags)


def sieve_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    with _state(trace, capacity, index, max_id) as (ix, idt):
        return _sieve_simulate(trace, capacity, ix, np.empty(capacity, idt),
                               np.full(capacity, NIL, np.int32), np.full(capacity, NIL, np.int32),
                               np.zeros(capacity, np.uint8), hit_flags)


def s3fifo_sizes(capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9) -> tuple[int, int, int]:
    """``(small, main, ghost)`` object counts, computed as libCacheSim does (C doubles cast
    to int64), except that the small queue holds at least one object.  ``small_ratio`` is
    in [0, 1] and ``ghost_ratio`` finite and >= 0 (a :class:`ConfigError` otherwise)."""
    small_ratio = finite_arg("small_ratio", small_ratio, 0.0, "give small_ratio in [0, 1]")
    ghost_ratio = finite_arg("ghost_ratio", ghost_ratio, 0.0, "give a finite ghost_ratio >= 0")
    if small_ratio > 1:
        raise ConfigError(f"small_ratio={small_ratio!r} is invalid", "give small_ratio in [0, 1]")
    small = max(int(capacity * small_ratio), 1) if capacity > 1 else 0
    return small, capacity - small, int(capacity * ghost_ratio)


def s3fifo_hits(trace, capacity, hit_flags, index="auto", max_id=None, small_ratio=0.1, ghost_ratio=0.9, threshold=2):
    small, main, ghost = s3fifo_sizes(capacity, small_ratio, ghost_ratio)
    gcap = max(ghost, 1)
    with _state(trace, capacity, index, max_id, capacity + ghost) as (ix, idt):
        return _s3fifo_simulate(trace, small, main, ghost, threshold, ix,
                                np.empty(capacity, idt), np.zeros(capacity, np.uint8),
                                np.zeros(capacity, np.int64), np.empty((2, capacity), np.int32),
                                np.zeros((2, 2), np.int64), np.empty(gcap, idt),
                                np.full(gcap, NIL, np.int32), np.full(gcap, NIL, np.int32),
                                np.arange(gcap - 1, -1, -1, dtype=np.int32), hit_flags)


def arc_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    nodes = 2 * capacity + 1
    with _state(trace, capacity, index, max_id, nodes) as (ix, idt):
        return _arc_simulate(trace, capacity, ix, np.empty(nodes, idt),
                             np.zeros(nodes, np.int8), np.full(nodes, NIL, np.int32),
                             np.full(nodes, NIL, np.int32), np.arange(nodes - 1, -1, -1, dtype=np.int32),
                             hit_flags)


def belady_hits(trace, capacity, hit_flags, next_use=None, index="auto", max_id=None):
    """Belady's hits; ``next_use`` (from :func:`next_use_of`) is computed when not given (``max_id``:
    the largest id when the caller knows it and has checked the ids are >= 0)."""
    if next_use is None:
        n = trace.shape[0]
        with scratch("next_use", n, np.int32 if n < 2**31 else np.int64) as nu:
            _next_use_into(trace, nu, max_id)
            return belady_hits(trace, capacity, hit_flags, nu, index, max_id)
    with _state(trace, capacity, index, max_id) as (ix, idt):
        return _belady_simulate(trace, next_use, capacity, ix, np.empty(capacity, idt), np.empty(capacity, np.int64),
                                np.empty(capacity, np.int32), np.empty(capacity, np.int32), hit_flags)
