"""CLOCK: FIFO with one reference bit, set on a hit (libCacheSim ``Clock``, 1-bit counter).

The hand clears set bits (a second chance) and evicts the first clear one.  The twin of
the store's CLOCK (:mod:`tiered_emb.cache.policies.queue`).

>>> import numpy as np
>>> clock_hits(np.array([1, 2, 1, 3, 1]), 2, np.zeros(0, np.uint8))
2
"""

from __future__ import annotations

import numpy as np

from tiered_emb._jit import kernel
from tiered_emb.sim.policies.base import flag_hit, lookup
from tiered_emb.sim.policies.buffers import kernel_state
from tiered_emb.sim.policies.fifo import ring_admit


@kernel
def _clock_simulate(trace, capacity, ix, ring, ref, hit_flags):
    """CLOCK: ring of ids and reference bits (uint8 (capacity,)).

    Positions from ``hand`` onwards, cyclically, are oldest to newest; a second chance
    passes the hand over an object, which makes it the newest, as libCacheSim's move to
    the head of its list does.
    """
    hits = 0
    used = 0
    hand = 0
    for i in range(trace.shape[0]):
        key, s = lookup(ix, trace, i)
        if s >= 0:
            ref[s] = 1
            hits += 1
            flag_hit(hit_flags, i)
            continue
        if used == capacity:
            # second chances: clear the referenced bits the hand passes, up to a clear one
            while ref[hand]:
                ref[hand] = 0
                hand += 1
                if hand == capacity:
                    hand = 0
        pos, used, hand = ring_admit(ix, ring, key, used, hand, capacity)
        ref[pos] = 0
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
