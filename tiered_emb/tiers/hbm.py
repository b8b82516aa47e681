"""The HBM tier: the rows a batch reads and updates, on the ``xp`` device.

Bookkeeping (index, policy, pins) stays on the host in :class:`CacheTier`; the records
array lives on the device so gathers and optimizer updates never leave it.  Rows cross
the host boundary only on a miss (up) or an eviction (down), batched per chunk.
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._backend import host_full, host_zeros, to_host, to_xp
from tiered_emb._jit import kernel, move_rows, take_rows
from tiered_emb.cache.bringup import decide_up
from tiered_emb.cache.slots import (
    FREE,
    PINNED,
    CacheTier,
    cache_pin_found,
    cache_release,
    cache_resolve_new,
)
from tiered_emb.tiers.protocol import put_arrays

_NO_SLOTS = np.empty(0, dtype=np.int64)
_NO_TABS = np.empty(0, dtype=np.int32)
_NO_OWNER = np.empty(0, dtype=np.uint8)  # (cache.index.NO_OWNER's type)


def stride_of(width: int) -> int:
    """The floats a record of ``width`` takes in HBM: padded to a whole number of 64-byte
    lines when that costs at most 1/8 more memory (dim 128 + a row-wise state: 129 -> 144
    floats).  A row then starts on a line: the forward reads its 128 weights from 8 lines,
    not 9.  Everything outside the tier sees ``width``."""
    pad = -width % 16
    return width + pad if pad <= width // 8 else width


def _records(xp, rows: int, width: int):
    """Zeroed records of :func:`stride_of` ``width`` floats each."""
    stride = stride_of(width)
    return host_zeros((rows, stride)) if xp is np else xp.zeros((rows, stride), dtype=xp.float32)


class HbmTier(CacheTier):
    direct = False  # capability flag: row id = slot (see DirectHbmTier)

    def __init__(self, capacity_rows: int, width: int, policy: str, xp, shared: bool = False):
        super().__init__(capacity_rows, policy, shared)
        self.xp = xp
        self.width = width
        self.records = _records(xp, max(capacity_rows, 1), width)
        self._victims = np.empty((0, width), dtype=np.float32)

    @property
    def unpinned_capacity(self) -> int:
        return self.capacity_rows - self.pinned_rows

    def resolve(self, uids: np.ndarray, force_pin: bool = False, probe: np.ndarray = _NO_SLOTS):
        """Give a slot to every id of ``uids`` (int64 (k,), distinct); see :func:`cache_resolve`.

        ``probe``: :meth:`find`'s answer for ``uids`` just before (the index not probed
        again), or empty.  Returns ``(slots, miss_idx, victim_ids, victim_rows, victim_dirty,
        pinned)``: the slots (int64 (k,)), positions of ``uids`` whose rows the caller must
        write into their slots, the evicted rows (host float32 (v, W), valid until the next
        resolve) for the tier below, and whether the slots are pinned (then :meth:`release`
        them after use).
        """
        slots, miss_idx, vslots, vids, vdirty, _, pinned = self.decide(uids, force_pin, probe)
        return slots, miss_idx, vids, self.victim_rows(vslots), vdirty, pinned

    def decide(self, uids: np.ndarray, force_pin: bool = False, probe: np.ndarray = _NO_SLOTS):
        """:meth:`resolve`'s decisions alone, no row copied: ``(slots, miss_idx, victim_slots,
        victim_ids, victim_dirty, victim_tables, pinned)``; the victims' rows stay in their
        slots until the caller writes the missed rows in, so it takes them first
        (:meth:`victim_rows`).  A victim's table is another's in a shared tier
        (:mod:`tiered_emb.tiers.pool`), 0 in a tier of one table."""
        return _decided(*cache_resolve_new(self.tag, self.state, uids, force_pin, probe, self.tab))

    def decide_up(self, ddr, uids: np.ndarray, force_pin: bool, probe: np.ndarray, missing, ddr_slots, dirty):
        """:meth:`decide` and ``ddr``'s :meth:`~tiered_emb.tiers.DdrTier.take_slots` of the ids
        it lacks (``missing``, ``uids[probe < 0]``; their DDR slots ``ddr_slots``, flags into
        ``dirty``) in one call (:func:`tiered_emb.cache.bringup.decide_up`): :meth:`decide`'s
        answer and the rows DDR gave up."""
        *decided, n_ddr = decide_up(
            self.tag, self.state, ddr.tag, ddr.state, uids, force_pin, probe, missing, ddr_slots, dirty, self.tab
        )
        return (*_decided(*decided), int(n_ddr))

    def victim_rows(self, vslots: np.ndarray) -> np.ndarray | None:
        """Host copy of the records in ``vslots`` (int64 (v,)); None when there are none.  On the
        host, gathered on the threads into a buffer reused from call to call (valid until the
        next)."""
        n_v = vslots.shape[0]
        if not n_v:
            return None
        if self.xp is not np:
            return to_host(self.records[to_xp(self.xp, vslots), : self.width])
        if self._victims.shape[0] < n_v:
            self._victims = np.empty((max(n_v, 2 * self._victims.shape[0]), self.width), dtype=np.float32)
        rows = self._victims[:n_v]
        move_rows(self.records, vslots, rows, _NO_SLOTS, self.width)
        return rows

    def fill(self, slots: np.ndarray, rows: np.ndarray, dirty: np.ndarray) -> None:
        """Write host ``rows`` (m, W) into ``slots`` (m,) with their dirty flags."""
        if self.xp is np:
            move_rows(rows, None, self.records, slots, self.width)
        else:
            self.records[to_xp(self.xp, slots), : self.width] = to_xp(self.xp, rows)
        self.dirty[slots] = dirty

    def fill_from(self, src: np.ndarray, src_slots: np.ndarray, slots: np.ndarray) -> None:
        """Copy host records ``src[src_slots]`` (a lower tier's) into ``slots`` (int64 (m,)):
        one copy on the host; staged through a host buffer when the records are on a GPU.
        Dirty flags are the caller's."""
        if self.xp is np:
            move_rows(src, src_slots, self.records, slots, self.width)
        else:
            self.records[to_xp(self.xp, slots), : self.width] = to_xp(self.xp, take_rows(src, src_slots))

    def pin_found(self, uids: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Pin the first ``budget`` of ``uids`` (distinct) that are resident; returns their
        positions in ``uids`` and their slots (:func:`cache_pin_found`)."""
        at = np.empty(uids.shape[0], dtype=np.int64)
        slots = np.empty(uids.shape[0], dtype=np.int64)
        n = cache_pin_found(self.tag, self.state, uids, max(budget, 0), at, slots, self.tab)
        return at[:n], slots[:n]

    def release(self, slots: np.ndarray) -> None:
        cache_release(self.tag, self.state, slots)

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        """Host copy of the records in ``slots``."""
        return to_host(self.records[to_xp(self.xp, slots), : self.width])

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:class:`~tiered_emb.tiers.protocol.Tier`'s read: host copies of the records of
        ``ids`` held here (zeros elsewhere) and the found mask; no use is counted."""
        slots = self.find(np.ascontiguousarray(ids, dtype=np.int64))
        found = slots >= 0
        rows = np.zeros((slots.shape[0], self.width), dtype=np.float32)
        if found.any():
            rows[found] = self.rows_at(slots[found])
        return rows, found

    def put(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:class:`~tiered_emb.tiers.protocol.Tier`'s put, as the step places rows: chunks of
        the unpinned capacity resolved in order, their rows written dirty, the dirty
        victims returned (copies)."""
        ids, rows = put_arrays(ids, rows, self.width)
        step = self.unpinned_capacity
        if step < 1 and ids.shape[0]:
            raise RuntimeError("every slot of the tier is pinned: release some before a put")
        out_ids, out_rows = [_NO_SLOTS], [np.empty((0, self.width), dtype=np.float32)]
        for start in range(0, ids.shape[0], max(step, 1)):
            chunk = ids[start : start + step]
            slots, _, vids, vrows, vdirty, pinned = self.resolve(chunk)
            if vrows is not None:
                keep = vdirty.astype(bool)
                out_ids.append(vids[keep])
                out_rows.append(vrows[keep])  # (a copy: boolean indexing)
            self.fill(slots, rows[start : start + step], np.ones(chunk.shape[0], dtype=np.uint8))
            if pinned:
                self.release(slots)
        return np.concatenate(out_ids), np.concatenate(out_rows)


def _decided(out, n_miss: int, n_v: int, pinned: bool) -> tuple:
    """:meth:`HbmTier.decide`'s answer from :func:`cache_resolve`'s: the arrays cut to the counts."""
    if n_v < 0:
        raise RuntimeError("HBM chunk larger than its unpinned capacity")  # caller bug, not user input
    return (
        out.slots,
        out.miss_idx[:n_miss],
        out.victim_slots[:n_v],
        out.victim_ids[:n_v],
        out.victim_dirty[:n_v],
        out.victim_tabs[:n_v],
        bool(pinned),
    )


class DirectHbmTier(HbmTier):
    """An HBM tier that holds its whole table: row ``id`` lives in slot ``id``.

    Chosen by the store when ``hbm_rows >= num_rows``.  With every row fitting there is
    nothing to evict, so the tier keeps no index and no policy: resolving a batch is one
    read of ``slot_ids`` per id instead of a hash probe, and a pooled forward can read
    ``records[ids[i]]`` without deduping the batch first.  Rows still arrive lazily (from
    DDR, LMDB or the initialiser, on first use), so reopening a store with a larger HBM
    works as with any tier.  Pins are counted as elsewhere, but they never take a row's
    place: ``unpinned_capacity`` is the whole table.
    """

    direct = True
    owner = _NO_OWNER  # (one table's tier)

    def __init__(self, num_rows: int, width: int, xp):  # no CacheTier state: no index, no policy
        cap = max(int(num_rows), 1)
        self.capacity_rows = int(num_rows)
        self.xp = xp
        self.width = width
        self.records = _records(xp, cap, width)
        self.slot_ids = host_full(cap, np.int64, -1)
        self.dirty = host_full(cap, np.uint8, 0)
        self.pins = host_full(cap, np.int32, 0)
        self.meta = np.array([self.capacity_rows, self.capacity_rows, 0], dtype=np.int64)  # (Slots.meta)
        if xp is np:
            # Rows not brought up yet read as NaN (stored rows are finite), so a pooled
            # forward finds them from its own sums instead of a pass over every id first.
            # Filling commits the pages now.
            self.records.fill(np.nan)

    @property
    def unpinned_capacity(self) -> int:
        return self.capacity_rows

    @property
    def resident_rows(self) -> int:
        return self.capacity_rows - int(self.meta[FREE])

    @property
    def pinned_rows(self) -> int:
        return int(self.meta[PINNED])

    def find(self, ids: np.ndarray) -> np.ndarray:
        return _direct_find(self.slot_ids, ids)

    def decide(self, uids: np.ndarray, force_pin: bool = False, probe: np.ndarray = _NO_SLOTS):
        """As :meth:`HbmTier.decide`; the slots are the ids, there are never victims."""
        miss_idx = _direct_resolve(self.slot_ids, self.dirty, self.pins, self.meta, uids, force_pin)
        return uids, miss_idx, _NO_SLOTS, _NO_SLOTS, _NO_FLAGS, _NO_TABS, bool(force_pin)

    def decide_up(self, ddr, uids: np.ndarray, force_pin: bool, probe: np.ndarray, missing, ddr_slots, dirty):
        """As :meth:`HbmTier.decide_up`: the slots are the ids (no index, no policy to share)."""
        n_ddr = ddr.take_slots(missing, ddr_slots, dirty)
        return (*self.decide(uids, force_pin, probe), n_ddr)

    def pin_found(self, uids: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        slots = self.find(uids)
        at = np.flatnonzero(slots >= 0)[: max(budget, 0)]
        _direct_pin(self.pins, self.meta, slots[at], 1)
        return at, slots[at]

    def release(self, slots: np.ndarray) -> None:
        _direct_pin(self.pins, self.meta, slots, -1)


_NO_FLAGS = np.empty(0, dtype=np.uint8)


@numba.njit(cache=True, nogil=True)
def _direct_resolve(slot_ids, dirty, pins, meta, uids, force_pin):
    """Claim slot ``uid`` for every id of ``uids`` (int64 (k,), distinct); returns int64
    positions of those not resident before (the caller writes their rows).  ``force_pin``
    pins every slot, as :func:`tiered_emb.cache.slots.cache_resolve` does for prefetch."""
    miss_idx = np.empty(uids.shape[0], dtype=np.int64)
    m = 0
    for i in range(uids.shape[0]):
        u = uids[i]
        if slot_ids[u] != u:
            slot_ids[u] = u
            dirty[u] = 0
            meta[FREE] -= 1
            miss_idx[m] = i
            m += 1
        if force_pin:
            if pins[u] == 0:
                meta[PINNED] += 1
            pins[u] += 1
    return miss_idx[:m]


@kernel
def _direct_pin(pins, meta, slots, delta):
    """Add ``delta`` (+1 or -1) pins to ``slots`` (int64 (k,), distinct), counting pinned slots in ``meta[PINNED]``."""
    for i in range(slots.shape[0]):
        s = slots[i]
        before = pins[s]
        pins[s] = before + delta
        if before == 0:
            meta[PINNED] += 1
        elif pins[s] == 0:
            meta[PINNED] -= 1


@numba.njit(cache=True, nogil=True)
def _direct_find(slot_ids, ids):
    """Slot of each id (its own id when resident) or -1; int64 (n,)."""
    out = np.empty(ids.shape[0], dtype=np.int64)
    for i in range(ids.shape[0]):
        out[i] = ids[i] if slot_ids[ids[i]] == ids[i] else -1
    return out
