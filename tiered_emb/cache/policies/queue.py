"""FIFO, CLOCK and SIEVE: the insertion-order policies, over one doubly linked list of slots.

A slot joins the newest end when it takes an id (:func:`queue_insert`) and leaves the list
only as a victim or when its row is taken out of the tier (:func:`queue_remove`).  A use
moves nothing: CLOCK and SIEVE set the slot's reference bit, FIFO keeps none.  The
victim, one request at a time, is each policy's as in libCacheSim (and the simulator's
:mod:`tiered_emb.sim.policies`, which ``tests/cache/test_policy_contract.py`` checks
request by request):

- FIFO: the oldest;
- CLOCK: from the oldest, a slot with its bit set has the bit cleared and becomes the
  newest (a second chance), the first with a clear bit is evicted;
- SIEVE: from the hand (the oldest when it has none), set bits are cleared and passed
  over without moving, the first clear one is evicted and the hand stays at the slot
  newer than it (wrapping to the oldest past the newest).

Pins: a batch's pinned slot stays in the list with a pin bit (detach / attach set and
clear it), so a pin never changes a slot's age.  A victim search passes a pinned slot
over: FIFO and CLOCK make it the newest, as a second chance (so a search never walks the
same pinned slots twice); SIEVE's hand moves past it, its bit as it was.  A search that
finds every slot pinned returns -1.

State: ``P[NEWEST]``, ``P[OLDEST]``, ``P[HAND]`` (-1: none), ``P[QLEN]`` (slots in the list), and
per slot ``NEWER`` / ``OLDER`` links and ``BITS`` (``REF`` 1, ``PIN`` 2);
:mod:`tiered_emb.cache.policies._state`.
"""

from __future__ import annotations

import numba

from tiered_emb._jit import prefetch_hint
from tiered_emb.cache.policies._lists import list_push, list_unlink
from tiered_emb.cache.policies._state import BITS, HAND, NEWER, NEWEST, NIL, OLDER, OLDEST, QLEN

FIFO = 2
CLOCK = 3
SIEVE = 4
REF = 1
PIN = 2


@numba.njit(inline="always")
def _unlink(P, s):
    list_unlink(P, P[NEWER], P[OLDER], NEWEST, s)


@numba.njit(inline="always")
def _push(P, s):
    list_push(P, P[NEWER], P[OLDER], NEWEST, s)


@numba.njit(inline="always")
def queue_insert(P, slot):
    """``slot`` took an id: the newest, its bit clear, pinned until :func:`queue_attach`."""
    P[P[BITS] + slot] = PIN
    _push(P, slot)


@numba.njit(inline="always")
def queue_attach(P, slot):
    """``slot`` is a candidate again (its batch released it): the pin bit cleared."""
    P[P[BITS] + slot] &= ~PIN


@numba.njit(inline="always")
def queue_detach(P, slot):
    """``slot`` is pinned by a batch: never a victim until attached; its age stays."""
    P[P[BITS] + slot] |= PIN


@numba.njit(inline="always")
def queue_use(code, P, slot):
    """One more use of a resident slot: CLOCK's and SIEVE's bit set; FIFO notes nothing."""
    if code != FIFO:
        P[P[BITS] + slot] |= REF


@numba.njit(inline="always")
def queue_remove(P, slot):
    """``slot``'s row left the tier (taken up): out of the list, the hand moved past it."""
    if P[HAND] == slot:
        P[HAND] = P[P[NEWER] + slot]
    _unlink(P, slot)
    P[P[BITS] + slot] = 0


@numba.njit(inline="always")
def queue_victim(code, P):
    """Take the victim out of the list and return its slot, or -1 when every slot is pinned."""
    bits, newer = P[BITS], P[NEWER]
    if code == SIEVE:
        v = P[HAND] if P[HAND] != NIL else P[OLDEST]
        for _ in range(2 * P[QLEN] + 1):  # (a first pass may only clear bits)
            if v == NIL:
                return NIL
            b = P[bits + v]
            if b == 0:
                P[HAND] = P[newer + v]
                _unlink(P, v)
                return v
            if b & PIN == 0:
                P[bits + v] = 0
            v = P[newer + v]
            if v == NIL:
                v = P[OLDEST]
        return NIL
    for _ in range(2 * P[QLEN] + 1):
        v = P[OLDEST]
        if v == NIL:
            return NIL
        b = P[bits + v]
        if b == 0 or (code == FIFO and b & PIN == 0):
            _unlink(P, v)
            return v
        # a second chance: the newest, its reference bit cleared (a pinned slot's kept)
        if b & PIN == 0:
            P[bits + v] = 0
        _unlink(P, v)
        _push(P, v)
    return NIL


@numba.njit(inline="always")
def queue_prefetch(P, slot):
    """Fetch the bits of ``slot`` a use or a pin will change: a hint, nothing changes."""
    prefetch_hint(P, P[BITS] + slot)
