"""The DDR tier: warm rows in host memory, below HBM, above LMDB.

Caching is exclusive: a row moving up to HBM leaves DDR, and HBM's victims come down
into it, so HBM + DDR hold ``hbm_rows + ddr_rows`` distinct rows.  DDR's own victims go
to LMDB when dirty and are dropped when clean (LMDB, or the initialiser, has them).

Each move is decided first (the ``cache/slots.py`` kernels: index, policy, free slots, in
order, one thread) and its rows copied after, in one pass on every thread
(:func:`tiered_emb._jit.move_rows`): a row taken up goes from its DDR slot straight into
its HBM slot, one copy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tiered_emb._backend import host_full, host_zeros
from tiered_emb._jit import move_rows
from tiered_emb.cache.bringup import decide_down
from tiered_emb.cache.slots import CacheTier, cache_take, cache_take_slots
from tiered_emb.tiers.protocol import put_arrays

_NO_TABS = np.empty(0, dtype=np.int32)


class AdmitPlan(NamedTuple):
    """:meth:`DdrTier.admit_decide`'s decisions (:func:`tiered_emb.cache.bringup.decide_down`'s answer)."""

    dest: np.ndarray  # int64 (k,): each incoming row's slot, or -1 (pushed out again)
    ev_src: np.ndarray  # int64 (n_out,): where each dirty row pushed out is (a slot, or -1 - i)
    n_ev: int  # rows evicted
    ev_tabs: np.ndarray  # int32 (n_out,): the table of each dirty row pushed out


class DdrTier(CacheTier):
    def __init__(self, capacity_rows: int, width: int, policy: str, shared: bool = False):
        super().__init__(capacity_rows, policy, shared)
        self.width = width
        self.records = host_zeros((max(capacity_rows, 1), width))
        self._filled = host_full(self.slot_ids.shape[0], np.int32, -1)  # decide_down's scratch
        # pushed-out rows of the last admit, reused (the caller hands them on before the next)
        self._ev_ids = np.empty(0, dtype=np.int64)
        self._ev_rows = np.empty((0, width), dtype=np.float32)

    def take(self, ids: np.ndarray, out_rows: np.ndarray, out_dirty: np.ndarray) -> np.ndarray:
        """Move the rows of ``ids`` held here into ``out_rows``; returns the found mask (uint8 (k,))."""
        found = np.empty(ids.shape[0], dtype=np.uint8)
        cache_take(self.tag, self.state, self.records, ids, out_rows, out_dirty, found, self.tab)
        return found

    def take_slots(self, ids: np.ndarray, slots: np.ndarray, out_dirty: np.ndarray) -> int:
        """Remove ``ids`` (int64 (k,)) at ``slots`` (:meth:`find`'s answer just before, -1: not
        here) from the tier; their rows stay in ``records[slots]`` until the next
        :meth:`admit`, for the caller to copy up.  ``out_dirty`` (k,) uint8 gets the flags of
        those found; returns their count."""
        return int(cache_take_slots(self.tag, self.state, ids, slots, out_dirty, self.tab))

    def admit(self, ids: np.ndarray, rows: np.ndarray, dirty: np.ndarray):
        """Admit rows from HBM; returns ``(ids, rows)`` of dirty rows pushed out (valid until the
        next admit), and the eviction count."""
        plan = self.admit_decide(ids, dirty)
        return self.admit_rows(rows, plan)

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:class:`~tiered_emb.tiers.protocol.Tier`'s read: copies of the records of ``ids``
        held here (zeros elsewhere) and the found mask; no use is counted."""
        slots = self.find(np.ascontiguousarray(ids, dtype=np.int64))
        found = slots >= 0
        rows = np.zeros((slots.shape[0], self.width), dtype=np.float32)
        if found.any():
            rows[found] = self.records[slots[found], : self.width]
        return rows, found

    def put(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:class:`~tiered_emb.tiers.protocol.Tier`'s put: ``ids`` held here are taken out
        first (a row is in one tier at a time), then all are admitted dirty, as HBM's
        victims are; returns copies of the dirty rows pushed out."""
        ids, rows = put_arrays(ids, rows, self.width)
        k = ids.shape[0]
        self.take(ids, np.empty((k, self.width), dtype=np.float32), np.empty(k, dtype=np.uint8))
        ev_ids, ev_rows, _ = self.admit(ids, rows, np.ones(k, dtype=np.uint8))
        return ev_ids.copy(), ev_rows.copy()

    def admit_decide(self, ids: np.ndarray, dirty: np.ndarray, tabs: np.ndarray = _NO_TABS) -> AdmitPlan:
        """:meth:`admit`'s decisions alone (no row copied; records are not read): the plan
        for :meth:`admit_rows`, which must follow before anything else changes the tier.
        ``tabs`` (int32 (k,)): the table of each id in a shared tier (empty: all of it this
        object's table)."""
        k = ids.shape[0]
        if self._ev_ids.shape[0] < k:
            self._ev_ids = np.empty(k, dtype=np.int64)
            self._ev_rows = np.empty((k, self.width), dtype=np.float32)
        if self.owner.shape[0] and not tabs.shape[0]:
            tabs = np.full(k, self.tab, dtype=np.int32)
        dest = np.empty(k, dtype=np.int64)
        ev_src = np.empty(k, dtype=np.int64)
        ev_tabs = np.empty(k, dtype=np.int32)
        n_out, n_ev = decide_down(
            self.tag, self.state, self._filled, ids, tabs, dirty, dest, self._ev_ids, ev_tabs, ev_src
        )
        return AdmitPlan(dest, ev_src[:n_out], int(n_ev), ev_tabs[:n_out])

    def admit_rows(self, rows: np.ndarray, plan: AdmitPlan):
        """The rows of :meth:`admit_decide`'s ``plan``: the dirty rows pushed out copied out (as
        they were), then ``rows`` (k, W) into their slots.  Returns :meth:`admit`'s answer."""
        dest, ev_src, n_ev, _ = plan
        n_out = ev_src.shape[0]
        ev_rows = self._ev_rows[:n_out]
        n_old = int(np.count_nonzero(ev_src >= 0)) if n_out else 0
        if n_old == n_out and n_out:  # (all of them DDR's rows)
            move_rows(self.records, ev_src, ev_rows, None, self.width)
        elif n_old == 0 and n_out:  # (all of them ``rows``: a tier that keeps none, or admitted none)
            move_rows(rows, -1 - ev_src, ev_rows, None, self.width)
        elif n_out:
            old = ev_src >= 0
            everyone = np.arange(n_out)
            move_rows(self.records, np.where(old, ev_src, 0), ev_rows, np.where(old, everyone, -1), self.width)
            move_rows(rows, -1 - ev_src, ev_rows, np.where(old, -1, everyone), self.width)
        move_rows(rows, None, self.records, dest, self.width)
        return self._ev_ids[:n_out], ev_rows, n_ev
