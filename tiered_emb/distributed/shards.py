"""Each rank's store of a sharded job: ``<root>/rank<r>``, holding the rank's shards."""

from __future__ import annotations

import os
from pathlib import Path

from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.distributed.plan import ShardingPlan
from tiered_emb.errors import PlanError
from tiered_emb.store import TieredStore


def shard_path(root: str | os.PathLike[str], rank: int) -> Path:
    """Where ``rank`` keeps its store under the job's ``root``."""
    return Path(root) / f"rank{rank:05d}"


def open_shards(
    root: str | os.PathLike[str],
    plan: ShardingPlan,
    tables: list[TableConfig],
    tiers: TierConfig,
    rank: int,
    seed: int = 0,
    snapshot: int | None = None,
) -> TieredStore | None:
    """This rank's store: created with its shards (:meth:`ShardingPlan.local_tables`) the
    first time, opened after, and checked to hold exactly those tables; None for a rank
    the plan gives no table.  ``seed`` must be the same on every rank: with the table and
    the id it fixes each row's first value, wherever the row lives.  ``snapshot``: open an
    existing store at that kept checkpoint (the one a job's manifest names for this rank)."""
    plan.check(tables)
    if not 0 <= rank < plan.world_size:
        raise PlanError(f"rank {rank} of a plan for {plan.world_size} ranks", f"use a rank in 0..{plan.world_size - 1}")
    local = plan.local_tables(rank, tables)
    if not local:
        return None
    path = shard_path(root, rank)
    if not path.exists():
        Path(root).mkdir(parents=True, exist_ok=True)
        return TieredStore.create(path, local, tiers, seed=seed)
    store = TieredStore.open(path, tiers, snapshot=snapshot)
    held = sorted(store.tables)
    if held != sorted(c.name for c in local) or store.engine.seed != seed:
        store.close()
        raise PlanError(
            f"{path} holds tables {held} (seed {store.engine.seed}); this plan gives rank {rank} "
            f"{sorted(c.name for c in local)} (seed {seed})",
            "open the root this plan was made for, or reshard it",
        )
    return store


__all__ = ["open_shards", "shard_path"]
