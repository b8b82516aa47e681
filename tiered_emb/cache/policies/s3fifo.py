"""S3-FIFO in the store: a small FIFO queue, a main queue under a 2-bit clock, a ghost queue of ids.

The decisions of libCacheSim's ``S3FIFO.c`` (0.3.x), one request at a time, as the
simulator's :mod:`tiered_emb.sim.policies.s3fifo` makes them (``tests/cache`` checks
the two request by request): a missed id enters small (main when it is a ghost, or
while small is full before the first eviction); a use adds one to the slot's count
(at most 3).  A victim comes from main when main holds more than its share or small is
empty: from main's oldest, a slot with uses left loses one and becomes the newest, the
first with none is evicted.  Otherwise from small's oldest: a slot used twice or more
moves to main with its count cleared (and when that empties small, main gives the
victim), the first other one is evicted and its id becomes the newest ghost (the oldest
ghost forgotten when the ghost queue is full).

Pins: a pinned slot stays in its queue with a pin bit; a victim search passes it over,
making it the newest of its queue with its count as it was.  When every slot of the
queue searched is pinned the other queue is searched; -1 when both are.

Sizes: :func:`~tiered_emb.cache.policies._state.s3fifo_sizes` (small 10 %, main the
rest, ghost 90 % of the capacity).  ``BITS`` per slot: ``PIN`` (2), ``IN_MAIN`` (4), the
count in bits 3-4.
"""

from __future__ import annotations

import numba

from tiered_emb._jit import kernel
from tiered_emb.cache.policies._lists import list_push, list_unlink
from tiered_emb.cache.policies._state import (
    BITS,
    EVICTED,
    G0,
    GHOST_CAP,
    GHOST_HIT,
    MAIN_CAP,
    MLEN,
    MNEWEST,
    NEWER,
    NEWEST,
    NIL,
    OLDER,
    QLEN,
    SMALL_CAP,
)
from tiered_emb.cache.policies.ghost import ghost_add, ghost_find, ghost_forget, ghost_forget_oldest

PIN = 2
IN_MAIN = 4
FREQ_SHIFT = 3
FREQ_ONE = 1 << FREQ_SHIFT
FREQ_MASK = 3 << FREQ_SHIFT
#: Uses in small that move a slot to main.
PROMOTE_USES = 2


@numba.njit(inline="never")
def _queue(b):
    """The header triple of the queue a slot of bits ``b`` is on."""
    return MNEWEST if b & IN_MAIN else NEWEST


@kernel
def s3fifo_use(P, slot):
    """One more use of a resident slot: its count up by one, at most 3."""
    i = P[BITS] + slot
    b = P[i]
    if b & FREQ_MASK != FREQ_MASK:
        P[i] = b + FREQ_ONE


@kernel
def s3fifo_admit(P, key):
    """``key`` misses and is about to take a slot: forget its ghost, noting that it was one."""
    node = ghost_find(P, key)
    if node >= 0:
        ghost_forget(P, node)
        P[GHOST_HIT] = 1


@kernel
def s3fifo_fresh(P, slot):
    """``slot`` took the id of the last admit: the newest of small (of main for a ghost, or
    while small is full before the first eviction), no use counted, pinned."""
    if P[GHOST_HIT] != 0 or (P[EVICTED] == 0 and P[QLEN] >= P[SMALL_CAP]):
        P[P[BITS] + slot] = PIN | IN_MAIN
        list_push(P, P[NEWER], P[OLDER], MNEWEST, slot)
    else:
        P[P[BITS] + slot] = PIN
        list_push(P, P[NEWER], P[OLDER], NEWEST, slot)
    P[GHOST_HIT] = 0


@kernel
def s3fifo_remove(P, slot):
    """``slot``'s row left the tier (taken up): out of its queue, no ghost."""
    i = P[BITS] + slot
    list_unlink(P, P[NEWER], P[OLDER], _queue(P[i]), slot)
    P[i] = 0


@kernel
def _main_victim(P):
    """Main's clock: the first unpinned slot with no use left, from the oldest; -1: all pinned."""
    newer, older, bits = P[NEWER], P[OLDER], P[BITS]
    for _ in range(4 * P[MLEN] + 1):
        v = P[MNEWEST + 1]
        if v == NIL:
            return NIL
        list_unlink(P, newer, older, MNEWEST, v)
        b = P[bits + v]
        if b & PIN == 0 and b & FREQ_MASK == 0:
            P[bits + v] = 0
            return v
        if b & PIN == 0:
            P[bits + v] = b - FREQ_ONE
        list_push(P, newer, older, MNEWEST, v)
    return NIL


@kernel
def _small_victim(P, slot_ids):
    """From small's oldest: promote the used, evict (and ghost) the first other; -1 when
    every slot left in small is pinned and main gives none either."""
    newer, older, bits = P[NEWER], P[OLDER], P[BITS]
    passed = 0
    while P[QLEN] > passed:
        v = P[NEWEST + 1]
        list_unlink(P, newer, older, NEWEST, v)
        b = P[bits + v]
        if b & PIN:
            list_push(P, newer, older, NEWEST, v)
            passed += 1
            continue
        if (b >> FREQ_SHIFT) & 3 >= PROMOTE_USES:
            P[bits + v] = IN_MAIN
            list_push(P, newer, older, MNEWEST, v)
            if P[QLEN] == 0:
                return _main_victim(P)
            continue
        P[bits + v] = 0
        if P[GHOST_CAP] > 0:
            if P[G0 + 2] == P[GHOST_CAP]:
                ghost_forget_oldest(P, G0)
            ghost_add(P, G0, slot_ids[v])
        return v
    return NIL


@kernel
def s3fifo_victim(P, slot_ids):
    """Take the victim out of its queue and return its slot, or -1 when every slot is pinned."""
    P[EVICTED] = 1
    if P[MLEN] > P[MAIN_CAP] or P[QLEN] == 0:
        v = _main_victim(P)
        if v == NIL:
            v = _small_victim(P, slot_ids)
        return v
    v = _small_victim(P, slot_ids)
    if v == NIL:
        v = _main_victim(P)
    return v
