"""What every simulator kernel shares: the id -> slot index, list links, prefetch distances.

The kernels of :mod:`tiered_emb.sim.policies` take either index through the ``ix_*``
functions below (Numba overloads, compiled once per index type), start each request with
:func:`lookup` (or :func:`prefetch_ahead`) and :func:`flag_hit`, which prefetch the
requests to come :data:`PREFETCH_AHEAD` ahead, and link their lists with
:func:`list_push` / :func:`list_unlink` / :func:`list_pop`.

>>> import numpy as np
>>> id_range(np.array([5, 2, 9]))
(2, 9)
>>> dense_ok(10**6, 10)
True
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from tiered_emb._jit import prefetch_hint
from tiered_emb.cache.index import hash_home, index_del, index_find, index_put

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


# Every kernel finds, adds and removes ids through the three functions below, which take
# either index: the hash table of :mod:`tiered_emb.cache.index` as a tuple ``(keys, vals)`` (ids
# unbounded, memory in proportion to the cache), or a *dense* int32 array ``slot_of`` over
# the id space, -1 where absent (one random access instead of a hashed probe and a key
# compare, and a delete that is one store).  Numba compiles a kernel once per index type,
# so the choice costs nothing per request; the tests run both and compare hit flags.
def ix_find(ix, key):
    """Slot of ``key`` or -1 (Numba only)."""
    raise NotImplementedError


def ix_put(ix, key, slot):
    """Add ``key -> slot``; ``key`` must be absent (Numba only)."""
    raise NotImplementedError


def ix_del(ix, key):
    """Remove ``key``, which must be present (Numba only)."""
    raise NotImplementedError


def ix_prefetch(ix, key):
    """Start loading the index entry of ``key`` into the cache, without waiting (Numba only)."""
    raise NotImplementedError


@overload(ix_prefetch)
def _ix_prefetch_impl(ix, key):
    # Why: a request's index entry is a random access into an array of tens of MiB, and
    # whether it hits decides a branch the CPU mispredicts half the time, discarding the
    # loads it had started ahead.  A prefetch issued PREFETCH_AHEAD requests early makes
    # the entry cached by then.
    if isinstance(ix, types.Array):
        return lambda ix, key: prefetch_hint(ix, key)

    def hashed(ix, key):
        h = hash_home(key, ix[0].shape[0] - 1)
        prefetch_hint(ix[0], h)
        prefetch_hint(ix[1], h)

    return hashed


def ix_peek(ix, key):
    """Slot of ``key`` from a dense index (a hint: -1 from the hash table) (Numba only)."""
    raise NotImplementedError


@overload(ix_peek)
def _ix_peek_impl(ix, key):
    # Why: with a dense index, the slot of a request a few ahead (whose entry the prefetch
    # above has brought in) is one cached load, so a kernel can prefetch that slot's policy
    # state too; through the hash table that would cost a second probe, so it does not.
    if isinstance(ix, types.Array):
        return lambda ix, key: np.int64(ix[key])
    return lambda ix, key: np.int64(-1)


@overload(ix_find)
def _ix_find_impl(ix, key):
    if isinstance(ix, types.Array):
        return lambda ix, key: np.int64(ix[key])
    return lambda ix, key: index_find(ix[0], ix[1], key)


@overload(ix_put)
def _ix_put_impl(ix, key, slot):
    if isinstance(ix, types.Array):

        def dense(ix, key, slot):
            ix[key] = slot

        return dense
    return lambda ix, key, slot: index_put(ix[0], ix[1], key, slot)


@overload(ix_del)
def _ix_del_impl(ix, key):
    if isinstance(ix, types.Array):

        def dense(ix, key):
            ix[key] = -1

        return dense
    return lambda ix, key: index_del(ix[0], ix[1], key)


# --------------------------------------------------------------------------- the request loop
# Every kernel walks the trace one request at a time and starts each the same way.  The
# helpers below are inlined (``inline="always"``) so the compiled loop is the one written
# out by hand (``hit_flags.shape[0]``, a kernel argument, is a loop invariant).  The
# kernels are :func:`tiered_emb._jit.kernel`s: compiled without reference counts, so an
# array handed from one helper to another costs nothing in the loop (a kernel that
# counted them paid an atomic update per request for some such handings).
@numba.njit(inline="always")
def prefetch_ahead(ix, trace, i, deep):
    """Prefetch the index entry of request ``i + PREFETCH_AHEAD``; when ``deep``, also
    return the slot of request ``i + PREFETCH_STATE_AHEAD`` from a dense index (:func:`ix_peek`),
    for the caller to prefetch that slot's policy state, else -1."""
    n = trace.shape[0]
    if i + PREFETCH_AHEAD < n:
        ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
    if deep and i + PREFETCH_STATE_AHEAD < n:
        return ix_peek(ix, trace[i + PREFETCH_STATE_AHEAD])
    return np.int64(NIL)


@numba.njit(inline="always")
def flag_hit(hit_flags, i):
    """Flag request ``i`` a hit when the caller records hits (``hit_flags`` not empty)."""
    if hit_flags.shape[0] > 0:
        hit_flags[i] = 1


@numba.njit(inline="always")
def lookup(ix, trace, i):
    """Start request ``i``: prefetch the index entry of the one :data:`PREFETCH_AHEAD` on,
    and find its key.  Returns ``(key, slot)``, ``slot`` < 0 when absent."""
    if i + PREFETCH_AHEAD < trace.shape[0]:
        ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
    key = trace[i]
    return key, ix_find(ix, key)


@numba.njit(cache=True)
def _id_range(trace):
    """``(min, max)`` of a non-empty int64 trace in one pass."""
    lo = hi = trace[0]
    for i in range(1, trace.shape[0]):  # min / max, no branch: the loop vectorizes
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


# --------------------------------------------------------------------------- doubly linked lists
# A list is two int32 arrays of links (``newer`` / ``older``, NIL at the ends) and its two
# ends, kept by the caller in locals (registers); each function returns the new ends.
@numba.njit(inline="always")
def list_unlink(newer, older, newest, oldest, node):
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
def list_push(newer, older, newest, oldest, node):
    """Append ``node`` at the newest end; returns the new ends."""
    older[node] = newest
    newer[node] = NIL
    if newest == NIL:
        oldest = node
    else:
        newer[newest] = node
    return node, oldest


@numba.njit(inline="always")
def list_pop(newer, older, newest, oldest):
    """Take the oldest node out; returns it and the new ends."""
    v = oldest
    oldest = newer[v]
    if oldest == NIL:
        newest = NIL
    else:
        older[oldest] = NIL
    return v, newest, oldest
