"""Policy state: one flat int64 array per cache tier.

``P`` is a single preallocated int64 array: a 48-entry header, then the regions of its
policy.  One array (not a tuple of arrays) on purpose: Numba increments and decrements
the reference count of every array of a tuple each time an inlined helper takes the
tuple apart, on every policy operation; one array costs nothing (measured: docs/lab.md).

Header (indices): scalars ``USE_CLOCK``, ``HEAD``, ``TAIL``, ``HEAP_SIZE``, ``HAND``; lists
as triples (newest, oldest, length) at ``NEWEST`` (the one list of FIFO, CLOCK and SIEVE;
S3-FIFO's small queue; ARC's T1), ``MNEWEST`` (S3-FIFO's main queue; ARC's T2), ``G0``
and ``G1`` (ghost lists: S3-FIFO's ghost; ARC's B1 and B2); then the offset of each
region, read as ``P[P[REGION] + i]``.  Only the tier's policy's regions are allocated (the
others are empty, their offsets the array's end):

- LRU: ``RING``, ``RGEN`` (2 * capacity + 16 each), its ring of (slot, generation), and
  ``GEN`` (capacity), the current generation of each slot: 40 bytes a slot;
- LFU: ``COUNT`` (uses since admission), ``LAST`` (logical time of the last use, unique
  per use), ``HEAP`` and ``HPOS`` (its heap of slots, each slot's position): 32 bytes;
- FIFO, CLOCK, SIEVE: ``NEWER``, ``OLDER`` (the list's links), ``BITS``: 24 bytes;
- S3-FIFO and ARC: those three, and a pool of ghost nodes (ids of evicted rows, no row):
  ``GIDS``, ``GNEWER``, ``GOLDER``, ``GWHERE`` (its list), ``GFREE`` (free nodes), and an
  id -> node hash (``GKEYS``, ``GVALS``, ``GTABLE`` entries; :mod:`tiered_emb.cache.index`):
  24 bytes a slot, and 72-104 a ghost node (40 its own, 2-4 hash entries of 16), of which
  S3-FIFO has 0.9 a slot and ARC one (and 2 more).
"""

from __future__ import annotations

import numpy as np

from tiered_emb._backend import host_full
from tiered_emb.cache.index import EMPTY, table_size_for

NIL = -1
USE_CLOCK = 0  # LFU: the logical time of the last use
HEAD = 1  # LRU ring: first entry not yet consumed
TAIL = 2  # LRU ring: next entry to write
HEAP_SIZE = 3
NEWEST = 4  # a list's triple: newest, oldest, length (FIFO, CLOCK, SIEVE; S3-FIFO small; ARC T1)
OLDEST = 5
QLEN = 6
HAND = 7  # SIEVE's hand
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
MNEWEST = 19  # the second list's triple (19-21): S3-FIFO main, ARC T2
MLEN = 21
G0 = 22  # ghost lists' triples: S3-FIFO's ghost and ARC's B1 (22-24), ARC's B2 (25-27)
G1 = 25
SMALL_CAP = 28  # S3-FIFO: the small queue's and the main queue's sizes, the ghost's
MAIN_CAP = 29
GHOST_CAP = 30
EVICTED = 31  # S3-FIFO: 1 once a victim was taken (its warm-up rule)
GHOST_HIT = 32  # the id being admitted was a ghost (set by its admit, cleared by fresh)
IN_B2 = 33  # ARC: ... a ghost of B2
ARC_P = 34  # ARC: T1's target size, a float64's bits
CAPACITY = 35
GFREE_N = 36  # free ghost nodes
GIDS = 37
GNEWER = 38
GOLDER = 39
GWHERE = 40
GFREE = 41
GKEYS = 42
GVALS = 43
GTABLE = 44  # entries of the ghost hash
HEADER = 48
#: The codes of S3-FIFO and ARC (LRU 0, LFU 1, FIFO 2, CLOCK 3, SIEVE 4).
S3FIFO_CODE = 5
ARC_CODE = 6


def s3fifo_sizes(capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9) -> tuple[int, int, int]:
    """``(small, main, ghost)`` object counts of S3-FIFO over ``capacity`` objects, computed
    as libCacheSim does (C doubles cast to int64), except that the small queue holds at
    least one object.

    >>> s3fifo_sizes(100)
    (10, 90, 90)
    """
    small = max(int(capacity * small_ratio), 1) if capacity > 1 else 0
    return small, capacity - small, int(capacity * ghost_ratio)


def new_policy_state(capacity_rows: int, code: int) -> np.ndarray:
    """The state of a tier of ``capacity_rows`` under the policy of ``code`` (0 LRU, 1 LFU,
    2-6 FIFO, CLOCK, SIEVE, S3-FIFO, ARC): its regions allocated, every other region empty."""
    cap = max(int(capacity_rows), 1)
    ring = 2 * cap + 16
    lists = [(NEWER, cap), (OLDER, cap), (BITS, cap)]
    small, main, ghost = s3fifo_sizes(int(capacity_rows))
    nodes = {S3FIFO_CODE: max(ghost, 1), ARC_CODE: cap + 2}.get(code, 0)
    table = table_size_for(nodes) if nodes else 0
    ghosts = [(GIDS, nodes), (GNEWER, nodes), (GOLDER, nodes), (GWHERE, nodes), (GFREE, nodes)]
    regions = {
        0: [(RING, ring), (RGEN, ring), (GEN, cap)],
        1: [(COUNT, cap), (LAST, cap), (HEAP, cap), (HPOS, cap)],
        S3FIFO_CODE: [*lists, *ghosts, (GKEYS, table), (GVALS, table)],
        ARC_CODE: [*lists, *ghosts, (GKEYS, table), (GVALS, table)],
    }
    sizes = regions.get(code, lists)
    P = host_full(HEADER + sum(n for _, n in sizes), np.int64, 0)
    for field in (RING, RGEN, GEN, COUNT, LAST, HEAP, HPOS, NEWER, OLDER, BITS, GIDS, GNEWER, GOLDER, GWHERE, GFREE):
        P[field] = P.shape[0]  # (empty)
    P[GKEYS] = P[GVALS] = P.shape[0]
    at = HEADER
    for field, n in sizes:
        P[field] = at
        at += n
    P[RING_LEN] = ring
    for triple in (NEWEST, MNEWEST, G0, G1):
        P[triple] = P[triple + 1] = NIL
    P[HAND] = NIL
    if code == 1:
        P[P[HPOS] : P[HPOS] + cap] = -1
    if nodes:
        P[SMALL_CAP], P[MAIN_CAP], P[GHOST_CAP] = small, main, ghost
        P[CAPACITY] = int(capacity_rows)
        P[GTABLE] = table
        P[P[GKEYS] : P[GKEYS] + table] = EMPTY
        P[P[GFREE] : P[GFREE] + nodes] = np.arange(nodes - 1, -1, -1)
        P[GFREE_N] = nodes
    return P
