"""Row-wise Adagrad over column pieces: the row's sum of squares handed from piece to piece.

A row-wise Adagrad row keeps one state word: its float64 sum of squared (decayed)
gradients over every column, in column order (``step/update.py``).  Cut into column
pieces, that sum is a chain: piece 0 sums its columns from 0.0, piece 1 continues from
piece 0's sum, and so on; the last piece's sum is the whole row's, which every piece then
updates with (:class:`tiered_emb.step.backward.SplitRows`).  The chain crosses ranks in
rounds, one all-to-all each (round k: the owner of piece k sends on), in lockstep for
every such table of the plan: as many rounds as the most pieces any of them has.  The
result is the whole row's update bit for bit: the same additions in the same order.
"""

from __future__ import annotations

import numpy as np

from tiered_emb.config import TableConfig
from tiered_emb.distributed.plan import ShardingType, TablePlan
from tiered_emb.optimizers import RowWiseAdagrad


def chained_tables(planned: list[TablePlan], configs: dict[str, TableConfig]) -> list[TablePlan]:
    """The column-wise tables of ``planned`` whose optimizer keeps one state a row."""
    return [
        tp
        for tp in planned
        if tp.sharding_type is ShardingType.COLUMN_WISE and isinstance(configs[tp.table].optimizer, RowWiseAdagrad)
    ]


def run_chain(exchange, chained: list[TablePlan], splits: dict, dims: dict[str, int]) -> None:
    """The rounds, then every piece's update with the whole row's mean.

    ``splits[(table, piece)]``: this rank's :class:`~tiered_emb.step.backward.SplitRows` of
    each piece it holds.  A collective: every rank runs it, holding pieces or not.
    """
    rank, world = exchange.rank, exchange.world_size
    starts: dict[tuple[str, int], np.ndarray] = {}
    totals: dict[tuple[str, int], np.ndarray] = {}
    for k in range(max(len(tp.ranks) for tp in chained)):
        out: list[list[np.ndarray]] = [[] for _ in range(world)]
        for tp in chained:
            last = len(tp.ranks) - 1
            if k > last or tp.ranks[k] != rank:
                continue
            split = splits[(tp.table, k)]
            start = starts.pop((tp.table, k)) if k else np.zeros(split.uids.shape[0], dtype=np.float64)
            acc = split.square_sums(start)
            for r in [tp.ranks[k + 1]] if k < last else tp.ranks:  # on, or the whole row's sum to every piece
                out[r].append(acc)
        incoming = exchange.all_to_all(out)
        at = [0] * world
        for tp in chained:
            last = len(tp.ranks) - 1
            if k > last:
                continue
            src = tp.ranks[k]
            for i in [k + 1] if k < last else range(last + 1):
                if tp.ranks[i] == rank:
                    (starts if k < last else totals)[(tp.table, i)] = incoming[src][at[src]]
                    at[src] += 1
    for (table, i), split in sorted(splits.items()):
        split.update((totals[(table, i)] / dims[table]).astype(np.float32))


__all__ = ["chained_tables", "run_chain"]
