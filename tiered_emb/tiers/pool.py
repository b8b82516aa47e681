"""Tiers shared by tables: one HBM and one DDR cache over all of a store's tables, sized in bytes.

With ``TierConfig(hbm_bytes=..., ddr_bytes=...)`` a store holds one HBM tier and one DDR
tier for all its tables instead of a pair per table: rows of every table compete for the
same slots under the one policy, so a hot table takes the cache a cold one does not use,
and a table with no traffic holds no row.  Each slot is as wide as the store's widest
record (as FBGEMM's cache rows are as wide as its widest table); a tier of ``B`` bytes
holds ``B // (4 * slot floats)`` rows, so the bytes its records take never exceed ``B``.

The tiers' index is keyed by ``(table, id)`` (:mod:`tiered_emb.cache.index`): each slot
has an owner, the table's number (its place in the tables sorted by name).  Each table
sees the shared tiers through its own :class:`HbmShare` and :class:`DdrShare`: the same
arrays, its table number and its record width; every caller of a table's tiers works as
it does with tiers of its own.  Two differences show: a table's miss may evict another
table's row (the victims come out with their tables, and their write-backs go to their
own tables), and capacities, pins and free slots are the tiers', not the table's.
"""

from __future__ import annotations

import numpy as np

from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError
from tiered_emb.tiers.ddr import AdmitPlan, DdrTier
from tiered_emb.tiers.hbm import HbmTier, stride_of


class HbmShare(HbmTier):
    """One table's view of a shared HBM tier (the module's docstring)."""

    def __init__(self, pool: HbmTier, tab: int, width: int):  # (no state of its own: the pool's)
        self.__dict__.update(pool.__dict__)
        self.pool, self.tab, self.width = pool, tab, width

    @property
    def resident_rows(self) -> int:
        """Rows of this table held in the tier."""
        return int(np.count_nonzero(self.held()))

    def victim_rows(self, vslots: np.ndarray) -> np.ndarray | None:
        """The victims' records at the tier's width (victims are any table's), in the pool's buffer."""
        return self.pool.victim_rows(vslots)


class DdrShare(DdrTier):
    """One table's view of a shared DDR tier (the module's docstring)."""

    def __init__(self, pool: DdrTier, tab: int, width: int):
        self.__dict__.update(pool.__dict__)
        self.pool, self.tab, self.width = pool, tab, width

    @property
    def resident_rows(self) -> int:
        """Rows of this table held in the tier."""
        return int(np.count_nonzero(self.held()))

    def admit_decide(self, ids: np.ndarray, dirty: np.ndarray, tabs: np.ndarray | None = None) -> AdmitPlan:
        """HBM's victims (of the tables ``tabs``; None: of this table) admitted, decided in the pool."""
        if tabs is None or not tabs.shape[0]:
            tabs = np.full(ids.shape[0], self.tab, dtype=np.int32)
        return self.pool.admit_decide(ids, dirty, tabs)

    def admit_rows(self, rows: np.ndarray, plan: AdmitPlan):
        """:meth:`DdrTier.admit_rows` in the pool: ``rows`` at the tier's width."""
        return self.pool.admit_rows(rows, plan)


def slot_floats(tables: list[TableConfig]) -> tuple[int, int]:
    """The floats a slot of the shared HBM and DDR tiers takes: the widest record (padded
    for HBM as :func:`~tiered_emb.tiers.hbm.stride_of` pads it)."""
    width = max(t.record_width for t in tables)
    return stride_of(width), width


def pool_rows(tables: list[TableConfig], tiers: TierConfig) -> tuple[int, int]:
    """The rows the shared HBM and DDR tiers of ``tiers`` hold for ``tables``; ConfigError
    when HBM's bytes hold no row."""
    hbm_floats, ddr_floats = slot_floats(tables)
    hbm_rows = min(int(tiers.hbm_bytes or 0) // (4 * hbm_floats), 2**31 - 1)
    ddr_rows = min(int(tiers.ddr_bytes or 0) // (4 * ddr_floats), 2**31 - 1)
    if hbm_rows < 1:
        raise ConfigError(
            f"TierConfig.hbm_bytes={tiers.hbm_bytes} holds no row (a slot takes {4 * hbm_floats} bytes: "
            "the widest record of the store's tables)",
            f"give hbm_bytes of at least {4 * hbm_floats}",
        )
    return hbm_rows, ddr_rows


def shared_tiers(tables: list[TableConfig], tiers: TierConfig, xp) -> dict[str, tuple[HbmShare, DdrShare]]:
    """Each table's views of one HBM and one DDR tier of ``tiers.hbm_bytes`` and
    ``tiers.ddr_bytes`` bytes, tables numbered in name order."""
    hbm_rows, ddr_rows = pool_rows(tables, tiers)
    width = slot_floats(tables)[1]
    hbm = HbmTier(hbm_rows, width, tiers.policy, xp, shared=True)
    ddr = DdrTier(ddr_rows, width, tiers.policy, shared=True)
    by_name = sorted(tables, key=lambda t: t.name)
    return {
        t.name: (HbmShare(hbm, tab, t.record_width), DdrShare(ddr, tab, t.record_width))
        for tab, t in enumerate(by_name)
    }


__all__ = ["DdrShare", "HbmShare", "pool_rows", "shared_tiers", "slot_floats"]
