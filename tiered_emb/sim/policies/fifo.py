"""FIFO: evict the oldest insertion; hits change nothing (libCacheSim ``FIFO``).

The twin of the store's FIFO (:mod:`tiered_emb.cache.policies.queue`).  A hit changes nothing, so the order of
insertion is never rearranged: a ring of ids is the whole state, and the victim is always
at the hand, which moves one place per eviction.

>>> import numpy as np
>>> fifo_hits(np.array([1, 2, 1, 3, 1]), 2, np.zeros(0, np.uint8))
1
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._jit import kernel
from tiered_emb.sim.policies.base import ix_del, ix_put, lookup
from tiered_emb.sim.policies.buffers import kernel_state


@numba.njit(inline="always")
def ring_admit(ix, ring, key, used, hand, capacity):
    """Put ``key`` in the next unused position of ``ring``, or once all are used, in place
    of the oldest, at ``hand``, which moves on one; returns ``(pos, used, hand)``.

    FIFO's whole miss, and CLOCK's once its hand has skipped the referenced positions.
    """
    if used < capacity:
        pos = used
        used += 1
    else:
        pos = hand
        ix_del(ix, ring[pos])
        hand += 1
        if hand == capacity:
            hand = 0
    ring[pos] = key
    ix_put(ix, key, pos)
    return pos, used, hand


@kernel
def _fifo_simulate(trace, capacity, ix, ring, hit_flags):
    """FIFO over a ring of ids ((capacity,), the index's id dtype); ``hand`` is the oldest position."""
    hits = 0
    used = 0
    hand = 0
    for i in range(trace.shape[0]):
        key, s = lookup(ix, trace, i)
        if s < 0:
            _, used, hand = ring_admit(ix, ring, key, used, hand, capacity)
            continue
        hits += 1
        if hit_flags.shape[0] > 0:  # written out: flag_hit here kept a refcount in the loop
            hit_flags[i] = 1
    return hits


def fifo_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    """Hits of FIFO.

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    with kernel_state(trace, capacity, index, max_id) as (ix, idt):
        return _fifo_simulate(trace, capacity, ix, np.empty(capacity, idt), hit_flags)
