"""The HBM tier: the rows a batch reads and updates, on the ``xp`` device.

Bookkeeping (index, policy, pins) stays on the host in :class:`CacheTier`; the records
array lives on the device so gathers and optimizer updates never leave it.  Rows cross
the host boundary only on a miss (up) or an eviction (down), batched per chunk.
"""
from __future__ import annotations

import numpy as np

from .._backend import to_host, to_xp
from .cache import CacheTier, _cache_pin, _cache_release, _cache_resolve_new


class HbmTier(CacheTier):
    def __init__(self, capacity_rows: int, width: int, policy: str, xp):
        super().__init__(capacity_rows, policy)
        self.xp = xp
        self.width = width
        self.records = xp.zeros((max(capacity_rows, 1), width), dtype=xp.float32)

    @property
    def unpinned_capacity(self) -> int:
        return self.capacity_rows - int(self.fmeta[2])

    def resolve(self, uids: np.ndarray, force_pin: bool = False):
        """Give a slot to every id of ``uids`` (int64 (k,), distinct); see :func:`_cache_resolve`.

        Returns ``(slots, miss_idx, victim_ids, victim_rows, victim_dirty, pinned)``: the
        slots (int64 (k,)), positions of ``uids`` whose rows the caller must write into
        their slots, the evicted rows (host float32 (v, W)) for the tier below, and
        whether the slots are pinned (then :meth:`release` them after use).
        """
        slots, miss_idx, vslots, vids, vdirty, n_v, pinned = _cache_resolve_new(
            self.code, self.P, self.keys, self.vals, self.slot_ids, self.dirty, self.pins, self.free, self.fmeta,
            uids, force_pin)
        if n_v < 0:
            raise RuntimeError("HBM chunk larger than its unpinned capacity")  # caller bug, not user input
        victim_rows = to_host(self.records[to_xp(self.xp, vslots)]) if n_v else None
        return slots, miss_idx, vids, victim_rows, vdirty, bool(pinned)

    def fill(self, slots: np.ndarray, rows: np.ndarray, dirty: np.ndarray) -> None:
        """Write host ``rows`` (m, W) into ``slots`` (m,) with their dirty flags."""
        self.records[to_xp(self.xp, slots)] = to_xp(self.xp, rows)
        self.dirty[slots] = dirty

    def pin(self, slots: np.ndarray) -> None:
        """Pin resident ``slots`` (distinct) without using them."""
        _cache_pin(self.code, self.P, self.pins, self.fmeta, slots)

    def release(self, slots: np.ndarray) -> None:
        _cache_release(self.code, self.P, self.pins, self.fmeta, slots)

    def rows_at(self, slots: np.ndarray) -> np.ndarray:
        """Host copy of the records in ``slots``."""
        return to_host(self.records[to_xp(self.xp, slots)])
