"""What the parts of the SSD tier share: one object instead of long constructor lists.

:class:`~tiered_emb.tiers.ssd.tier.SsdTier` (the writer's side) and
:class:`~tiered_emb.tiers.ssd.snapshot.StoreSnapshot` (a reader's side) each build one
:class:`SsdContext` and hand it to the parts they are made of: the segment log
(:mod:`.segments`), the read path (:mod:`.reads`), compaction (:mod:`.compaction`), the
write path (:mod:`.writer`) and checkpoints (:mod:`.checkpoint`).  Each part takes the
context and, besides it, only the other parts it calls and its own settings.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tiered_emb.tiers.ssd.held import HeldRows
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.written import WrittenIds


@dataclass(frozen=True)
class SsdContext:
    """The environment, the tables and the shared state of one SSD tier (or one reader of it).

    Attributes
    ----------
    lmdb : the LMDB environment and its databases
    widths : table name -> record width (floats: weights, then optimizer state)
    table_rows : table name -> ``num_rows`` (None: ids unbounded)
    lock : guards the held rows, the segment index and the written bits (short sections)
    held : write-backs waiting in memory and rows staged ahead of the step
    written : the bitmap of the ids ever written, per table
    compression : the zstd level of new segments (None: none)
    compressor, decompressor : per-thread zstd (de)compressors (``codec.PerThread``; the
        compressor None where nothing is compressed or nothing written)
    budget_bytes : the rows an operation may hold at once (``TierConfig.budget_bytes``)
    dtypes : table name -> its rows' dtype code (``codec.DTYPE_CODES``; a table not named:
        float32), written in each segment's header and checked on every read
    """

    lmdb: LmdbEnv
    widths: dict[str, int]
    table_rows: dict[str, int | None]
    lock: threading.Lock
    held: HeldRows
    written: WrittenIds
    compression: int | None
    compressor: Any
    decompressor: Any
    budget_bytes: int = 256 << 20
    dtypes: dict[str, int] = field(default_factory=dict)
    tables: list[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", sorted(self.widths))
