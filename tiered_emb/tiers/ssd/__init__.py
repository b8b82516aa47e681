"""The SSD tier: LMDB under the two in-memory tiers, one concern a module.

Read top to bottom: :mod:`.tier` (the :class:`SsdTier` facade, made from one
:class:`SsdSettings`), then what it holds:
:mod:`.lmdb_env` (environment, map growth, typed errors), :mod:`.written` (ids ever
written), :mod:`.held` and :mod:`.rowbuf` (rows held in memory), :mod:`.segments` and
:mod:`.index` (the segment log of ``p:``), :mod:`.reads`, :mod:`.writer` (writer thread),
:mod:`.writer_client` and :mod:`.writer_main` (the writer process, both sides),
:mod:`.compaction`, :mod:`.checkpoint`; :mod:`.codec` holds the bytes on disk and on
the pipe.
"""

from tiered_emb.tiers.ssd.context import SsdSettings
from tiered_emb.tiers.ssd.tier import SsdTable, SsdTier
from tiered_emb.tiers.ssd.writer_client import WRITER_PROCESS

__all__ = ["WRITER_PROCESS", "SsdSettings", "SsdTable", "SsdTier"]
