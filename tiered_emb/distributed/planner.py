"""The planner: each table's sharding type and ranks, balancing a stated cost model.

The cost of a rank for one global batch of ``batch_size`` samples, in bytes moved
(docs/distributed.md, "How the planner decides"):

- **lookup**: the rows its shards pool or gather (ids x columns x 4 bytes);
- **update**: its shards' distinct rows read and written with their optimizer state;
- **communication**: ids, pooled rows and gradients it sends and receives, weighted by
  ``comm_weight`` (a byte between processes costs more than a byte in memory);
- **memory**, a constraint rather than a cost: its shards' bytes on disk (every row a
  table may hold, with its state) and in its HBM and DDR tiers, within :class:`RankLimits`.

Small tables are replicated (data-parallel) unless the tables need over half of the
ranks' disks together; a table larger than one rank's disk is split
row-wise over as few ranks as hold it (table-row-wise, or row-wise over all); a wide
table is cut column-wise (not a RowWiseAdagrad one: its pieces would hand the row sum
along, one exchange a piece); a table heavier than a rank's fair share of the whole cost is
split row-wise; the rest go table-wise, the heaviest first, each to the rank of least cost
so far (ties to the lower rank).  Same inputs, same plan: no randomness, no dict order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.distributed.plan import ShardingPlan, ShardingType, TablePlan
from tiered_emb.errors import PlanError
from tiered_emb.optimizers import RowWiseAdagrad


@dataclass(frozen=True)
class RankLimits:
    """What one rank may hold, in bytes (None: no limit)."""

    hbm_bytes: int | None = None
    ddr_bytes: int | None = None
    disk_bytes: int | None = None


@dataclass(frozen=True)
class TableLoad:
    """A table's traffic: ids per sample (its features together), distinct ids per global
    batch, and the rows it will hold (needed for unbounded ids)."""

    pooling: float = 1.0
    distinct: float | None = None
    rows: int | None = None


def table_loads(batches: list[dict], feature_tables: dict[str, str]) -> dict[str, TableLoad]:
    """Access statistics from a few batches (feature -> ``(ids, lengths)``, NumPy or torch):
    each table's mean ids per sample and mean distinct ids per batch."""
    ids_per, distinct, samples = {}, {}, {}
    for batch in batches:
        seen: dict[str, list[np.ndarray]] = {}
        for f, table in feature_tables.items():
            ids, lengths = (np.asarray(x) for x in batch[f][:2])
            seen.setdefault(table, []).append(ids.reshape(-1))
            ids_per[table] = ids_per.get(table, 0) + ids.size
            samples[table] = samples.get(table, 0) + (lengths.size if len(seen[table]) == 1 else 0)
        for table, parts in seen.items():
            distinct[table] = distinct.get(table, 0) + np.unique(np.concatenate(parts)).size
    n = max(len(batches), 1)
    return {t: TableLoad(pooling=ids_per[t] / max(samples[t], 1), distinct=distinct[t] / n) for t in sorted(ids_per)}


@dataclass(frozen=True)
class RankCost:
    """One rank's estimated bytes for one global batch, and what it holds."""

    rank: int
    lookup: float
    update: float
    comm: float
    disk_bytes: int
    hbm_bytes: int
    ddr_bytes: int
    shards: tuple[str, ...]

    def cost(self, comm_weight: float) -> float:
        """lookup + update + ``comm_weight`` x communication bytes."""
        return self.lookup + self.update + comm_weight * self.comm


def _rows(cfg: TableConfig, load: TableLoad) -> int:
    if load.rows is not None:
        return int(load.rows)
    if cfg.num_rows is None:
        raise PlanError(
            f"table {cfg.name!r} has unbounded ids and no row estimate",
            "give TableLoad(rows=...) for it: the rows it will hold",
        )
    return int(cfg.num_rows)


class _Model:
    """The cost model's terms for the tables of one job."""

    def __init__(self, tables, world_size, batch_size, loads, tiers, comm_weight):
        self.tables = {t.name: t for t in tables}
        self.w, self.b, self.comm_weight = world_size, float(batch_size), comm_weight
        self.loads = {t.name: (loads or {}).get(t.name, TableLoad()) for t in tables}
        self.tiers = tiers

    def distinct(self, name: str) -> float:
        load, cfg = self.loads[name], self.tables[name]
        ids = self.b * load.pooling
        return min(load.distinct if load.distinct is not None else ids, ids, _rows(cfg, load))

    def disk(self, name: str, share: float = 1.0, cols: int | None = None) -> int:
        cfg = self.tables[name]
        width = cfg.record_width if cols is None else cols * cfg.record_width / cfg.dim
        return int(math.ceil(_rows(cfg, self.loads[name]) * share) * width * 4)

    def cache(self, name: str, share: float, cols: int | None) -> tuple[int, int]:
        if self.tiers is None:
            return 0, 0
        cfg = self.tables[name]
        width = (cfg.record_width if cols is None else cols * cfg.record_width / cfg.dim) * 4
        rows = math.ceil(_rows(cfg, self.loads[name]) * share)
        if self.tiers.shared:  # (a rank's shards share its tiers: its total is capped by their bytes too)
            return int(min(self.tiers.hbm_bytes or 0, rows * width)), int(min(self.tiers.ddr_bytes or 0, rows * width))
        return int(min(self.tiers.hbm_rows, rows) * width), int(min(self.tiers.ddr_rows, rows) * width)

    def terms(self, name: str, kind: ShardingType, share: float, cols: int | None) -> tuple[float, float, float]:
        """(lookup, update, comm) bytes of one shard holding ``share`` of the rows, ``cols`` columns."""
        cfg, load = self.tables[name], self.loads[name]
        dim = cfg.dim if cols is None else cols
        width = cfg.record_width * dim / cfg.dim
        ids = self.b * load.pooling
        u = self.distinct(name)
        if kind is ShardingType.DATA_PARALLEL:  # every replica applies the whole batch
            return ids / self.w * dim * 4, u * width * 8, (self.b * dim * 4 + ids * 8) * (self.w - 1) / self.w
        if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            owned = u * share
            return owned * dim * 4, owned * width * 8, ids * share * 8 + owned * dim * 4 + self.b * dim * 4
        away = (self.w - 1) / self.w  # table-wise or one column piece: the bags of the other ranks
        return ids * dim * 4, u * width * 8, (ids * 8 + 2 * self.b * dim * 4) * away


def plan_tables(
    tables: list[TableConfig],
    world_size: int,
    batch_size: int,
    loads: dict[str, TableLoad] | None = None,
    limits: RankLimits | list[RankLimits] | None = None,
    tiers: TierConfig | None = None,
    replicate_bytes: int = 1 << 20,
    column_dim: int = 512,
    comm_weight: float = 4.0,
) -> ShardingPlan:
    """A plan for ``tables`` on ``world_size`` ranks (see the module docstring).

    ``batch_size``: samples of a global batch; ``loads``: per table, from
    :func:`table_loads`; ``limits``: one for every rank or one per rank; ``tiers``: each
    rank's cache tiers (rows per table), to count their bytes against the limits;
    ``replicate_bytes``: tables up to this many bytes on disk are replicated;
    ``column_dim``: tables at least this wide are cut into pieces of about half of it.
    Raises :class:`PlanError` when the tables do not fit the limits.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size={world_size!r}", "use an int >= 1")
    lim = limits if isinstance(limits, list) else [limits or RankLimits()] * world_size
    if len(lim) != world_size:
        raise PlanError(f"{len(lim)} rank limits for {world_size} ranks", "give one RankLimits, or one per rank")
    m = _Model(tables, world_size, batch_size, loads, tiers, comm_weight)
    cost = [0.0] * world_size
    disk = [0] * world_size
    placed: dict[str, TablePlan] = {}

    def fits(r: int, need: int) -> bool:
        cap = lim[r].disk_bytes
        return cap is None or disk[r] + need <= cap

    def put(r: int, name: str, kind: ShardingType, share: float, cols: int | None) -> None:
        cost[r] += sum(w * t for w, t in zip((1, 1, comm_weight), m.terms(name, kind, share, cols), strict=True))
        disk[r] += m.disk(name, share, cols)

    everyone = tuple(range(world_size))
    caps = [x.disk_bytes for x in lim]
    room = None if any(c is None for c in caps) else sum(c for c in caps if c is not None)
    # replicas cost every rank the bytes: none when the tables need over half of the disks
    replicate = room is None or sum(m.disk(t.name) for t in tables) <= room / 2
    heavy = sorted(tables, key=lambda t: (-sum(m.terms(t.name, ShardingType.TABLE_WISE, 1.0, None)), t.name))
    total = sum(sum(m.terms(t.name, ShardingType.TABLE_WISE, 1.0, None)) for t in tables)
    for cfg in heavy:
        name, size = cfg.name, m.disk(cfg.name)
        if replicate and size <= replicate_bytes and all(fits(r, size) for r in everyone):
            placed[name] = TablePlan(name, ShardingType.DATA_PARALLEL, everyone)
            for r in everyone:
                put(r, name, ShardingType.DATA_PARALLEL, 1.0, None)
            continue
        by_load = sorted(everyone, key=lambda r: (cost[r], r))
        owner = next((r for r in by_load if fits(r, size)), None)
        wide = cfg.dim >= column_dim and not isinstance(cfg.optimizer, RowWiseAdagrad) and world_size > 1
        wide = wide and not cfg.packed  # (narrow rows are not cut by columns: see plan.check)
        if wide and owner is not None:
            k = min(world_size, max(2, round(cfg.dim / max(column_dim // 2, 1))))
            cuts = tuple(cfg.dim * i // k for i in range(k + 1))
            ranks = by_load[:k]
            placed[name] = TablePlan(name, ShardingType.COLUMN_WISE, tuple(ranks), cuts)
            for r, c0, c1 in placed[name].pieces():
                put(r, name, ShardingType.COLUMN_WISE, 1.0, c1 - c0)
            continue
        split = world_size > 1 and sum(m.terms(name, ShardingType.TABLE_WISE, 1.0, None)) > total / world_size
        if owner is not None and not split:
            placed[name] = TablePlan(name, ShardingType.TABLE_WISE, (owner,))
            put(owner, name, ShardingType.TABLE_WISE, 1.0, None)
            continue
        group = _row_group(size, world_size, by_load, fits, split)
        if group is None:
            raise PlanError(
                f"table {name!r} ({size:,} bytes on disk) fits no set of ranks within their disk limits",
                "raise RankLimits.disk_bytes, add ranks, or bound the table's rows",
            )
        kind = ShardingType.ROW_WISE if len(group) == world_size else ShardingType.TABLE_ROW_WISE
        placed[name] = TablePlan(name, kind, group)
        for r in group:
            put(r, name, kind, 1.0 / len(group), None)
    plan = ShardingPlan(world_size, tuple(placed[t.name] for t in tables))
    plan.check(tables)
    _check_caches(estimate(plan, tables, batch_size, loads, tiers), lim)
    return plan


def _row_group(size: int, world: int, by_load: list[int], fits, split: bool) -> tuple[int, ...] | None:
    """The fewest ranks (least loaded first) that hold a row-split table, or all when ``split``."""
    for g in range(world if split else 2, world + 1) if world > 1 else ():
        group = sorted(by_load[:g])
        if all(fits(r, math.ceil(size / g)) for r in group):
            return tuple(group)
    return None


def _check_caches(costs: list[RankCost], lim: list[RankLimits]) -> None:
    for c in costs:
        for what, used, cap in (
            ("HBM", c.hbm_bytes, lim[c.rank].hbm_bytes),
            ("DDR", c.ddr_bytes, lim[c.rank].ddr_bytes),
        ):
            if cap is not None and used > cap:
                raise PlanError(
                    f"rank {c.rank}'s {what} tier would hold {used:,} bytes of {list(c.shards)}, over its {cap:,}",
                    "give smaller tiers (TierConfig rows), more ranks, or a larger limit",
                )


def estimate(
    plan: ShardingPlan,
    tables: list[TableConfig],
    batch_size: int,
    loads: dict[str, TableLoad] | None = None,
    tiers: TierConfig | None = None,
    comm_weight: float = 4.0,
) -> list[RankCost]:
    """Each rank's estimated bytes under ``plan`` (the cost model of the module docstring)."""
    m = _Model(tables, plan.world_size, batch_size, loads, tiers, comm_weight)
    acc = [[0.0, 0.0, 0.0, 0, 0, 0, []] for _ in range(plan.world_size)]
    for tp in plan.tables:
        kind = tp.sharding_type
        if kind is ShardingType.COLUMN_WISE:
            shards = [(r, 1.0, c1 - c0, f"{tp.table}[{c0}:{c1}]") for r, c0, c1 in tp.pieces()]
        else:
            share = 1.0 / len(tp.ranks) if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) else 1.0
            shards = [(r, share, None, tp.table) for r in tp.ranks]
        for r, share, cols, label in shards:
            a = acc[r]
            for i, t in enumerate(m.terms(tp.table, kind, share, cols)):
                a[i] += t
            hbm, ddr = m.cache(tp.table, share, cols)
            a[3] += m.disk(tp.table, share, cols)
            a[4] += hbm
            a[5] += ddr
            a[6].append(f"{label}:{_SHORT[kind]}")
    if m.tiers is not None and m.tiers.shared:  # each rank's store holds its shards in tiers of these bytes
        for a in acc:
            a[4], a[5] = min(a[4], m.tiers.hbm_bytes or 0), min(a[5], m.tiers.ddr_bytes or 0)
    return [RankCost(r, a[0], a[1], a[2], a[3], a[4], a[5], tuple(a[6])) for r, a in enumerate(acc)]


_SHORT = {
    ShardingType.TABLE_WISE: "TW",
    ShardingType.ROW_WISE: "RW",
    ShardingType.COLUMN_WISE: "CW",
    ShardingType.TABLE_ROW_WISE: "TWRW",
    ShardingType.DATA_PARALLEL: "DP",
}


def imbalance(costs: list[RankCost], comm_weight: float = 4.0) -> float:
    """max / mean of the ranks' estimated costs (1.0: perfectly balanced)."""
    values = [c.cost(comm_weight) for c in costs]
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def describe(costs: list[RankCost], comm_weight: float = 4.0) -> str:
    """The plan as a table, one line a rank (as TorchRec's planner prints its plans)."""

    def mib(x: float) -> str:
        return f"{x / 2**20:,.1f}"

    lines = [
        (
            f"{'rank':>4}  {'lookup MiB':>10}  {'update MiB':>10}  {'comm MiB':>9}  {'cost':>9}  "
            f"{'disk MiB':>9}  {'HBM MiB':>8}  {'DDR MiB':>8}  shards"
        )
    ]
    for c in costs:
        lines.append(
            f"{c.rank:>4}  {mib(c.lookup):>10}  {mib(c.update):>10}  {mib(c.comm):>9}  {mib(c.cost(comm_weight)):>9}  "
            f"{mib(c.disk_bytes):>9}  {mib(c.hbm_bytes):>8}  {mib(c.ddr_bytes):>8}  {' '.join(c.shards)}"
        )
    lines.append(f"estimated imbalance (max / mean cost): {imbalance(costs, comm_weight):.3f}")
    return "\n".join(lines)


__all__ = ["RankCost", "RankLimits", "TableLoad", "describe", "estimate", "imbalance", "plan_tables", "table_loads"]
