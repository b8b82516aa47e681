"""The SSD tier (LMDB): :class:`SsdTier`."""
from tiered_emb.tiers.ssd.tier import WRITER_PROCESS, SsdTier

__all__ = ["WRITER_PROCESS", "SsdTier"]
