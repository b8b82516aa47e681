"""Eviction policies of the cache tiers, chosen by name.

A policy is data: an entry of :data:`POLICIES` maps a name to a small integer code, and
the tier kernels take the policy as a :class:`PolicyTag`, a value whose Numba type names
the code: each ``policy_*`` operation below is chosen when a kernel is compiled, so a
kernel is compiled once per policy a process uses, with that policy's code alone in it
(no jitclass, no Python object in the hot loop, no branch on the policy).  Each policy
supplies these operations on its state ``P``, one flat int64 array (see
:mod:`tiered_emb.cache.policies._state`):

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
compiled functions the kernels call, where the others' are inlined.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import NativeValue, models, overload, register_model, unbox

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


class PolicyTag:
    """A policy as the tier kernels take it: its code, in the value's Numba type
    (:class:`PolicyType`), so that a kernel is compiled for one policy at a time.

    The type rides on the value (``_numba_type_``, which Numba's ``typeof`` reads), so that
    a kernel's dispatcher finds it in C without calling back into Python (~3 us a call on
    the prefetch thread's many small kernels, with the GIL held)."""

    __slots__ = ("_numba_type_", "code")

    def __init__(self, code: int):
        self.code = int(code)
        self._numba_type_ = _policy_type(self.code)

    def __reduce__(self):
        return (PolicyTag, (self.code,))

    def __repr__(self) -> str:
        return f"PolicyTag({self.code})"


class PolicyType(types.Type):
    """The Numba type of a :class:`PolicyTag`: one type per policy code, no data at run time."""

    def __init__(self, code: int):
        self.code = code
        super().__init__(name=f"PolicyTag[{code}]")


@functools.cache
def _policy_type(code: int) -> PolicyType:
    return PolicyType(code)


@register_model(PolicyType)
class _TagModel(models.OpaqueModel):
    pass


@unbox(PolicyType)
def _unbox_tag(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


def _code(tag) -> int:
    """The policy code of a kernel's ``tag`` argument, while the kernel is typed."""
    if not isinstance(tag, PolicyType):
        raise TypingError(f"a policy operation takes a PolicyTag, not {tag}: pass the tier's `tag`")
    return tag.code


@dataclass(frozen=True)
class PolicySpec:
    code: int
    summary: str
    lookahead: bool = False  # rows of prefetched batches are pinned as soon as they enter the window

    @property
    def tag(self) -> PolicyTag:
        """The policy as the kernels take it."""
        return PolicyTag(self.code)


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


# The operations.  Each is a Python stub whose compiled form is chosen per policy by the
# ``@overload`` under it, when the kernel calling it is typed (``tag``: a PolicyTag).


def policy_attach(tag, P, slot):
    """``slot`` becomes a candidate for eviction (released by its batch)."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_attach)
def _attach(tag, P, slot):
    code = _code(tag)
    if code == LRU:
        return lambda tag, P, slot: lru_attach(P, slot)
    if code == LFU:
        return lambda tag, P, slot: lfu_attach(P, slot)
    return lambda tag, P, slot: queue_attach(P, slot)


def policy_detach(tag, P, slot):
    """``slot`` stops being a candidate (pinned by a batch)."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_detach)
def _detach(tag, P, slot):
    code = _code(tag)
    if code == LRU:
        return lambda tag, P, slot: lru_detach(P, slot)
    if code == LFU:
        return lambda tag, P, slot: lfu_detach(P, slot)
    return lambda tag, P, slot: queue_detach(P, slot)


def policy_remove(tag, P, slot, pinned):
    """``slot``'s row leaves the tier (``pinned``: detached already)."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_remove)
def _remove(tag, P, slot, pinned):
    code = _code(tag)
    if code == S3FIFO:
        return lambda tag, P, slot, pinned: s3fifo_remove(P, np.int64(slot))
    if code == ARC:
        return lambda tag, P, slot, pinned: arc_remove(P, np.int64(slot))
    if code > LFU:
        return lambda tag, P, slot, pinned: queue_remove(P, slot)

    def remove(tag, P, slot, pinned):
        if not pinned:
            policy_detach(tag, P, slot)

    return remove


def policy_admit(tag, P, key):
    """``key`` missed and is about to take a slot (free or a victim's): before
    :func:`policy_victim` and :func:`policy_fresh`."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_admit)
def _admit(tag, P, key):
    code = _code(tag)
    if code == S3FIFO:
        return lambda tag, P, key: s3fifo_admit(P, np.int64(key))
    if code == ARC:
        return lambda tag, P, key: arc_admit(P, np.int64(key))
    return lambda tag, P, key: None


def policy_victim(tag, P, slot_ids):
    """Remove and return the next slot to evict, or -1 when every slot is pinned."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_victim)
def _victim(tag, P, slot_ids):
    code = _code(tag)
    if code == LRU:
        return lambda tag, P, slot_ids: lru_victim(P)
    if code == LFU:
        return lambda tag, P, slot_ids: lfu_victim(P)
    if code == S3FIFO:
        return lambda tag, P, slot_ids: s3fifo_victim(P, slot_ids)
    if code == ARC:
        return lambda tag, P, slot_ids: arc_victim(P, slot_ids)
    return lambda tag, P, slot_ids: queue_victim(code, P)


def policy_upcoming(tag, P, ahead):
    """A slot likely to be the victim ``ahead`` victims on, or -1 where the policy cannot
    tell cheaply (LFU: its heap's order below the root; the list policies: their bits):
    a hint, nothing changes."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_upcoming)
def _upcoming(tag, P, ahead):
    if _code(tag) == LRU:
        return lambda tag, P, ahead: lru_upcoming(P, ahead)
    return lambda tag, P, ahead: -1


def policy_prefetch(tag, P, slot):
    """Fetch the policy state of ``slot`` a detach or touch will change: a hint, nothing changes."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_prefetch)
def _prefetch(tag, P, slot):
    code = _code(tag)
    if code == LRU:
        return lambda tag, P, slot: prefetch_hint(P, P[GEN] + slot)
    if code == LFU:
        return lambda tag, P, slot: prefetch_hint(P, P[HPOS] + slot)
    return lambda tag, P, slot: queue_prefetch(P, slot)


def policy_hit(tag, P, slot):
    """One more use of an attached (unpinned) slot: the single-request fast path.

    Equivalent to detach, touch, attach; cheaper: LRU appends one ring entry (making the
    slot's older entry stale), LFU sifts the slot down (its key only grew), the list
    policies set a bit.
    """
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_hit)
def _hit(tag, P, slot):
    code = _code(tag)
    if code == LRU:
        return lambda tag, P, slot: lru_attach(P, slot)

    if code == LFU:

        def lfu_hit(tag, P, slot):
            policy_touch(tag, P, slot)
            lfu_sift_down(P, P[P[HPOS] + slot])

        return lfu_hit
    return lambda tag, P, slot: policy_touch(tag, P, slot)


def policy_touch(tag, P, slot):
    """Record one more use of a resident slot (LFU's count and last use, CLOCK's and SIEVE's
    bit; LRU's order is its ring, placed when the slot is attached)."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_touch)
def _touch(tag, P, slot):
    code = _code(tag)
    if code == LRU:
        return lambda tag, P, slot: None
    if code == S3FIFO:
        return lambda tag, P, slot: s3fifo_use(P, np.int64(slot))
    if code == ARC:
        return lambda tag, P, slot: arc_use(P, np.int64(slot))
    if code != LFU:
        return lambda tag, P, slot: queue_use(code, P, slot)

    def lfu_touch(tag, P, slot):
        c = P[USE_CLOCK] + 1
        P[USE_CLOCK] = c
        P[P[COUNT] + slot] += 1
        P[P[LAST] + slot] = c

    return lfu_touch


def policy_fresh(tag, P, slot):
    """A newly admitted slot: LFU's one use now; the list policies' newest, pinned until attached."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_fresh)
def _fresh(tag, P, slot):
    code = _code(tag)
    if code == LRU:
        return lambda tag, P, slot: None
    if code == S3FIFO:
        return lambda tag, P, slot: s3fifo_fresh(P, np.int64(slot))
    if code == ARC:
        return lambda tag, P, slot: arc_fresh(P, np.int64(slot))
    if code != LFU:
        return lambda tag, P, slot: queue_insert(P, slot)

    def lfu_fresh(tag, P, slot):
        c = P[USE_CLOCK] + 1
        P[USE_CLOCK] = c
        P[P[COUNT] + slot] = 1
        P[P[LAST] + slot] = c

    return lfu_fresh


def policy_code(tag):
    """The integer code of ``tag`` (a compile-time constant in a kernel)."""
    raise NotImplementedError("compiled only: call it from a kernel")


@overload(policy_code)
def _policy_code(tag):
    code = _code(tag)
    return lambda tag: code
