"""Policy state: one flat int64 array per cache tier, shared by all policies.

``P`` is a single preallocated int64 array: a 16-entry header, then the regions of
every policy.  One array (not a tuple of arrays) on purpose: Numba increments and
decrements the reference count of every array of a tuple each time an inlined helper
takes the tuple apart, which cost ~110 ns per policy operation; one array costs nothing.

Header (indices): scalars ``CLOCK``, ``HEAD``, ``TAIL``, ``HEAP_SIZE``; then the offset of
each region, read as ``P[P[REGION] + i]``:

- ``RING``, ``RGEN`` (2 * capacity + 16 each): LRU's ring of (slot, generation);
- ``GEN`` (capacity): LRU's current generation of each slot;
- ``COUNT`` (capacity): uses since admission;
- ``LAST`` (capacity): logical time of the last use (unique per use);
- ``HEAP``, ``HPOS`` (capacity each): LFU's heap of slots and each slot's position.
"""

from __future__ import annotations

import numpy as np

from tiered_emb._backend import host_full

NIL = -1
CLOCK = 0
HEAD = 1  # LRU ring: first entry not yet consumed
TAIL = 2  # LRU ring: next entry to write
HEAP_SIZE = 3
RING = 8
RGEN = 9
GEN = 10
COUNT = 11
LAST = 12
HEAP = 13
HPOS = 14
RING_LEN = 15
HEADER = 16


def new_policy_state(capacity_rows: int) -> np.ndarray:
    cap = max(int(capacity_rows), 1)
    ring = 2 * cap + 16
    sizes = [(RING, ring), (RGEN, ring), (GEN, cap), (COUNT, cap), (LAST, cap), (HEAP, cap), (HPOS, cap)]
    P = host_full(HEADER + 2 * ring + 5 * cap, np.int64, 0)
    at = HEADER
    for field, n in sizes:
        P[field] = at
        at += n
    P[RING_LEN] = ring
    P[P[HPOS] : P[HPOS] + cap] = -1
    return P
