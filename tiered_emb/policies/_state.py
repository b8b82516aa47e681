"""Policy state: one tuple of preallocated arrays per cache tier, shared by all policies.

``P = (prev, nxt, count, last, heap, hpos, meta)``

- ``prev``, ``nxt``: int32 (capacity,), LRU links (``NIL`` = -1).
- ``count``: int64 (capacity,), uses since admission.
- ``last``: int64 (capacity,), logical time of the last use (unique per use).
- ``heap``, ``hpos``: int32 (capacity,), LFU heap of slots and each slot's position.
- ``meta``: int64 (8,), scalars: see the index constants below.

Allocating the arrays of the policies not in use costs a few bytes per row and keeps one
kernel signature for every policy.
"""
from __future__ import annotations

import numpy as np

NIL = -1
# meta fields
CLOCK = 0
HEAD = 1
TAIL = 2
HEAP_SIZE = 3


def new_policy_state(capacity_rows: int) -> tuple:
    cap = max(int(capacity_rows), 1)
    meta = np.zeros(8, dtype=np.int64)
    meta[HEAD] = NIL
    meta[TAIL] = NIL
    return (np.full(cap, NIL, np.int32), np.full(cap, NIL, np.int32), np.zeros(cap, np.int64),
            np.zeros(cap, np.int64), np.zeros(cap, np.int32), np.full(cap, -1, np.int32), meta)
