"""Serving a sharded job's rows: one :class:`~tiered_emb.StoreReader` per shard, each at
the same global checkpoint, and a router that answers for whole tables.

A reader runs beside the training job, from any process (no lock, no process group): it
reads the checkpoint each shard completed for the job's manifest, and :meth:`refresh`
moves every shard to the checkpoint a newer manifest names, all together, so a lookup
never mixes two steps.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from tiered_emb.config import TableConfig
from tiered_emb.distributed.plan import (
    ROW_SHARDED,
    ShardingPlan,
    ShardingType,
    piece_name,
    row_owner,
    stitch_records,
)
from tiered_emb.distributed.shards import shard_path
from tiered_emb.errors import UnknownTableError
from tiered_emb.reader import StoreReader
from tiered_emb.store import TieredStore


class ShardedReader:
    """The rows of a sharded job, as one store's reader gives them.

    Parameters
    ----------
    root : path
        The shards' root (``<root>/rank<r>``, as :func:`open_shards` makes them).
    plan : ShardingPlan
    epochs : list of int or None
        Each rank's checkpoint to read (None: a rank holding nothing, or its last).

    Examples
    --------
    >>> reader = ShardedReader(root, plan, epochs)  # doctest: +SKIP
    >>> reader.lookup("user", ids)  # float32 (n, dim), whichever ranks hold the rows  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], plan: ShardingPlan, epochs: list[int | None]):
        self.root, self.plan = Path(root), plan
        self.readers: dict[int, StoreReader] = {}
        try:
            for r in range(plan.world_size):
                path = shard_path(root, r)
                if path.exists():
                    self.readers[r] = TieredStore.open(path, mode="r", snapshot=epochs[r])
        except BaseException:
            self.close()
            raise
        self.tables = {tp.table: self._config(tp) for tp in plan.tables}

    def _config(self, tp) -> TableConfig:
        if tp.sharding_type is ShardingType.COLUMN_WISE:
            r, c0, c1 = tp.pieces()[0]
            piece = self.readers[r].table_config(piece_name(tp.table, c0, c1))
            return dataclasses.replace(piece, name=tp.table, dim=tp.columns[-1], init_table=None, init_column=0)
        return self.readers[tp.ranks[0]].table_config(tp.table)

    def refresh(self, epochs: list[int | None]) -> None:
        """Move every shard to its checkpoint of a newer global one (``epochs``, as a newer
        manifest names them)."""
        for r, reader in self.readers.items():
            reader.refresh(epochs[r])

    def lookup(self, table: str, ids) -> np.ndarray:
        """Rows of ``ids`` of ``table`` at the global checkpoint: float32 (n, dim)."""
        return np.ascontiguousarray(self.peek(table, ids)[:, : self.tables[table].dim])

    def peek(self, table: str, ids, with_state: bool = False) -> np.ndarray:
        """As :meth:`lookup`; with ``with_state`` whole records (the table's own layout)."""
        if table not in self.tables:
            raise UnknownTableError(f"no table {table!r} in the plan", f"tables: {sorted(self.tables)}")
        tp, cfg = self.plan[table], self.tables[table]
        ids = np.asarray(ids, dtype=np.int64)
        if tp.sharding_type is ShardingType.COLUMN_WISE:
            pieces = [self.readers[r].peek(piece_name(table, c0, c1), ids, True) for r, c0, c1 in tp.pieces()]
            out = stitch_records(pieces, cfg, tp.columns)
        elif tp.sharding_type in ROW_SHARDED:
            owner = row_owner(ids, len(tp.ranks))
            out = np.empty((ids.shape[0], cfg.value_width), dtype=np.float32)
            for g, r in enumerate(tp.ranks):
                mine = owner == g
                if mine.any():
                    out[mine] = self.readers[r].peek(table, ids[mine], True)
        else:
            out = self.readers[tp.ranks[0]].peek(table, ids, True)
        return out if with_state else np.ascontiguousarray(out[:, : cfg.dim])

    def close(self) -> None:
        """Close every shard's reader (idempotent)."""
        for reader in self.readers.values():
            reader.close()

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ShardedReader"]
