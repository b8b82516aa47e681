"""LRU: a doubly linked list over slots, least recent at the head.

Only *attached* (unpinned) slots are in the list.  A slot is attached when the batch
that used it releases it, in the batch's first-occurrence order, so list order is the
order of last use and ties cannot arise.
"""
from __future__ import annotations

import numba

from ._state import HEAD, NIL, TAIL


@numba.njit(inline="always")
def _lru_attach(P, slot):
    """Append ``slot`` at the most recent end."""
    prev, nxt, meta = P[0], P[1], P[6]
    tail = meta[TAIL]
    prev[slot] = tail
    nxt[slot] = NIL
    if tail == NIL:
        meta[HEAD] = slot
    else:
        nxt[tail] = slot
    meta[TAIL] = slot


@numba.njit(inline="always")
def _lru_detach(P, slot):
    """Unlink ``slot`` from the list."""
    prev, nxt, meta = P[0], P[1], P[6]
    p = prev[slot]
    n = nxt[slot]
    if p == NIL:
        meta[HEAD] = n
    else:
        nxt[p] = n
    if n == NIL:
        meta[TAIL] = p
    else:
        prev[n] = p
    prev[slot] = NIL
    nxt[slot] = NIL


@numba.njit(inline="always")
def _lru_victim(P):
    """Detach and return the least recently used slot, or -1 when none is attached."""
    slot = P[6][HEAD]
    if slot != NIL:
        _lru_detach(P, slot)
    return slot
