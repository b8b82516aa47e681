"""Resharding: a job's rows moved from the shards of one plan to those of another (another
world size, or other sharding types), streamed a chunk at a time.

Every table is read back whole and in increasing id order from the old shards at their
checkpoints: a table-wise or replicated table from one shard, a row-wise one by merging
its shards' streams (each increasing, their ids disjoint), a column-wise one by stitching
its pieces' records side by side (every piece stores the same ids).  Each new shard takes
what is its own of that stream (its ids, its columns) and writes it as the SSD tier's
import does (increasing ids, durably); then it checkpoints.  At most one chunk of each
old shard of a table is in memory at a time: ``TierConfig.budget_bytes`` of rows.

The rows written are the stored ones; a row never written is its initialiser's on any
shard alike (its table name and column keep it so), so nothing else needs to move.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.distributed.plan import (
    ROW_SHARDED,
    ShardingPlan,
    ShardingType,
    TablePlan,
    piece_name,
    piece_records,
    row_owner,
    stitch_records,
)
from tiered_emb.distributed.shards import shard_path
from tiered_emb.errors import CorruptStoreError
from tiered_emb.store import TieredStore


def _chunk_rows(tiers: TierConfig, width: int) -> int:
    return max(1, tiers.budget_bytes // (8 + 4 * width))


def _stream(store: TieredStore, table: str, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    _, chunks = store.engine.ssd.stored_rows(table, chunk)
    for ids, rows in chunks:
        if ids.shape[0]:
            yield ids, rows


def _merge(streams: list[Iterator[tuple[np.ndarray, np.ndarray]]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Increasing ``(ids, rows)`` chunks of disjoint increasing streams, merged."""
    heads: list[tuple[np.ndarray, np.ndarray] | None] = [next(s, None) for s in streams]
    while any(h is not None for h in heads):
        bound = min(int(h[0][-1]) for h in heads if h is not None)  # every id up to it has been read
        ids, rows = [], []
        for i, h in enumerate(heads):
            if h is None:
                continue
            take = h[0] <= bound
            ids.append(h[0][take])
            rows.append(h[1][take])
            rest = (h[0][~take], h[1][~take])
            heads[i] = rest if rest[0].shape[0] else next(streams[i], None)
        all_ids = np.concatenate(ids)
        order = np.argsort(all_ids, kind="stable")
        yield all_ids[order], np.concatenate(rows)[order]


def _stitch(streams: list, cfg: TableConfig, columns: tuple[int, ...]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for parts in zip(*streams, strict=False):
        ids = parts[0][0]
        if any(p[0].shape != ids.shape or not np.array_equal(p[0], ids) for p in parts):
            raise CorruptStoreError(
                f"the column pieces of table {cfg.name!r} store different ids",
                "reshard from a checkpoint every rank completed (the job's checkpoint.json names them)",
            )
        yield ids, stitch_records([p[1] for p in parts], cfg, columns)


def table_rows(old: dict[int, TieredStore], tp: TablePlan, cfg: TableConfig, chunk: int):
    """Every stored row of a table under its old plan ``tp``: increasing ``(ids, records)`` chunks."""
    if tp.sharding_type is ShardingType.COLUMN_WISE:
        streams = [_stream(old[r], piece_name(cfg.name, c0, c1), chunk) for r, c0, c1 in tp.pieces()]
        return _stitch(streams, cfg, tp.columns)
    if tp.sharding_type in ROW_SHARDED:
        return _merge([_stream(old[r], cfg.name, chunk) for r in tp.ranks])
    return _stream(old[tp.ranks[0]], cfg.name, chunk)


def reshard(
    old_root: str | os.PathLike[str],
    old_plan: ShardingPlan,
    old_epochs: list[int | None],
    new_root: str | os.PathLike[str],
    new_plan: ShardingPlan,
    tables: list[TableConfig],
    tiers: TierConfig,
    seed: int,
    extra: bytes | None = None,
) -> list[int | None]:
    """Write the shards of ``new_plan`` under ``new_root`` (which must not exist) from those
    of ``old_plan`` under ``old_root``, each opened at its checkpoint ``old_epochs[rank]``;
    every new shard checkpoints with ``extra``.  Returns the new shards' checkpoint numbers
    (None for a rank holding nothing).  The old shards are left as they were at those
    checkpoints (a later checkpoint of theirs is dropped, as ``open(snapshot=...)`` does)."""
    old_plan.check(tables)
    new_plan.check(tables)
    by_name = {t.name: t for t in tables}
    old: dict[int, TieredStore] = {}
    new: dict[int, TieredStore] = {}
    try:
        for r in range(old_plan.world_size):
            if old_plan.local_tables(r, tables):
                old[r] = TieredStore.open(shard_path(old_root, r), snapshot=old_epochs[r])
        Path(new_root).mkdir(parents=True)
        for r in range(new_plan.world_size):
            local = new_plan.local_tables(r, tables)
            if local:
                new[r] = TieredStore.create(shard_path(new_root, r), local, tiers, seed=seed)
        for tp in new_plan.tables:
            cfg = by_name[tp.table]
            chunk = _chunk_rows(tiers, cfg.record_width)
            for r, local, keep in _new_shards(tp, cfg):
                for ids, rows in table_rows(old, old_plan[tp.table], cfg, chunk):
                    ids, rows = keep(ids, rows)
                    if ids.shape[0]:
                        new[r].engine.ssd.write_pending({local: (ids, np.ascontiguousarray(rows))}, durable=True)
        epochs: list[int | None] = [None] * new_plan.world_size
        for r, store in new.items():
            epochs[r] = store.checkpoint(extra)
        return epochs
    finally:
        for store in [*old.values(), *new.values()]:
            store.close(checkpoint=False)


def _new_shards(tp: TablePlan, cfg: TableConfig):
    """``(rank, local table, keep)`` of each new shard of a table: ``keep(ids, records)``
    selects what the shard stores."""
    if tp.sharding_type is ShardingType.COLUMN_WISE:
        for r, c0, c1 in tp.pieces():
            yield r, piece_name(cfg.name, c0, c1), lambda i, x, a=c0, b=c1: (i, piece_records(x, cfg, a, b))
    elif tp.sharding_type in ROW_SHARDED:
        for g, r in enumerate(tp.ranks):
            yield (
                r,
                cfg.name,
                lambda i, x, g=g: (i[row_owner(i, len(tp.ranks)) == g], x[row_owner(i, len(tp.ranks)) == g]),
            )
    else:
        for r in tp.ranks:
            yield r, cfg.name, lambda i, x: (i, x)


__all__ = ["reshard", "table_rows"]
