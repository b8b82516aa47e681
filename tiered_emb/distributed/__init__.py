"""Sharded training over torch.distributed: a plan of where each table lives, each rank's
shards in its own store, ids and rows crossing ranks by all-to-all (gloo on CPU, NCCL on
a GPU), the updates bitwise one process's (docs/distributed.md).

The only package that imports ``torch.distributed``; importing it imports torch.
"""

from tiered_emb.distributed.collection import ShardedEmbeddingBagCollection, Shards
from tiered_emb.distributed.exchange import COMM_DTYPES
from tiered_emb.distributed.plan import ShardingPlan, ShardingType, TablePlan, row_owner
from tiered_emb.distributed.shards import open_shards, shard_path

__all__ = [
    "COMM_DTYPES",
    "ShardedEmbeddingBagCollection",
    "ShardingPlan",
    "ShardingType",
    "Shards",
    "TablePlan",
    "open_shards",
    "row_owner",
    "shard_path",
]
