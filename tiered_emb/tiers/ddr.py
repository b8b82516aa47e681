"""The DDR tier: warm rows in host memory, below HBM, above LMDB.

Caching is exclusive: a row moving up to HBM leaves DDR, and HBM's victims come down
into it, so HBM + DDR hold ``hbm_rows + ddr_rows`` distinct rows.  DDR's own victims go
to LMDB when dirty and are dropped when clean (LMDB, or the initialiser, has them).
"""

from __future__ import annotations

import numpy as np

from tiered_emb._backend import host_zeros
from tiered_emb.cache.slots import CacheTier, cache_admit, cache_take


class DdrTier(CacheTier):
    def __init__(self, capacity_rows: int, width: int, policy: str):
        super().__init__(capacity_rows, policy)
        self.width = width
        self.records = host_zeros((max(capacity_rows, 1), width))

    def take(self, ids: np.ndarray, out_rows: np.ndarray, out_dirty: np.ndarray) -> np.ndarray:
        """Move the rows of ``ids`` held here into ``out_rows``; returns the found mask (uint8 (k,))."""
        found = np.empty(ids.shape[0], dtype=np.uint8)
        cache_take(*self.kernel_args, self.records, ids, out_rows, out_dirty, found)
        return found

    def admit(self, ids: np.ndarray, rows: np.ndarray, dirty: np.ndarray):
        """Admit rows from HBM; returns ``(ids, rows)`` of dirty rows pushed out, and the eviction count."""
        k = ids.shape[0]
        ev_ids = np.empty(k, dtype=np.int64)
        ev_rows = np.empty((k, self.width), dtype=np.float32)
        n_out, n_ev = cache_admit(
            self.code,
            self.P,
            self.keys,
            self.vals,
            self.slot_ids,
            self.dirty,
            self.free,
            self.fmeta,
            self.records,
            ids,
            rows,
            dirty,
            ev_ids,
            ev_rows,
        )
        return ev_ids[:n_out], ev_rows[:n_out], int(n_ev)
