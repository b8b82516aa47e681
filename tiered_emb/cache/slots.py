"""What the HBM and DDR tiers share: slots, the id -> slot index, the policy, pins, dirty flags.

A tier holds ``capacity_rows`` records in slots.  Its bookkeeping lives on the host in
preallocated arrays changed by the ``@njit`` kernels below; only the records array of the
HBM tier lives on the device.

Arrays (``cap`` = capacity, at least 1 so a zero-capacity DDR still has valid shapes):

- ``slot_ids``: int64 (cap,), the id in each slot or -1;
- ``dirty``: uint8 (cap,), 1 where the slot is newer than the tier below;
- ``pins``: int32 (cap,), batches holding the slot; a pinned slot is never a victim;
- ``free``: int32 (cap,), stack of free slots (``meta[FREE]`` entries), lowest slot on top;
- ``meta``: int64 (3,), the counts ``meta[FREE]``, ``meta[CAPACITY]`` and
  ``meta[PINNED]`` (pinned slots: kept by the kernels so the step never scans ``pins``);
- ``keys``, ``vals``: the index (:mod:`tiered_emb.cache.index`); ``P``: the policy state;
- ``owner``: int32 (cap,), the table of each slot's row in a tier shared by tables
  (:mod:`tiered_emb.tiers.pool`), or empty (a tier of one table).

The kernels take the table number ``tab`` of the ids they are given (0 for a tier of one
table); a shared tier's victims are any table's, and come out with their tables.

The kernels take them as one :class:`Slots` (``tier.state``) after the policy's
:class:`~tiered_emb.cache.policies.PolicyTag` (``tier.tag``), and are compiled once for
each policy a process uses.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from tiered_emb._backend import host_full
from tiered_emb._jit import PREFETCH_DISTANCE, kernel, prefetch_hint, split_parts
from tiered_emb.cache.index import (
    NO_OWNER,
    index_del_of,
    index_find_many,
    index_find_many_of,
    index_find_of,
    index_find_split,
    index_find_split_of,
    index_prefetch_of,
    index_put_of,
    is_shared,
    new_index,
)
from tiered_emb.cache.policies import (
    POLICIES,
    new_policy_state,
    policy_admit,
    policy_attach,
    policy_detach,
    policy_fresh,
    policy_hit,
    policy_prefetch,
    policy_remove,
    policy_touch,
    policy_upcoming,
    policy_victim,
)
from tiered_emb.errors import ConfigError

#: Ids of a find cut into slices on Numba's threads, each at least this many.
_FIND_SPLIT_FROM = 8192
#: The entries of ``meta``: free slots, capacity, pinned slots.
FREE, CAPACITY, PINNED = 0, 1, 2


class Slots(NamedTuple):
    """A cache tier's state as its kernels take it (the module doc names each array)."""

    P: np.ndarray
    keys: np.ndarray
    vals: np.ndarray
    slot_ids: np.ndarray
    dirty: np.ndarray
    pins: np.ndarray
    free: np.ndarray
    meta: np.ndarray
    owner: np.ndarray


class Resolved(NamedTuple):
    """What :func:`cache_resolve` decided for a chunk of k ids (arrays of k entries, the
    first ``n_miss`` / ``n_victims`` of the last four valid)."""

    slots: np.ndarray  # int64: the slot of each id
    miss_idx: np.ndarray  # int64: positions of the ids that missed
    victim_slots: np.ndarray  # int64
    victim_ids: np.ndarray  # int64
    victim_dirty: np.ndarray  # uint8
    victim_tabs: np.ndarray  # int32: the table of each victim (0 in a tier of one table)


class CacheTier:
    """Index, policy and bookkeeping of one cache tier of one table, or of several
    (``shared``: rows of many tables compete for its slots; :mod:`tiered_emb.tiers.pool`)."""

    #: the table number of the ids this object is asked about (0: a tier of one table)
    tab = 0

    def __init__(self, capacity_rows: int, policy: str, shared: bool = False):
        cap = max(int(capacity_rows), 1)
        self.capacity_rows = int(capacity_rows)
        self.code = POLICIES[policy].code
        #: the policy as the kernels take it
        self.tag = POLICIES[policy].tag
        keys, vals = new_index(cap)
        free = host_full(cap, np.int32, 0)
        free[: self.capacity_rows] = np.arange(self.capacity_rows - 1, -1, -1, dtype=np.int32)
        #: the arrays the kernels change (:class:`Slots`)
        self.state = Slots(
            P=new_policy_state(cap, self.code),
            keys=keys,
            vals=vals,
            slot_ids=host_full(cap, np.int64, -1),
            dirty=host_full(cap, np.uint8, 0),
            pins=host_full(cap, np.int32, 0),
            free=free,
            meta=np.array([self.capacity_rows, self.capacity_rows, 0], dtype=np.int64),
            owner=host_full(cap, np.int32, -1) if shared else NO_OWNER,
        )
        self.keys, self.vals, self.slot_ids, self.dirty, self.pins = keys, vals, *self.state[3:6]

    @property
    def resident_rows(self) -> int:
        return self.capacity_rows - int(self.state.meta[FREE])

    @property
    def pinned_rows(self) -> int:
        """Slots pinned by a batch."""
        return int(self.state.meta[PINNED])

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slots of ``ids`` (int64 (n,)) or -1; the policy is not touched."""
        if not self.capacity_rows:  # (a tier of no rows: DDR, where HBM alone holds a table)
            return np.full(ids.shape[0], -1, dtype=np.int64)
        out = np.empty(ids.shape[0], dtype=np.int64)
        parts = split_parts(ids.shape[0], _FIND_SPLIT_FROM)
        owner = self.owner
        if owner.shape[0] and parts > 1:
            index_find_split_of(self.keys, self.vals, owner, ids, self.tab, out, parts)
        elif owner.shape[0]:
            index_find_many_of(self.keys, self.vals, owner, ids, self.tab, out, 0, -1)
        elif parts > 1:
            index_find_split(self.keys, self.vals, ids, out, parts)
        else:  # (every argument given: a call that leaves one to its default takes Numba's slow dispatch)
            index_find_many(self.keys, self.vals, ids, out, 0, -1)
        return out

    @property
    def owner(self) -> np.ndarray:
        """The table of each slot's row (a shared tier), or empty (a tier of one table)."""
        return self.state.owner

    def held(self, a: int = 0, b: int | None = None) -> np.ndarray:
        """Mask of the slots ``a:b`` that hold a row of this object's table."""
        held = self.slot_ids[a:b] >= 0
        if self.owner.shape[0]:
            held &= self.owner[a:b] == self.tab
        return held

    def resident(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, ids)`` of every resident row of this object's table, in slot order."""
        slots = np.flatnonzero(self.held())
        return slots, self.slot_ids[slots]


@numba.njit(inline="never")
def _prefetch_victims(tag, P, keys, vals, slot_ids, dirty, owner):
    """Hints for the victims to come: the slot state of the one ``2 * PREFETCH_DISTANCE``
    on, the index bucket of the id held by the one ``PREFETCH_DISTANCE`` on (its slot's
    id fetched by the first hint).  Returns the far slot (-1: none known), whose row the
    caller may fetch too.  Nothing changes: each victim is a cache miss otherwise."""
    far = policy_upcoming(tag, P, 2 * PREFETCH_DISTANCE)
    if far >= 0:
        prefetch_hint(slot_ids, far)
        prefetch_hint(dirty, far)
    near = policy_upcoming(tag, P, PREFETCH_DISTANCE)
    if near >= 0 and slot_ids[near] >= 0:
        index_prefetch_of(keys, vals, owner, slot_ids[near], owner[near] if is_shared(owner) else 0)
    return far


@kernel
def cache_resolve(tag, st, uids, force_pin, out, probed, tab):
    """Give every id of ``uids`` (int64 (k,), distinct, k <= free + unpinned; of table
    ``tab``) a slot.

    Pass 1 probes the index (``probed``: ``out.slots`` holds the probe already, nothing
    changed since).  When every id is resident and ``force_pin`` is false (the
    common, all-hit chunk), each is used in order and nothing is pinned: no miss can
    evict them.  Otherwise pass 2 pins the hits, so no miss of the chunk can evict a row
    the chunk needs, and pass 3 walks the chunk in order: a hit is used, a miss takes a
    free slot or the policy's victim, and stays pinned.  Both paths make the same
    decisions (a slot's place in its policy depends only on the order of uses).

    Writes ``out`` (a :class:`Resolved` of arrays of k entries): ``slots``, ``miss_idx``
    (positions in ``uids`` that missed), and the victims' slots, ids, dirty flags and
    tables (the caller copies their rows out before it writes the missed rows in).  Returns
    ``(n_miss, n_victims, pinned)``; n_victims is -1 when the tier ran out of unpinned
    slots (the caller must chunk by capacity); ``pinned`` says whether the caller must
    :func:`cache_release` the slots.
    """
    P, keys, vals, slot_ids, dirty, pins, free, meta, owner = st  # (every array of the state)
    out_slots, miss_idx, victim_slots, victim_ids, victim_dirty, victim_tabs = out
    shared = is_shared(owner)
    k = uids.shape[0]
    n_hit = 0
    for i in range(k):
        if probed:
            s = out_slots[i]
        else:
            if i + 2 * PREFETCH_DISTANCE < k:  # the index bucket of an id further on
                index_prefetch_of(keys, vals, owner, uids[i + 2 * PREFETCH_DISTANCE], tab)
            s = index_find_of(keys, vals, owner, uids[i], tab)
            out_slots[i] = s
        if s >= 0:
            n_hit += 1
    if n_hit == k and not force_pin:
        for i in range(k):
            s = out_slots[i]
            if pins[s] == 0:
                policy_hit(tag, P, s)
            else:
                policy_touch(tag, P, s)  # pinned by a prefetched batch: placed when that batch releases it
        return 0, 0, False
    for i in range(k):
        if i + PREFETCH_DISTANCE < k:  # the pin and policy entry of a hit further on
            ahead = out_slots[i + PREFETCH_DISTANCE]
            if ahead >= 0:
                prefetch_hint(pins, ahead)
                policy_prefetch(tag, P, ahead)
        s = out_slots[i]
        if s >= 0:
            if pins[s] == 0:
                policy_detach(tag, P, s)
                meta[PINNED] += 1
            pins[s] += 1
    n_miss = 0
    n_victims = 0
    for i in range(k):
        if i + PREFETCH_DISTANCE < k and out_slots[i + PREFETCH_DISTANCE] < 0:  # a miss's put, further on
            index_prefetch_of(keys, vals, owner, uids[i + PREFETCH_DISTANCE], tab)
        s = out_slots[i]
        if s >= 0:
            policy_touch(tag, P, s)
            continue
        policy_admit(tag, P, _ghost_key(uids[i], tab) if shared else uids[i])
        if meta[FREE] > 0:
            meta[FREE] -= 1
            s = free[meta[FREE]]
        else:
            far = _prefetch_victims(tag, P, keys, vals, slot_ids, dirty, owner)
            if far >= 0:
                prefetch_hint(pins, far)
            s = policy_victim(tag, P, slot_ids)
            if s < 0:
                return n_miss, -1, True
            vid = slot_ids[s]
            vtab = owner[s] if shared else 0
            victim_slots[n_victims] = s
            victim_ids[n_victims] = vid
            victim_dirty[n_victims] = dirty[s]
            victim_tabs[n_victims] = vtab
            n_victims += 1
            index_del_of(keys, vals, owner, vid, vtab)
        slot_ids[s] = uids[i]
        dirty[s] = 0
        if shared:
            owner[s] = tab
        index_put_of(keys, vals, owner, uids[i], tab, s)
        policy_fresh(tag, P, s)
        pins[s] = 1
        meta[PINNED] += 1
        out_slots[i] = s
        miss_idx[n_miss] = i
        n_miss += 1
    return n_miss, n_victims, True


@numba.njit(cache=True, nogil=True)
def cache_resolve_new(tag, st, uids, force_pin, probe, tab):
    """:func:`cache_resolve` into fresh arrays (``uids`` of table ``tab``); ``probe`` (int64
    (k,)): the slots of ``uids`` found just before (the probe skipped), or empty.

    Returns ``(out, n_miss, n_victims, pinned)``: ``out`` a :class:`Resolved` whose arrays
    the caller cuts to the counts; ``n_victims`` is -1 when the tier ran out of unpinned
    slots (a caller bug: chunks are cut by unpinned capacity).
    """
    k = uids.shape[0]
    out = Resolved(
        np.empty(k, dtype=np.int64),
        np.empty(k, dtype=np.int64),
        np.empty(k, dtype=np.int64),
        np.empty(k, dtype=np.int64),
        np.empty(k, dtype=np.uint8),
        np.empty(k, dtype=np.int32),
    )
    probed = probe.shape[0] == k and k > 0
    if probed:  # (a loop: a slice assignment compiles its shape-mismatch error, seconds on a first run)
        for i in range(k):
            out.slots[i] = probe[i]
    n_miss, n_v, pinned = cache_resolve(tag, st, uids, force_pin, out, probed, tab)
    return out, n_miss, n_v, pinned


@kernel
def cache_release(tag, st, slots):
    """Unpin ``slots`` (int64 (k,), distinct); a slot with no pin left becomes evictable, in order."""
    P, pins, meta = st.P, st.pins, st.meta
    n = slots.shape[0]
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:
            ahead = slots[i + PREFETCH_DISTANCE]
            prefetch_hint(pins, ahead)
            policy_prefetch(tag, P, ahead)
        s = slots[i]
        pins[s] -= 1
        if pins[s] == 0:
            meta[PINNED] -= 1
            policy_attach(tag, P, s)


@kernel
def cache_pin(tag, st, slots):
    """Pin resident ``slots`` (int64 (k,), distinct): a slot going from 0 pins leaves the policy."""
    P, pins, meta = st.P, st.pins, st.meta
    for i in range(slots.shape[0]):
        s = slots[i]
        if pins[s] == 0:
            policy_detach(tag, P, s)
            meta[PINNED] += 1
        pins[s] += 1


@kernel
def cache_pin_found(tag, st, uids, budget, out_at, out_slots, tab):
    """Pin the first ``budget`` ids of ``uids`` (int64 (k,), distinct, none pinned for the
    caller yet) that are resident, in order: writes their positions in ``uids`` to
    ``out_at`` and their slots to ``out_slots`` (k,) and returns how many.  What the
    prefetch window pins of a batch entering it, and what the simulator replays."""
    keys, vals, owner = st.keys, st.vals, st.owner
    k = uids.shape[0]
    n = 0
    for i in range(k):
        if n >= budget:
            break
        if i + 2 * PREFETCH_DISTANCE < k:  # the index bucket of an id further on
            index_prefetch_of(keys, vals, owner, uids[i + 2 * PREFETCH_DISTANCE], tab)
        s = index_find_of(keys, vals, owner, uids[i], tab)
        if s >= 0:
            out_at[n] = i
            out_slots[n] = s
            n += 1
    cache_pin(tag, st, out_slots[:n])
    return n


@numba.njit(inline="never")
def _ghost_key(key, tab):
    """The key a policy's ghosts remember ``key`` of table ``tab`` by (``key`` itself for table 0)."""
    return np.int64(np.uint64(key) ^ (np.uint64(tab) * np.uint64(0xD6E8FEB86659FD93)))


@numba.njit(inline="never")
def _prefetch_slot(tag, P, slot_ids, dirty, pins, s):
    """Hints for the bookkeeping of slot ``s`` a few ids on: its id, flags and policy entry."""
    prefetch_hint(slot_ids, s)
    prefetch_hint(dirty, s)
    prefetch_hint(pins, s)
    policy_prefetch(tag, P, s)


@kernel
def cache_take_slots(tag, st, ids, slots, out_dirty, tab):
    """Remove from the tier the ids of ``ids`` (int64 (k,)) whose ``slots[i] >= 0``: their
    slots as :meth:`CacheTier.find` gave them, nothing changed since (exclusive caching).

    Bookkeeping only: each row stays in its slot of the records until the tier's next
    admit, so the caller copies the rows out first.  ``out_dirty`` (k,) uint8 gets the
    dirty flag of each id found.  ``ids`` are of table ``tab``.  Returns the number found.
    """
    P, keys, vals, slot_ids, dirty, pins, free, meta, owner = st  # (every array of the state)
    n = ids.shape[0]
    n_found = 0
    for i in range(n):
        if i + PREFETCH_DISTANCE < n:  # the slot state and the index bucket of an id further on
            ahead = slots[i + PREFETCH_DISTANCE]
            if ahead >= 0:
                _prefetch_slot(tag, P, slot_ids, dirty, pins, ahead)
                index_prefetch_of(keys, vals, owner, ids[i + PREFETCH_DISTANCE], tab)
        s = slots[i]
        if s < 0:
            continue
        n_found += 1
        out_dirty[i] = dirty[s]
        policy_remove(tag, P, s, pins[s] > 0)
        if pins[s] > 0:
            meta[PINNED] -= 1
        pins[s] = 0
        index_del_of(keys, vals, owner, ids[i], tab)
        if is_shared(owner):
            owner[s] = -1
        slot_ids[s] = -1
        dirty[s] = 0
        free[meta[FREE]] = s
        meta[FREE] += 1
    return n_found


@numba.njit(cache=True, nogil=True)
def cache_take(tag, st, records, ids, out_rows, out_dirty, found, tab):
    """Move the rows of ``ids`` present here out of the tier (exclusive caching).

    ``records`` (cap, W) float32 host; ``out_rows`` (k, W), ``out_dirty`` (k,) uint8,
    ``found`` (k,) uint8 are written for the ids found.  Returns the number found.
    """
    n = ids.shape[0]
    slots = np.empty(n, dtype=np.int64)
    index_find_many_of(st.keys, st.vals, st.owner, ids, tab, slots, 0, -1)
    for i in range(n):
        s = slots[i]
        found[i] = s >= 0
        if s >= 0:
            for c in range(out_rows.shape[1]):  # (the caller's width: a shared tier's records are wider)
                out_rows[i, c] = records[s, c]
    return cache_take_slots(tag, st, ids, slots, out_dirty, tab)


@kernel
def cache_admit_slots(tag, st, filled, ids, tabs, rows_dirty, dest, ev_ids, ev_tabs, ev_src):
    """Admit ``ids`` (int64 (k,), absent here; of the tables ``tabs``, int32 (k,), or all of
    table 0 when ``tabs`` is empty), evicting by policy: the decisions, no row moved.

    ``rows_dirty`` (k,) uint8: the incoming rows' flags.  Writes ``dest`` (k,): the slot
    each incoming row goes into, or -1 where it was pushed out again within the call
    (capacity 0, or smaller than k); and for each dirty row pushed out, its id in
    ``ev_ids`` and where its row is in ``ev_src``: a slot (its row as before the call) or
    ``-1 - i`` (incoming row ``i``), and its table in ``ev_tabs``.  ``filled`` (cap,) int32 is scratch, -1 everywhere
    between calls.  The caller copies the pushed-out rows first, then the incoming rows
    into their slots.  Returns ``(n_dirty_out, n_evicted)``.
    """
    P, keys, vals, slot_ids, dirty, free, meta, owner = (
        st.P,
        st.keys,
        st.vals,
        st.slot_ids,
        st.dirty,
        st.free,
        st.meta,
        st.owner,
    )
    shared = is_shared(owner)
    n_out = 0
    n_ev = 0
    cap = meta[CAPACITY]
    n = ids.shape[0]
    for i in range(n):
        dest[i] = -1
        tab = tabs[i] if tabs.shape[0] else 0
        if i + PREFETCH_DISTANCE < n:  # the bucket this id's put probes, further on
            index_prefetch_of(
                keys, vals, owner, ids[i + PREFETCH_DISTANCE], tabs[i + PREFETCH_DISTANCE] if tabs.shape[0] else 0
            )
        if meta[FREE] > PREFETCH_DISTANCE:  # the state of the free slot taken that many ids on
            _prefetch_slot(tag, P, slot_ids, dirty, filled, free[meta[FREE] - 1 - PREFETCH_DISTANCE])
        if cap == 0:
            n_ev += 1
            if rows_dirty[i]:
                ev_ids[n_out] = ids[i]
                ev_tabs[n_out] = tab
                ev_src[n_out] = -1 - i
                n_out += 1
            continue
        policy_admit(tag, P, _ghost_key(ids[i], tab) if shared else ids[i])
        if meta[FREE] > 0:
            meta[FREE] -= 1
            s = free[meta[FREE]]
        else:
            far = _prefetch_victims(tag, P, keys, vals, slot_ids, dirty, owner)
            if far >= 0:
                prefetch_hint(filled, far)
            s = policy_victim(tag, P, slot_ids)
            vid = slot_ids[s]
            vtab = owner[s] if shared else 0
            n_ev += 1
            was = filled[s]  # an incoming row of this call, pushed out again
            if was >= 0:
                dest[was] = -1
            if dirty[s]:
                ev_ids[n_out] = vid
                ev_tabs[n_out] = vtab
                ev_src[n_out] = s if was < 0 else -1 - was
                n_out += 1
            index_del_of(keys, vals, owner, vid, vtab)
        slot_ids[s] = ids[i]
        if shared:
            owner[s] = tab
        index_put_of(keys, vals, owner, ids[i], tab, s)
        dirty[s] = rows_dirty[i]
        filled[s] = i
        dest[i] = s
        policy_fresh(tag, P, s)
        policy_attach(tag, P, s)
    for i in range(n):  # the scratch back to -1 (a slot pushed out again was filled again at once)
        s = dest[i]
        if s >= 0:
            filled[s] = -1
    return n_out, n_ev


@kernel
def _simulate_requests(tag, st, trace):
    """Run a request trace (int64 (n,)) one request at a time; returns the hit count.

    The same decisions as the store makes for batches of one id: the policy kernels
    alone, without moving rows (used by benchmarks and the simulator).
    """
    P, keys, vals, slot_ids, free, meta = st.P, st.keys, st.vals, st.slot_ids, st.free, st.meta
    hits = 0
    for i in range(trace.shape[0]):
        key = trace[i]
        s = index_find_of(keys, vals, st.owner, key, 0)
        if s >= 0:
            hits += 1
            policy_hit(tag, P, s)
            continue
        policy_admit(tag, P, key)
        if meta[FREE] > 0:
            meta[FREE] -= 1
            s = free[meta[FREE]]
        else:
            s = policy_victim(tag, P, slot_ids)
            index_del_of(keys, vals, st.owner, slot_ids[s], 0)
        slot_ids[s] = key
        index_put_of(keys, vals, st.owner, key, 0, s)
        policy_fresh(tag, P, s)
        policy_attach(tag, P, s)
    return hits


def simulate(trace: np.ndarray, capacity_rows: int, policy: str = "lru") -> int:
    """Hits of ``policy`` with ``capacity_rows`` on ``trace`` (int64 (n,)), one id per request.

    Examples
    --------
    >>> simulate(np.array([1, 2, 1, 3, 1, 2]), 2, "lru")
    2
    """
    if capacity_rows < 1:
        raise ConfigError(f"capacity_rows={capacity_rows!r} is invalid", "use a cache of at least 1 row")
    t = CacheTier(capacity_rows, policy)
    return int(_simulate_requests(t.tag, t.state, np.ascontiguousarray(trace, dtype=np.int64)))
