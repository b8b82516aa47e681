"""LFU: a binary min-heap over slots keyed by (use count, last use, slot).

Every tie is explicit: lowest count first, then least recently used, then lowest slot.
Counts belong to residents: an evicted id starts again at 1 when it returns (as in
libCacheSim's LFU), so the state scales with the tier, not with the id space.
State layout: :mod:`tiered_emb.cache.policies._state`.
"""

from __future__ import annotations

import numba

from tiered_emb.cache.policies._state import COUNT, HEAP, HEAP_SIZE, HPOS, LAST


@numba.njit(inline="always")
def _lfu_less(P, a, b):
    count, last = P[COUNT], P[LAST]
    if P[count + a] != P[count + b]:
        return P[count + a] < P[count + b]
    if P[last + a] != P[last + b]:
        return P[last + a] < P[last + b]
    return a < b


@numba.njit(inline="always")
def _lfu_sift_up(P, i):
    heap, hpos = P[HEAP], P[HPOS]
    s = P[heap + i]
    while i > 0:
        parent = (i - 1) >> 1
        p = P[heap + parent]
        if not _lfu_less(P, s, p):
            break
        P[heap + i] = p
        P[hpos + p] = i
        i = parent
    P[heap + i] = s
    P[hpos + s] = i


@numba.njit(inline="always")
def lfu_sift_down(P, i):
    heap, hpos = P[HEAP], P[HPOS]
    n = P[HEAP_SIZE]
    s = P[heap + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _lfu_less(P, P[heap + c + 1], P[heap + c]):
            c += 1
        hc = P[heap + c]
        if not _lfu_less(P, hc, s):
            break
        P[heap + i] = hc
        P[hpos + hc] = i
        i = c
    P[heap + i] = s
    P[hpos + s] = i


@numba.njit(inline="always")
def lfu_attach(P, slot):
    """Insert ``slot`` with its current (count, last use)."""
    i = P[HEAP_SIZE]
    P[HEAP_SIZE] = i + 1
    P[P[HEAP] + i] = slot
    P[P[HPOS] + slot] = i
    _lfu_sift_up(P, i)


@numba.njit(inline="always")
def lfu_detach(P, slot):
    """Remove ``slot`` from the heap."""
    heap, hpos = P[HEAP], P[HPOS]
    i = P[hpos + slot]
    n = P[HEAP_SIZE] - 1
    P[HEAP_SIZE] = n
    P[hpos + slot] = -1
    if i == n:
        return
    moved = P[heap + n]
    P[heap + i] = moved
    P[hpos + moved] = i
    _lfu_sift_up(P, i)
    lfu_sift_down(P, P[hpos + moved])


@numba.njit(inline="always")
def lfu_victim(P):
    """Detach and return the slot with the smallest (count, last use, slot), or -1."""
    if P[HEAP_SIZE] == 0:
        return -1
    slot = P[P[HEAP]]
    lfu_detach(P, slot)
    return slot
