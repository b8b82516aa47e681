"""LFU: a binary min-heap over slots keyed by (use count, last use, slot).

Every tie is explicit: lowest count first, then least recently used, then lowest slot.
Counts belong to residents: an evicted id starts again at 1 when it returns (as in
libCacheSim's LFU), so the state scales with the tier, not with the id space.
"""
from __future__ import annotations

import numba

from ._state import HEAP_SIZE


@numba.njit(inline="always")
def _lfu_less(P, a, b):
    count, last = P[2], P[3]
    if count[a] != count[b]:
        return count[a] < count[b]
    if last[a] != last[b]:
        return last[a] < last[b]
    return a < b


@numba.njit(inline="always")
def _lfu_sift_up(P, i):
    heap, hpos = P[4], P[5]
    s = heap[i]
    while i > 0:
        parent = (i - 1) >> 1
        p = heap[parent]
        if not _lfu_less(P, s, p):
            break
        heap[i] = p
        hpos[p] = i
        i = parent
    heap[i] = s
    hpos[s] = i


@numba.njit(inline="always")
def _lfu_sift_down(P, i):
    heap, hpos, meta = P[4], P[5], P[6]
    n = meta[HEAP_SIZE]
    s = heap[i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _lfu_less(P, heap[c + 1], heap[c]):
            c += 1
        if not _lfu_less(P, heap[c], s):
            break
        heap[i] = heap[c]
        hpos[heap[c]] = i
        i = c
    heap[i] = s
    hpos[s] = i


@numba.njit(inline="always")
def _lfu_attach(P, slot):
    """Insert ``slot`` with its current (count, last use)."""
    meta = P[6]
    i = meta[HEAP_SIZE]
    meta[HEAP_SIZE] = i + 1
    P[4][i] = slot
    P[5][slot] = i
    _lfu_sift_up(P, i)


@numba.njit(inline="always")
def _lfu_detach(P, slot):
    """Remove ``slot`` from the heap."""
    heap, hpos, meta = P[4], P[5], P[6]
    i = hpos[slot]
    n = meta[HEAP_SIZE] - 1
    meta[HEAP_SIZE] = n
    hpos[slot] = -1
    if i == n:
        return
    moved = heap[n]
    heap[i] = moved
    hpos[moved] = i
    _lfu_sift_up(P, i)
    _lfu_sift_down(P, hpos[moved])


@numba.njit(inline="always")
def _lfu_victim(P):
    """Detach and return the slot with the smallest (count, last use, slot), or -1."""
    if P[6][HEAP_SIZE] == 0:
        return -1
    slot = P[4][0]
    _lfu_detach(P, slot)
    return slot
