"""ARC in the store: T1 (seen once) and T2 (seen again) of resident slots, B1 and B2 of ghost ids.

The decisions of libCacheSim's ``ARC.c`` (the ARC paper's reference), one request at a
time, as the simulator's :mod:`tiered_emb.sim.policies.arc` makes them (``tests/cache``
checks the two request by request).  A use moves a slot to T2's newest end.  A missed id
that is a ghost of B1 grows T1's target ``p`` by ``max(|B2| / |B1|, 1)`` (one of B2
shrinks it by ``max(|B1| / |B2|, 1)``), leaves its ghost list and enters T2; any other id
enters T1.  A victim is needed when the tier is full: first, for an id that was no ghost,
a ghost is forgotten where the rules say so (B1's oldest when ``|T1| + |B1|`` reaches
the capacity, T1's oldest evicted outright when B1 is empty; B2's oldest when all four
lists hold twice the capacity); then REPLACE: T1's oldest becomes a ghost of B1 when
``|T1| > p`` (or ``= p`` for a ghost of B2) or T2 is empty, else T2's oldest one of B2.

Pins: a pinned slot stays on its list with a pin bit; a victim search passes it over,
making it the newest of its list.  When every slot of the list searched is pinned the
other list gives the victim (its id a ghost of that list's ghost list); -1 when both are.

``p`` is a float64 (its bits in ``P[ARC_P]``).  ``BITS`` per slot: ``PIN`` (2), ``IN_T2`` (4).
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._jit import kernel
from tiered_emb.cache.policies._lists import list_push, list_unlink
from tiered_emb.cache.policies._state import (
    ARC_P,
    BITS,
    CAPACITY,
    G0,
    G1,
    GHOST_HIT,
    GWHERE,
    IN_B2,
    MLEN,
    MNEWEST,
    NEWER,
    NEWEST,
    NIL,
    OLDER,
    QLEN,
)
from tiered_emb.cache.policies.ghost import ghost_add, ghost_find, ghost_forget, ghost_forget_oldest

PIN = 2
IN_T2 = 4


@numba.njit(inline="always")
def _p(P):
    """T1's target size, as a one-element float64 view of ``P``."""
    return P[ARC_P : ARC_P + 1].view(np.float64)


@kernel
def arc_use(P, slot):
    """One more use of a resident slot: the newest of T2."""
    newer, older, i = P[NEWER], P[OLDER], P[BITS] + slot
    b = P[i]
    if b & IN_T2:
        if P[MNEWEST] == slot:
            return
        list_unlink(P, newer, older, MNEWEST, slot)
    else:
        list_unlink(P, newer, older, NEWEST, slot)
        P[i] = b | IN_T2
    list_push(P, newer, older, MNEWEST, slot)


@kernel
def arc_admit(P, key):
    """``key`` misses and is about to take a slot: a ghost of B1 or B2 adapts ``p`` and is
    forgotten, noting where it was."""
    node = ghost_find(P, key)
    if node < 0:
        return
    P[GHOST_HIT] = 1
    nb1, nb2 = P[G0 + 2], P[G1 + 2]
    p = _p(P)
    if P[P[GWHERE] + node] == 0:
        p[0] = min(p[0] + max(nb2 / nb1, 1.0), float(P[CAPACITY]))
    else:
        P[IN_B2] = 1
        p[0] = max(p[0] - max(nb1 / nb2, 1.0), 0.0)
    ghost_forget(P, node)


@kernel
def arc_fresh(P, slot):
    """``slot`` took the id of the last admit: the newest of T2 for a ghost, of T1 otherwise; pinned."""
    if P[GHOST_HIT] != 0:
        P[P[BITS] + slot] = PIN | IN_T2
        list_push(P, P[NEWER], P[OLDER], MNEWEST, slot)
    else:
        P[P[BITS] + slot] = PIN
        list_push(P, P[NEWER], P[OLDER], NEWEST, slot)
    P[GHOST_HIT] = 0
    P[IN_B2] = 0


@kernel
def arc_remove(P, slot):
    """``slot``'s row left the tier (taken up): off its list, no ghost."""
    i = P[BITS] + slot
    list_unlink(P, P[NEWER], P[OLDER], MNEWEST if P[i] & IN_T2 else NEWEST, slot)
    P[i] = 0


@kernel
def _evict_oldest(P, h, slot_ids, ghosts):
    """The oldest unpinned slot of list ``h``, off it; its id the newest ghost of list
    ``ghosts`` (none when -1).  -1 when every slot of ``h`` is pinned."""
    newer, older, bits = P[NEWER], P[OLDER], P[BITS]
    for _ in range(P[h + 2]):
        v = P[h + 1]
        list_unlink(P, newer, older, h, v)
        if P[bits + v] & PIN:
            list_push(P, newer, older, h, v)
            continue
        P[bits + v] = 0
        if ghosts != NIL:
            ghost_add(P, ghosts, slot_ids[v])
        return v
    return NIL


@kernel
def arc_victim(P, slot_ids):
    """Take the victim off its list and return its slot, or -1 when every slot is pinned."""
    c = P[CAPACITY]
    n1, n2, nb1, nb2 = P[QLEN], P[MLEN], P[G0 + 2], P[G1 + 2]
    if P[GHOST_HIT] == 0:
        if n1 + nb1 + 1 > c:
            if nb1 > 0:
                ghost_forget_oldest(P, G0)
            else:
                v = _evict_oldest(P, NEWEST, slot_ids, NIL)
                if v == NIL:
                    v = _evict_oldest(P, MNEWEST, slot_ids, G1)
                return v
        elif n1 + n2 + nb1 + nb2 >= 2 * c and nb2 > 0:
            ghost_forget_oldest(P, G1)
    p = _p(P)[0]
    if (n1 > 0 and (n1 > p or (n1 == p and P[IN_B2] != 0))) or n2 == 0:
        v = _evict_oldest(P, NEWEST, slot_ids, G0)
        if v == NIL:
            v = _evict_oldest(P, MNEWEST, slot_ids, G1)
        return v
    v = _evict_oldest(P, MNEWEST, slot_ids, G1)
    if v == NIL:
        v = _evict_oldest(P, NEWEST, slot_ids, G0)
    return v
