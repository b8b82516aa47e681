"""Policy state: one flat int64 array per cache tier.

``P`` is a single preallocated int64 array: a 24-entry header, then the regions of its
policy.  One array (not a tuple of arrays) on purpose: Numba increments and decrements
the reference count of every array of a tuple each time an inlined helper takes the
tuple apart, on every policy operation; one array costs nothing (measured: CHANGELOG.md).

Header (indices): scalars ``USE_CLOCK``, ``HEAD``, ``TAIL``, ``HEAP_SIZE``, ``NEWEST``,
``OLDEST``, ``HAND``, ``QLEN``; then the offset of each region, read as ``P[P[REGION] + i]``.
Only the tier's policy's regions are allocated (the others are empty, their offsets the
array's end):

- LRU: ``RING``, ``RGEN`` (2 * capacity + 16 each), its ring of (slot, generation), and
  ``GEN`` (capacity), the current generation of each slot: 40 bytes a slot;
- LFU: ``COUNT`` (uses since admission), ``LAST`` (logical time of the last use, unique
  per use), ``HEAP`` and ``HPOS`` (its heap of slots, each slot's position): 32 bytes;
- FIFO, CLOCK, SIEVE: ``NEWER``, ``OLDER`` (the list's links), ``BITS``: 24 bytes.
"""

from __future__ import annotations

import numpy as np

from tiered_emb._backend import host_full

NIL = -1
USE_CLOCK = 0  # LFU: the logical time of the last use
HEAD = 1  # LRU ring: first entry not yet consumed
TAIL = 2  # LRU ring: next entry to write
HEAP_SIZE = 3
NEWEST = 4  # FIFO, CLOCK, SIEVE: the list's ends, SIEVE's hand, the list's length
OLDEST = 5
HAND = 6
QLEN = 7
RING = 8
RGEN = 9
GEN = 10
COUNT = 11
LAST = 12
HEAP = 13
HPOS = 14
RING_LEN = 15
NEWER = 16
OLDER = 17
BITS = 18
HEADER = 24


def new_policy_state(capacity_rows: int, code: int) -> np.ndarray:
    """The state of a tier of ``capacity_rows`` under the policy of ``code`` (0 LRU, 1 LFU,
    2-4 FIFO, CLOCK, SIEVE): its regions allocated, every other region empty."""
    cap = max(int(capacity_rows), 1)
    ring = 2 * cap + 16
    regions = {0: [(RING, ring), (RGEN, ring), (GEN, cap)], 1: [(COUNT, cap), (LAST, cap), (HEAP, cap), (HPOS, cap)]}
    sizes = regions.get(code, [(NEWER, cap), (OLDER, cap), (BITS, cap)])
    P = host_full(HEADER + sum(n for _, n in sizes), np.int64, 0)
    for field in (RING, RGEN, GEN, COUNT, LAST, HEAP, HPOS, NEWER, OLDER, BITS):
        P[field] = P.shape[0]  # (empty)
    at = HEADER
    for field, n in sizes:
        P[field] = at
        at += n
    P[RING_LEN] = ring
    P[NEWEST] = P[OLDEST] = P[HAND] = NIL
    if code == 1:
        P[P[HPOS] : P[HPOS] + cap] = -1
    return P
