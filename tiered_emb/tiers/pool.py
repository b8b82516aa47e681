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

``TierConfig(reserved={name: (hbm_bytes, ddr_bytes)})`` sets bytes of both budgets apart
for a table: it gets tiers of its own of those bytes, as tiers per table are, which no
other table's rows enter and which it does not outgrow (its floor and its cap at once);
the other tables share what is left.  A floor alone (rows no other table may take, the
table free to grow past them in the shared tiers) or a cap alone would need each
policy's victim choice to skip rows by table: not built.
"""

from __future__ import annotations

import numpy as np

from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import ConfigError
from tiered_emb.tiers.ddr import AdmitPlan, DdrTier
from tiered_emb.tiers.hbm import DirectHbmTier, HbmTier, stride_of


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

    def put(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Not for a share: a put into a shared tier pushes out any table's rows, which one
        table's answer cannot name (the step hands each victim to its own table)."""
        raise TypeError("a put into one table's share of a shared tier could push out other tables' rows")


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

    def put(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Not for a share: a put into a shared tier pushes out any table's rows, which one
        table's answer cannot name (the step hands each victim to its own table)."""
        raise TypeError("a put into one table's share of a shared tier could push out other tables' rows")


def slot_floats(tables: list[TableConfig]) -> tuple[int, int]:
    """The floats a slot of the shared HBM and DDR tiers takes: the widest record (padded
    for HBM as :func:`~tiered_emb.tiers.hbm.stride_of` pads it)."""
    width = max(t.record_width for t in tables)
    return stride_of(width), width


def reserved_of(tables: list[TableConfig], tiers: TierConfig) -> dict[str, tuple[int, int]]:
    """The HBM and DDR rows of the tiers of their own that ``tiers.reserved`` gives tables
    (each at its record's width, at most its ``num_rows``); ConfigError for a name the
    store does not hold or bytes that hold no HBM row."""
    by_name = {t.name: t for t in tables}
    out = {}
    for name, hbm_b, ddr_b in tiers.reserved:
        t = by_name.get(name)
        if t is None:
            raise ConfigError(
                f"TierConfig.reserved names table {name!r}, which the store does not hold",
                f"reserve bytes for some of {sorted(by_name)}",
            )
        hbm_rows, ddr_rows = hbm_b // (4 * stride_of(t.record_width)), ddr_b // (4 * t.record_width)
        if hbm_rows < 1:
            raise ConfigError(
                f"TierConfig.reserved gives table {name!r} {hbm_b} HBM bytes, which hold no row "
                f"(a row of it takes {4 * stride_of(t.record_width)} bytes)",
                f"reserve at least {4 * stride_of(t.record_width)} HBM bytes for it",
            )
        most = min(t.num_rows or 2**31 - 1, 2**31 - 1)  # (rows beyond the table's are of no use)
        out[name] = (min(hbm_rows, most), min(ddr_rows, most))
    return out


def pool_rows(tables: list[TableConfig], tiers: TierConfig) -> tuple[int, int]:
    """The rows the shared HBM and DDR tiers of ``tiers`` hold for ``tables`` but those
    reserved (what the reservations leave of the bytes, in slots of the widest record of
    the others); (0, 0) when every table is reserved; ConfigError when HBM's bytes hold no row."""
    reserved = {name: (h, d) for name, h, d in tiers.reserved}
    rest = [t for t in tables if t.name not in reserved]
    if not rest:
        return 0, 0
    hbm_bytes = int(tiers.hbm_bytes or 0) - sum(h for h, _ in reserved.values())
    ddr_bytes = int(tiers.ddr_bytes or 0) - sum(d for _, d in reserved.values())
    hbm_floats, ddr_floats = slot_floats(rest)
    hbm_rows = min(hbm_bytes // (4 * hbm_floats), 2**31 - 1)
    ddr_rows = min(ddr_bytes // (4 * ddr_floats), 2**31 - 1)
    if hbm_rows < 1:
        left = f", {hbm_bytes} once the reserved bytes are set apart" if reserved else ""
        raise ConfigError(
            f"TierConfig.hbm_bytes={tiers.hbm_bytes}{left} holds no row (a slot takes {4 * hbm_floats} bytes: "
            "the widest record of the tables that share it)",
            f"give hbm_bytes of at least {4 * hbm_floats} beyond what is reserved",
        )
    return hbm_rows, ddr_rows


def shared_tiers(tables: list[TableConfig], tiers: TierConfig, xp) -> dict[str, tuple[HbmTier, DdrTier]]:
    """Each table's HBM and DDR tiers: views of one HBM and one DDR tier of what
    ``tiers.hbm_bytes`` and ``tiers.ddr_bytes`` leave after the reservations, tables
    numbered in name order; a reserved table's tiers of its own (a direct HBM tier when
    its bytes hold the whole table)."""
    reserved = reserved_of(tables, tiers)
    hbm_rows, ddr_rows = pool_rows(tables, tiers)
    out: dict[str, tuple[HbmTier, DdrTier]] = {}
    rest = sorted((t for t in tables if t.name not in reserved), key=lambda t: t.name)
    if rest:
        width = slot_floats(rest)[1]
        hbm = HbmTier(hbm_rows, width, tiers.policy, xp, shared=True)
        ddr = DdrTier(ddr_rows, width, tiers.policy, shared=True)
        tab = {name: k for k, name in enumerate(sorted(t.name for t in tables))}  # (the resolver's numbers)
        for t in rest:
            out[t.name] = (HbmShare(hbm, tab[t.name], t.record_width), DdrShare(ddr, tab[t.name], t.record_width))
    for t in tables:
        if t.name in reserved:
            rows, below = reserved[t.name]
            own: HbmTier = (
                DirectHbmTier(t.num_rows, t.record_width, xp)
                if t.num_rows is not None and rows >= t.num_rows
                else HbmTier(rows, t.record_width, tiers.policy, xp)
            )
            out[t.name] = (own, DdrTier(below, t.record_width, tiers.policy))
    return out


__all__ = ["DdrShare", "HbmShare", "pool_rows", "reserved_of", "shared_tiers", "slot_floats"]
