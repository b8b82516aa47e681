"""Eviction policies of the cache tiers, chosen by name.

A policy is data: an entry of :data:`POLICIES` maps a name to a small integer code, and
the tier kernels dispatch on that code (Numba compiles one kernel; no jitclass, no Python
object in the hot loop).  Each policy supplies these operations on its state ``P``, one
flat int64 array (see :mod:`tiered_emb.cache.policies._state`):

- ``fresh(slot)``: the slot took an id (not a candidate until attached);
- ``attach(slot)``: the slot becomes a candidate for eviction (released by its batch);
- ``detach(slot)``: the slot stops being a candidate (pinned by a batch);
- ``remove(slot)``: the slot's row left the tier (taken up into HBM);
- ``admit(id)``: ``id`` missed and is about to take a slot (S3-FIFO and ARC ask whether it
  is a ghost; the others do nothing);
- ``victim(slot_ids)``: remove and return the next slot to evict (S3-FIFO and ARC keep
  its id, ``slot_ids[slot]``, as a ghost);
- ``hit(slot)`` / ``touch(slot)``: one more use of a candidate / of a pinned slot.

LRU and LFU keep only candidates (a pinned slot is out of the ring or heap, and attaching
it again is its use); FIFO, CLOCK and SIEVE keep every slot in insertion order and pin a
slot with a bit (:mod:`.queue`), as do S3-FIFO (:mod:`.s3fifo`) and ARC (:mod:`.arc`),
over two lists of slots and a pool of ghost ids (:mod:`.ghost`).  Their operations are
compiled functions the kernels call, where the others' are inlined: inlined at every
call site of every tier kernel, their larger bodies made the first run's compilation
several times longer (CHANGELOG.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from tiered_emb._jit import prefetch_hint
from tiered_emb.cache.policies._state import (  # noqa: F401
    ARC_CODE,
    COUNT,
    GEN,
    HPOS,
    LAST,
    S3FIFO_CODE,
    USE_CLOCK,
    new_policy_state,
    s3fifo_sizes,
)
from tiered_emb.cache.policies.arc import arc_admit, arc_fresh, arc_remove, arc_use, arc_victim
from tiered_emb.cache.policies.lfu import lfu_attach, lfu_detach, lfu_sift_down, lfu_victim
from tiered_emb.cache.policies.lru import lru_attach, lru_detach, lru_upcoming, lru_victim
from tiered_emb.cache.policies.queue import (
    CLOCK,
    FIFO,
    SIEVE,
    queue_attach,
    queue_detach,
    queue_insert,
    queue_prefetch,
    queue_remove,
    queue_use,
    queue_victim,
)
from tiered_emb.cache.policies.s3fifo import s3fifo_admit, s3fifo_fresh, s3fifo_remove, s3fifo_use, s3fifo_victim

LRU = 0
LFU = 1
S3FIFO = S3FIFO_CODE
ARC = ARC_CODE


@dataclass(frozen=True)
class PolicySpec:
    code: int
    summary: str
    lookahead: bool = False  # rows of prefetched batches are pinned as soon as they enter the window


_BASE = {
    "lru": PolicySpec(LRU, "least recently used first"),
    "lfu": PolicySpec(LFU, "lowest use count first, then least recently used, then lowest slot"),
    "fifo": PolicySpec(FIFO, "first in, first out; a use changes nothing"),
    "clock": PolicySpec(CLOCK, "FIFO with a reference bit: a used row gets a second chance"),
    "sieve": PolicySpec(SIEVE, "a visited bit and a hand from old to new; nothing moves on a use"),
    "s3fifo": PolicySpec(S3FIFO, "a small FIFO, a main FIFO with a 2-bit clock, a ghost queue of evicted ids"),
    "arc": PolicySpec(ARC, "recency and frequency lists, their split adapted by ghosts of evicted ids"),
}
#: The policies by name, without their ``lookahead+`` forms (in the order above).
BASE_POLICIES: tuple[str, ...] = tuple(_BASE)
POLICIES: dict[str, PolicySpec] = {
    **_BASE,
    **{
        f"lookahead+{name}": PolicySpec(
            spec.code, f"rows needed within the prefetch window kept; others by {name}", True
        )
        for name, spec in _BASE.items()
    },
}


@numba.njit(inline="always")
def policy_attach(code, P, slot):
    if code == LRU:
        lru_attach(P, slot)
    elif code == LFU:
        lfu_attach(P, slot)
    else:
        queue_attach(P, slot)


@numba.njit(inline="always")
def policy_detach(code, P, slot):
    if code == LRU:
        lru_detach(P, slot)
    elif code == LFU:
        lfu_detach(P, slot)
    else:
        queue_detach(P, slot)


@numba.njit(inline="always")
def policy_remove(code, P, slot, pinned):
    """``slot``'s row leaves the tier (``pinned``: detached already)."""
    if code == S3FIFO:
        s3fifo_remove(P, np.int64(slot))
    elif code == ARC:
        arc_remove(P, np.int64(slot))
    elif code > LFU:
        queue_remove(P, slot)
    elif not pinned:
        policy_detach(code, P, slot)


@numba.njit(inline="always")
def policy_admit(code, P, key):
    """``key`` missed and is about to take a slot (free or a victim's): before
    :func:`policy_victim` and :func:`policy_fresh`."""
    if code == S3FIFO:
        s3fifo_admit(P, np.int64(key))
    elif code == ARC:
        arc_admit(P, np.int64(key))


@numba.njit(inline="always")
def policy_victim(code, P, slot_ids):
    """Remove and return the next slot to evict, or -1 when every slot is pinned."""
    if code == LRU:
        return lru_victim(P)
    if code == LFU:
        return lfu_victim(P)
    if code == S3FIFO:
        return s3fifo_victim(P, slot_ids)
    if code == ARC:
        return arc_victim(P, slot_ids)
    return queue_victim(code, P)


@numba.njit(inline="always")
def policy_upcoming(code, P, ahead):
    """A slot likely to be the victim ``ahead`` victims on, or -1 where the policy cannot
    tell cheaply (LFU: its heap's order below the root; the list policies: their bits):
    a hint, nothing changes."""
    if code != LRU:
        return -1
    return lru_upcoming(P, ahead)


@numba.njit(inline="always")
def policy_prefetch(code, P, slot):
    """Fetch the policy state of ``slot`` a detach or touch will change: a hint, nothing changes."""
    if code == LRU:
        prefetch_hint(P, P[GEN] + slot)
    elif code == LFU:
        prefetch_hint(P, P[HPOS] + slot)
    else:
        queue_prefetch(P, slot)


@numba.njit(inline="always")
def policy_hit(code, P, slot):
    """One more use of an attached (unpinned) slot: the single-request fast path.

    Equivalent to detach, touch, attach; cheaper: LRU appends one ring entry, LFU sifts
    the slot down (its key only grew), the list policies set a bit.
    """
    policy_touch(code, P, slot)
    if code == LRU:
        lru_attach(P, slot)  # appending makes the slot's older entry stale
    elif code == LFU:
        lfu_sift_down(P, P[P[HPOS] + slot])


@numba.njit(inline="always")
def policy_touch(code, P, slot):
    """Record one more use of a resident slot (LFU's count and last use, CLOCK's and SIEVE's
    bit; LRU's order is its ring, placed when the slot is attached)."""
    if code == LRU:
        return
    if code == S3FIFO:
        s3fifo_use(P, np.int64(slot))
        return
    if code == ARC:
        arc_use(P, np.int64(slot))
        return
    if code != LFU:
        queue_use(code, P, slot)
        return
    c = P[USE_CLOCK] + 1
    P[USE_CLOCK] = c
    P[P[COUNT] + slot] += 1
    P[P[LAST] + slot] = c


@numba.njit(inline="always")
def policy_fresh(code, P, slot):
    """A newly admitted slot: LFU's one use now; the list policies' newest, pinned until attached."""
    if code == LRU:
        return
    if code == S3FIFO:
        s3fifo_fresh(P, np.int64(slot))
        return
    if code == ARC:
        arc_fresh(P, np.int64(slot))
        return
    if code != LFU:
        queue_insert(P, slot)
        return
    c = P[USE_CLOCK] + 1
    P[USE_CLOCK] = c
    P[P[COUNT] + slot] = 1
    P[P[LAST] + slot] = c
