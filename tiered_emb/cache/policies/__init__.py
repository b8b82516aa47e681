"""Eviction policies of the cache tiers, chosen by name.

A policy is data: an entry of :data:`POLICIES` maps a name to a small integer code, and
the tier kernels dispatch on that code (Numba compiles one kernel; no jitclass, no Python
object in the hot loop).  Each policy supplies three operations on the state tuple ``P``
(see :mod:`tiered_emb.cache.policies._state`):

- ``attach(slot)``: the slot becomes a candidate for eviction (released by its batch);
- ``detach(slot)``: the slot stops being a candidate (pinned by a batch, or removed);
- ``victim()``: detach and return the next slot to evict.

Use metadata (count, last use) is kept by :func:`policy_touch` / :func:`policy_fresh` for LFU,
which reads it; LRU keeps none.
Pinned slots are simply not attached, so a policy never sees them.  ``P`` is one flat
int64 array (:mod:`._state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba

from tiered_emb._jit import prefetch_hint
from tiered_emb.cache.policies._state import CLOCK, COUNT, GEN, HPOS, LAST, new_policy_state  # noqa: F401  (re-exported)
from tiered_emb.cache.policies.lfu import lfu_attach, lfu_detach, lfu_sift_down, lfu_victim
from tiered_emb.cache.policies.lru import lru_attach, lru_detach, lru_upcoming, lru_victim

LRU = 0
LFU = 1


@dataclass(frozen=True)
class PolicySpec:
    code: int
    summary: str
    lookahead: bool = False  # rows of prefetched batches are pinned as soon as they enter the window


POLICIES: dict[str, PolicySpec] = {
    "lru": PolicySpec(LRU, "least recently used first"),
    "lfu": PolicySpec(LFU, "lowest use count first, then least recently used, then lowest slot"),
    "lookahead+lru": PolicySpec(LRU, "rows needed within the prefetch window kept; others by LRU", True),
    "lookahead+lfu": PolicySpec(LFU, "rows needed within the prefetch window kept; others by LFU", True),
}


@numba.njit(inline="always")
def policy_attach(code, P, slot):
    if code == LRU:
        lru_attach(P, slot)
    else:
        lfu_attach(P, slot)


@numba.njit(inline="always")
def policy_detach(code, P, slot):
    if code == LRU:
        lru_detach(P, slot)
    else:
        lfu_detach(P, slot)


@numba.njit(inline="always")
def policy_victim(code, P):
    if code == LRU:
        return lru_victim(P)
    return lfu_victim(P)


@numba.njit(inline="always")
def policy_upcoming(code, P, ahead):
    """A slot likely to be the victim ``ahead`` victims on, or -1 where the policy cannot
    tell cheaply (LFU: its heap's order below the root): a hint, nothing changes."""
    if code != LRU:
        return -1
    return lru_upcoming(P, ahead)


@numba.njit(inline="always")
def policy_prefetch(code, P, slot):
    """Fetch the policy state of ``slot`` a detach or touch will change: a hint, nothing changes."""
    if code == LRU:
        prefetch_hint(P, P[GEN] + slot)
    else:
        prefetch_hint(P, P[HPOS] + slot)


@numba.njit(inline="always")
def policy_hit(code, P, slot):
    """One more use of an attached (unpinned) slot: the single-request fast path.

    Equivalent to detach, touch, attach; cheaper: LRU appends one ring entry, LFU sifts
    the slot down (its key only grew).
    """
    policy_touch(code, P, slot)
    if code == LRU:
        lru_attach(P, slot)  # appending makes the slot's older entry stale
    else:
        lfu_sift_down(P, P[P[HPOS] + slot])


@numba.njit(inline="always")
def policy_touch(code, P, slot):
    """Record one more use of a resident slot (LFU's count and last use; LRU's order is its
    ring, so LRU keeps neither and touches no memory here)."""
    if code == LRU:
        return
    c = P[CLOCK] + 1
    P[CLOCK] = c
    P[P[COUNT] + slot] += 1
    P[P[LAST] + slot] = c


@numba.njit(inline="always")
def policy_fresh(code, P, slot):
    """Start the use metadata of a newly admitted slot (one use, now; nothing under LRU)."""
    if code == LRU:
        return
    c = P[CLOCK] + 1
    P[CLOCK] = c
    P[P[COUNT] + slot] = 1
    P[P[LAST] + slot] = c
