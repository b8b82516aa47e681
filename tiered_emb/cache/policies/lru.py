"""LRU: an append-only ring of (slot, generation) entries, least recent at the head.

Attaching a slot appends an entry stamped with a fresh generation of the slot;
detaching bumps the slot's generation, which makes its entry stale.  The live entries,
read from the head, are the attached slots in the order they were attached: the order of
last use, as a doubly linked list would keep it, but a use is one sequential write
instead of four random ones.  The victim is the first live entry from the head; stale
entries are skipped once.  When the ring is full, live entries are compacted to its
front, in order; the ring holds 2 * capacity + 16 entries, so compaction runs at most
once per ``capacity`` uses (amortised O(1)).

Only *attached* (unpinned) slots are live.  A slot is attached when the batch that used
it releases it, in the batch's first-occurrence order, so ties cannot arise.
State layout: :mod:`tiered_emb.cache.policies._state`.
"""

from __future__ import annotations

import numba

from tiered_emb._jit import kernel, prefetch_hint
from tiered_emb.cache.policies._state import GEN, HEAD, RGEN, RING, RING_LEN, TAIL


@kernel
def _lru_compact(P):
    """Move the live entries to the front of the ring, keeping their order (a kernel of
    its own: the ring fills once in many attaches, and the hot loops stay small)."""
    ring, rgen, gen = P[RING], P[RGEN], P[GEN]
    w = 0
    for r in range(P[HEAD], P[TAIL]):
        s = P[ring + r]
        if P[rgen + r] == P[gen + s]:
            P[ring + w] = s
            P[rgen + w] = P[rgen + r]
            w += 1
    P[HEAD] = 0
    P[TAIL] = w


@numba.njit(inline="always")
def lru_attach(P, slot):
    """Make ``slot`` the most recently used candidate (inlined by Numba, not left to LLVM:
    LLVM 22 (llvmlite 0.50, Numba 0.68) keeps it a call of its own in the tier kernels)."""
    if P[TAIL] == P[RING_LEN]:
        _lru_compact(P)
    gi = P[GEN] + slot
    g = P[gi] + 1
    P[gi] = g
    t = P[TAIL]
    P[P[RING] + t] = slot
    P[P[RGEN] + t] = g
    P[TAIL] = t + 1


@numba.njit(inline="never")
def lru_detach(P, slot):
    """Stop ``slot`` being a candidate (its ring entry goes stale)."""
    P[P[GEN] + slot] += 1


@numba.njit(inline="never")
def lru_victim(P):
    """Detach and return the least recently used attached slot, or -1 when none is attached."""
    ring, rgen, gen = P[RING], P[RGEN], P[GEN]
    h = P[HEAD]
    t = P[TAIL]
    while h < t:
        s = P[ring + h]
        live = P[rgen + h] == P[gen + s]
        h += 1
        if live:
            P[HEAD] = h
            P[gen + s] += 1
            return s
    P[HEAD] = h
    return -1


@numba.njit(inline="never")
def lru_upcoming(P, ahead):
    """The slot of the ring entry ``ahead`` past the head (the victim that many victims on
    when no entry between is stale), its generation fetched; -1 past the tail.  A hint for
    prefetching: nothing changes."""
    r = P[HEAD] + ahead
    if r >= P[TAIL]:
        return -1
    s = P[P[RING] + r]
    prefetch_hint(P, P[GEN] + s)
    return s
