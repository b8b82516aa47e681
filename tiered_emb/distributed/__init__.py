"""Sharded training over torch.distributed: a plan of where each table lives, each rank's
shards in its own store, ids and rows crossing ranks by all-to-all (gloo on CPU, NCCL on
a GPU), the updates bitwise one process's (docs/distributed.md).

The only package that imports ``torch.distributed``; importing it imports torch.

- a plan: :class:`ShardingPlan` (by hand, or :func:`plan_tables` from the tables, the
  ranks' :class:`RankLimits` and :func:`table_loads` of a few batches; :func:`describe`
  prints its :func:`estimate`);
- each rank's store: :func:`open_shards`;
- the modules: :class:`ShardedEmbeddingBagCollection`, or :class:`Shards` for TorchRec's
  collection (``tiered_emb.torchrec.TieredEmbeddingBagCollection(..., sharded=shards)``);
- ranks: :func:`run_ranks` (on this machine) or :func:`init_from_env` (under torchrun);
- another plan or world size: :func:`reshard`;
- serving a checkpoint: :class:`ShardedReader` (one store reader per shard, one global checkpoint).
"""

from tiered_emb.distributed.collection import ShardedEmbeddingBagCollection, Shards
from tiered_emb.distributed.exchange import COMM_DTYPES
from tiered_emb.distributed.launch import init_from_env, run_ranks
from tiered_emb.distributed.plan import ShardingPlan, ShardingType, TablePlan, row_owner
from tiered_emb.distributed.planner import RankLimits, TableLoad, describe, estimate, plan_tables, table_loads
from tiered_emb.distributed.reshard import reshard
from tiered_emb.distributed.serving import ShardedReader
from tiered_emb.distributed.shards import open_shards, shard_path

__all__ = [
    "COMM_DTYPES",
    "RankLimits",
    "ShardedEmbeddingBagCollection",
    "ShardedReader",
    "ShardingPlan",
    "ShardingType",
    "Shards",
    "TableLoad",
    "TablePlan",
    "describe",
    "estimate",
    "init_from_env",
    "open_shards",
    "plan_tables",
    "reshard",
    "row_owner",
    "run_ranks",
    "shard_path",
    "table_loads",
]
