"""CLOCK: FIFO with one reference bit, set on a hit (libCacheSim ``Clock``, 1-bit counter).

The hand clears set bits (a second chance) and evicts the first clear one.  No store
policy: a simulator-only baseline.

>>> import numpy as np
>>> clock_hits(np.array([1, 2, 1, 3, 1]), 2, np.zeros(0, np.uint8))
2
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb.sim.policies.base import PREFETCH_AHEAD, ix_del, ix_find, ix_prefetch, ix_put
from tiered_emb.sim.policies.buffers import kernel_state


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
            ix_prefetch(ix, trace[i + PREFETCH_AHEAD])
        key = trace[i]
        s = ix_find(ix, key)
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
            ix_del(ix, ring[pos])
            hand += 1
            if hand == capacity:
                hand = 0
        ring[pos] = key
        ref[pos] = 0
        ix_put(ix, key, pos)
    return hits


def clock_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    """Hits of CLOCK.

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    with kernel_state(trace, capacity, index, max_id) as (ix, idt):
        return _clock_simulate(trace, capacity, ix, np.empty(capacity, idt), np.zeros(capacity, np.uint8), hit_flags)
