"""S3-FIFO: small FIFO (10 %), main FIFO (90 %) with a 2-bit clock, ghost FIFO of ids (90 %).

The variant of libCacheSim 0.3.x (``S3FIFO.c``), including its warm-up rule: objects
admitted before the first eviction go to main once small is full.  Twin of the store's
S3-FIFO (:mod:`tiered_emb.cache.policies.s3fifo`), whose queue sizes it shares.

>>> s3fifo_sizes(100)
(10, 90, 90)
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from tiered_emb._args import finite_arg
from tiered_emb._jit import kernel
from tiered_emb.cache.policies import s3fifo_sizes as store_sizes
from tiered_emb.errors import ConfigError
from tiered_emb.sim.policies.base import NIL, flag_hit, ix_del, ix_put, list_unlink, lookup
from tiered_emb.sim.policies.buffers import kernel_state


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


class _Resident(NamedTuple):
    """The resident slots and their two FIFO queues (small 0, main 1)."""

    slot_ids: np.ndarray  # the id in each slot
    queue_of: np.ndarray  # uint8: the queue of each slot
    freq: np.ndarray  # int64: uses since admitted (main: the clock's 2 bits)
    ring: np.ndarray  # int32 (2, capacity): each queue's slots, oldest first from its head
    qmeta: np.ndarray  # int64 (2, 2): each queue's [head, size]


class _Ghost(NamedTuple):
    """The ghost FIFO: a list of ids over ``ghost_cap`` nodes (a ghost hit removes an id from
    its middle) and the stack of free nodes."""

    gids: np.ndarray
    gnewer: np.ndarray  # int32: the next newer node (NIL: none)
    golder: np.ndarray  # int32: the next older node
    gfree: np.ndarray  # int32: free nodes (a stack)


@kernel
def _s3fifo_simulate(trace, sizes, ix, resident, ghost, hit_flags):
    """S3-FIFO.

    ``sizes`` = ``(small_cap, main_cap, ghost_cap, threshold)``; ``small_cap + main_cap``
    resident slots (:class:`_Resident`) and a ghost list of ``ghost_cap`` nodes
    (:class:`_Ghost`).

    One index holds both: a resident id maps to its slot (>= 0), a ghost id to
    ``-2 - node`` (an id is never both: a ghost hit leaves the ghost before it is
    admitted).  Why: a miss must ask whether the id is a ghost, and a second index would
    be a second random access per miss, one the request prefetch does not cover.
    """
    small_cap, main_cap, ghost_cap, threshold = sizes
    slot_ids, queue_of, freq, ring, qmeta = resident
    gids, gnewer, golder, gfree = ghost
    capacity = small_cap + main_cap
    hits = 0
    used = 0
    has_evicted = False
    g_newest = NIL
    g_oldest = NIL
    g_size = 0
    g_free_n = ghost_cap
    for i in range(trace.shape[0]):
        key, s = lookup(ix, trace, i)
        if s >= 0:
            freq[s] += 1
            hits += 1
            flag_hit(hit_flags, i)
            continue
        hit_on_ghost = s <= -2
        if hit_on_ghost:
            g = -2 - s
            ix_del(ix, key)
            g_newest, g_oldest = list_unlink(gnewer, golder, g_newest, g_oldest, g)
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
                        ix_del(ix, slot_ids[v])
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
                                    ix_del(ix, slot_ids[w])
                                    s = w
                                    break
                            break
                    else:
                        vid = slot_ids[v]
                        ix_del(ix, vid)
                        s = v
                        if ghost_cap > 0:
                            if g_size == ghost_cap:
                                g = g_oldest
                                g_oldest = gnewer[g]
                                if g_oldest == NIL:
                                    g_newest = NIL
                                else:
                                    golder[g_oldest] = NIL
                                ix_del(ix, gids[g])
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
                            ix_put(ix, vid, -2 - g)
                        break
        else:
            s = used
            used += 1
        if hit_on_ghost or (not has_evicted and qmeta[0, 1] >= small_cap):
            q = 1
        else:
            q = 0
        slot_ids[s] = key
        queue_of[s] = q
        freq[s] = 0
        _ring_push(ring, qmeta, q, s)
        ix_put(ix, key, s)
    return hits


def s3fifo_sizes(capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9) -> tuple[int, int, int]:
    """``(small, main, ghost)`` object counts, as the store's S3-FIFO sizes its queues
    (:func:`tiered_emb.cache.policies.s3fifo_sizes`).  ``small_ratio`` is in [0, 1] and
    ``ghost_ratio`` finite and >= 0 (a :class:`ConfigError` otherwise)."""
    small_ratio = finite_arg("small_ratio", small_ratio, 0.0, "give small_ratio in [0, 1]")
    ghost_ratio = finite_arg("ghost_ratio", ghost_ratio, 0.0, "give a finite ghost_ratio >= 0")
    if small_ratio > 1:
        raise ConfigError(f"small_ratio={small_ratio!r} is invalid", "give small_ratio in [0, 1]")
    return store_sizes(capacity, small_ratio, ghost_ratio)


def s3fifo_hits(trace, capacity, hit_flags, index="auto", max_id=None, small_ratio=0.1, ghost_ratio=0.9, threshold=2):
    """Hits of S3-FIFO with queues of :func:`s3fifo_sizes`; ``threshold``: uses in small
    that promote an object to main.

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    small, main, ghost = s3fifo_sizes(capacity, small_ratio, ghost_ratio)
    gcap = max(ghost, 1)
    with kernel_state(trace, capacity, index, max_id, capacity + ghost) as (ix, idt):
        resident = _Resident(
            np.empty(capacity, idt),
            np.zeros(capacity, np.uint8),
            np.zeros(capacity, np.int64),
            np.empty((2, capacity), np.int32),
            np.zeros((2, 2), np.int64),
        )
        ghosts = _Ghost(
            np.empty(gcap, idt),
            np.full(gcap, NIL, np.int32),
            np.full(gcap, NIL, np.int32),
            np.arange(gcap - 1, -1, -1, dtype=np.int32),
        )
        sizes = (int(small), int(main), int(ghost), threshold)
        return _s3fifo_simulate(trace, sizes, ix, resident, ghosts, hit_flags)
