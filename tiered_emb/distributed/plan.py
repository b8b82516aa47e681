"""A sharding plan: where each table's rows live among the ranks of a job.

The vocabulary is TorchRec's ``ShardingType``: a table is held **table-wise** (whole on
one rank), **row-wise** (its ids split over every rank by a fixed hash of the id),
**table-row-wise** (split the same way within a group of ranks), **column-wise** (its
columns cut into pieces, each piece held table-wise) or **data-parallel** (a replica on
every rank, each applying the whole batch's update so the replicas stay bitwise equal).

A plan is data: JSON, made by :func:`tiered_emb.distributed.planner.plan_tables` or by
hand, checked against the tables (:meth:`ShardingPlan.check`), and the same on every rank
(:func:`tiered_emb.distributed.collection.ShardedEmbeddingBagCollection` compares the
ranks' fingerprints before anything runs).  Each rank keeps its shards as tables of its
own :class:`~tiered_emb.TieredStore` (:meth:`ShardingPlan.local_tables`): a shard of a
table has the table's name, and a column piece ``<table>.cols<c0>-<c1>`` with
``init_table``/``init_column`` so that it starts as exactly those columns of the rows.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_emb.config import TableConfig
from tiered_emb.errors import PlanError

PLAN_FORMAT = "tiered_emb-plan/1"


class ShardingType(str, enum.Enum):
    """How one table is spread over the ranks (the values are TorchRec's)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    DATA_PARALLEL = "data_parallel"


#: Shards that pool whole bags (each piece of a column-wise table is one).
BAG_SHARDED = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE)
#: Shards that return rows of ids, pooled by the rank that asked.
ROW_SHARDED = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


@dataclass(frozen=True)
class TablePlan:
    """One table's place.

    ``ranks``: table-wise, the owner; column-wise, the owner of each piece in column order
    (a rank may hold several); row-wise, every rank; table-row-wise, the group, an id going
    to ``ranks[row_owner(id, len(ranks))]``; data-parallel, every rank.  ``columns``
    (column-wise only): the pieces' bounds, ``0 < c1 < ... < dim``.
    """

    table: str
    sharding_type: ShardingType
    ranks: tuple[int, ...]
    columns: tuple[int, ...] = ()

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(rank, c0, c1)`` of each bag-pooling shard: one for table-wise, one a piece for column-wise."""
        if self.sharding_type is ShardingType.COLUMN_WISE:
            return [(r, self.columns[i], self.columns[i + 1]) for i, r in enumerate(self.ranks)]
        return [(self.ranks[0], 0, -1)]

    def to_dict(self) -> dict:
        """The table's plan as plain JSON values (what :meth:`ShardingPlan.to_json` writes)."""
        d: dict = {"table": self.table, "sharding_type": self.sharding_type.value, "ranks": list(self.ranks)}
        if self.columns:
            d["columns"] = list(self.columns)
        return d


def piece_name(table: str, c0: int, c1: int) -> str:
    """The local table name of columns ``c0:c1`` of ``table``."""
    return f"{table}.cols{c0}-{c1}"


@dataclass(frozen=True)
class ShardingPlan:
    """Every table's :class:`TablePlan` for ``world_size`` ranks, in a fixed order."""

    world_size: int
    tables: tuple[TablePlan, ...]

    def __getitem__(self, table: str) -> TablePlan:
        """The plan of ``table``; :class:`PlanError` if it has none."""
        for tp in self.tables:
            if tp.table == table:
                return tp
        raise PlanError(f"the plan has no table {table!r}", f"plan every table: {[t.table for t in self.tables]}")

    def to_json(self) -> str:
        """The plan as canonical JSON (keys sorted): what :meth:`fingerprint` hashes."""
        body = {"format": PLAN_FORMAT, "world_size": self.world_size, "tables": [t.to_dict() for t in self.tables]}
        return json.dumps(body, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """A plan :meth:`to_json` wrote (or one written by hand in that form)."""
        try:
            d = json.loads(text)
            if d.get("format") != PLAN_FORMAT:
                raise PlanError(f"plan format {d.get('format')!r}", f"give a plan of format {PLAN_FORMAT!r}")
            tables = tuple(
                TablePlan(
                    table=str(t["table"]),
                    sharding_type=ShardingType(t["sharding_type"]),
                    ranks=tuple(int(r) for r in t["ranks"]),
                    columns=tuple(int(c) for c in t.get("columns", ())),
                )
                for t in d["tables"]
            )
            return cls(int(d["world_size"]), tables)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"the plan does not parse: {e}", "write it as ShardingPlan.to_json() does") from None

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path``."""
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        """The plan :meth:`save` wrote to ``path``."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def fingerprint(self) -> str:
        """SHA-256 of :meth:`to_json`: equal on every rank of a job, or it does not start."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def check(self, tables: list[TableConfig]) -> None:
        """Raise :class:`PlanError` unless this plan places each of ``tables`` once, validly."""
        w = self.world_size
        if not isinstance(w, int) or w < 1:
            raise PlanError(f"world_size={w!r}", "use an int >= 1")
        by_name = {t.name: t for t in tables}
        planned = [t.table for t in self.tables]
        if sorted(planned) != sorted(by_name) or len(set(planned)) != len(planned):
            raise PlanError(
                f"the plan places tables {planned}, the job has {sorted(by_name)}",
                "plan each table exactly once (plan_tables does)",
            )
        for tp in self.tables:
            _check_table(tp, by_name[tp.table], w)

    def local_tables(self, rank: int, tables: list[TableConfig]) -> list[TableConfig]:
        """The tables of ``rank``'s store: its shards, in plan order."""
        by_name = {t.name: t for t in tables}
        out = []
        for tp in self.tables:
            cfg = by_name[tp.table]
            if tp.sharding_type is ShardingType.COLUMN_WISE:
                for r, c0, c1 in tp.pieces():
                    if r == rank:
                        piece = piece_name(cfg.name, c0, c1)
                        out.append(
                            dataclasses.replace(cfg, name=piece, dim=c1 - c0, init_table=cfg.name, init_column=c0)
                        )
            elif rank in tp.ranks:
                out.append(cfg)
        return out


def _check_table(tp: TablePlan, cfg: TableConfig, w: int) -> None:
    kind = tp.sharding_type
    where = f"table {tp.table!r} ({kind.value})"
    if not tp.ranks or any(not 0 <= r < w for r in tp.ranks):
        raise PlanError(f"{where} is placed on ranks {list(tp.ranks)}", f"use ranks in 0..{w - 1}")
    if kind is ShardingType.TABLE_WISE and len(tp.ranks) != 1:
        raise PlanError(f"{where} names {len(tp.ranks)} ranks", "a table-wise table has one owner")
    if kind in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL) and tp.ranks != tuple(range(w)):
        raise PlanError(f"{where} names ranks {list(tp.ranks)}", f"give every rank in order: {list(range(w))}")
    if kind is ShardingType.TABLE_ROW_WISE and (
        len(set(tp.ranks)) != len(tp.ranks) or list(tp.ranks) != sorted(tp.ranks)
    ):
        raise PlanError(f"{where} names ranks {list(tp.ranks)}", "give the group's ranks once each, increasing")
    if kind is not ShardingType.COLUMN_WISE:
        if tp.columns:
            raise PlanError(f"{where} has columns", "only a column-wise table names columns")
        return
    if cfg.packed:
        raise PlanError(
            f"{where} is cut by columns, and its rows are {cfg.dtype} (state {cfg.state_dtype})",
            "shard a table of narrow rows table-wise or row-wise (an int8 row's scale spans its columns)",
        )
    cols = tp.columns
    if (
        len(cols) != len(tp.ranks) + 1
        or cols[0] != 0
        or cols[-1] != cfg.dim
        or any(a >= b for a, b in itertools.pairwise(cols))
    ):
        raise PlanError(
            f"{where} cuts its {cfg.dim} columns at {list(cols)} for {len(tp.ranks)} ranks",
            f"give columns 0 < ... < {cfg.dim}, one piece per rank",
        )


def column_layout(cfg: TableConfig) -> tuple[int, int]:
    """``(arrays, tail)`` of a record of ``cfg`` after its weights: how many optimizer-state
    arrays of one value a column it holds (Adagrad 1, Adam 2), then how many words a row
    (Adam's step, the step of the last update with ``ttl_steps``).  A column piece holds
    its columns of each array and every tail word."""
    arrays = cfg.optimizer.state_width(2) - cfg.optimizer.state_width(1)
    return arrays, cfg.state_width - arrays * cfg.dim


def piece_records(records: np.ndarray, cfg: TableConfig, c0: int, c1: int) -> np.ndarray:
    """Columns ``c0:c1`` of whole records of ``cfg`` (float32 (n, record_width)), as the
    piece holding them stores them: its weights, its columns of each state array, the tail."""
    arrays, tail = column_layout(cfg)
    dim = cfg.dim
    parts = [records[:, c0:c1]] + [records[:, dim * (1 + a) + c0 : dim * (1 + a) + c1] for a in range(arrays)]
    parts.append(records[:, dim * (1 + arrays) : dim * (1 + arrays) + tail])
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def stitch_records(pieces: list[np.ndarray], cfg: TableConfig, columns: tuple[int, ...]) -> np.ndarray:
    """Whole records of ``cfg`` from its column pieces' records (the same rows, in order;
    the tail words from the first piece: every piece keeps the same)."""
    arrays, _ = column_layout(cfg)
    n = pieces[0].shape[0]
    out = np.empty((n, cfg.value_width), dtype=np.float32)
    dim = cfg.dim
    for p, (c0, c1) in zip(pieces, itertools.pairwise(columns), strict=True):
        w = c1 - c0
        for a in range(arrays + 1):
            out[:, dim * a + c0 : dim * a + c1] = p[:, w * a : w * (a + 1)]
    out[:, dim * (1 + arrays) :] = pieces[0][:, (columns[1] - columns[0]) * (1 + arrays) :]
    return out


def row_owner(ids: np.ndarray, group: int) -> np.ndarray:
    """Index in its group (int64 (n,), ``0..group-1``) of the rank holding each id of a
    row-wise table: splitmix64 of the id, modulo the group's size.  A pure function of the
    id: the same on every rank, run and world size."""
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(group)).astype(np.int64)


__all__ = [
    "BAG_SHARDED",
    "PLAN_FORMAT",
    "ROW_SHARDED",
    "ShardingPlan",
    "ShardingType",
    "TablePlan",
    "column_layout",
    "piece_name",
    "piece_records",
    "row_owner",
    "stitch_records",
]
