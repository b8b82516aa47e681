"""What the parts of the SSD tier share: one object instead of long constructor lists.

:class:`SsdSettings` is what an SSD tier is made from (its tables and how it runs: what
``TieredStore.create`` / ``open`` derive from the tables and ``TierConfig``).
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
from typing import TYPE_CHECKING, Any

from tiered_emb.tiers.ssd.held import HeldRows
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.written import WrittenIds

if TYPE_CHECKING:
    from tiered_emb.config import TableConfig, TierConfig


@dataclass(frozen=True)
class SsdSettings:
    """What an SSD tier is made of and how it runs, one value (:class:`~.tier.SsdTier`); a
    setting ``TierConfig`` also has defaults to its default there.

    Attributes
    ----------
    widths : table name -> record width (floats: weights, then optimizer state)
    rows : table name -> ``num_rows`` (a table not named, or None: ids unbounded)
    dtypes : table name -> its rows' dtype (``TableConfig.dtype``; a table not named: float32)
    compression : the zstd level of new segments (None: none)
    map_size_bytes : LMDB's first map size (it doubles by itself when full)
    writeback_rows : write-backs waiting in memory, all tables, that start a write into ``p:``
    background_writes : write-backs written by the writer thread while the step goes on
    budget_bytes : the rows an operation may hold at once (``TierConfig.budget_bytes``)
    keep_checkpoints : the checkpoints kept to restore (``TierConfig.keep_checkpoints``)
    tune_malloc : the writer returns freed memory to the system (``TierConfig.tune_malloc``)
    """

    widths: dict[str, int]
    rows: dict[str, int | None] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    compression: int | None = None
    map_size_bytes: int = 1 << 28
    writeback_rows: int = 1 << 16
    background_writes: bool = True
    budget_bytes: int = 256 << 20
    keep_checkpoints: int = 1
    tune_malloc: bool = True

    @classmethod
    def of(cls, tables: list[TableConfig], tiers: TierConfig, map_size_bytes: int) -> SsdSettings:
        """The settings of a store's SSD tier: its ``tables`` under ``tiers``, LMDB's map at
        ``map_size_bytes`` (an existing store's may be larger than ``tiers`` asks)."""
        return cls(
            widths={t.name: t.record_width for t in tables},
            rows={t.name: t.num_rows for t in tables},
            dtypes={t.name: t.dtype for t in tables},
            compression=tiers.ssd_compression,
            map_size_bytes=map_size_bytes,
            background_writes=tiers.background_writes,
            budget_bytes=tiers.budget_bytes,
            keep_checkpoints=tiers.keep_checkpoints or 1,  # (None: the store's default, one)
            tune_malloc=tiers.tune_malloc,
        )


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
