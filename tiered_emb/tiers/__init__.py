"""The three tiers: HBM (:mod:`.hbm`), DDR (:mod:`.ddr`) and SSD/LMDB (:mod:`.ssd`)."""

from tiered_emb.tiers.ddr import DdrTier
from tiered_emb.tiers.hbm import DirectHbmTier, HbmTier
from tiered_emb.tiers.protocol import Tier
from tiered_emb.tiers.ssd import SsdSettings, SsdTable, SsdTier

__all__ = ["DdrTier", "DirectHbmTier", "HbmTier", "SsdSettings", "SsdTable", "SsdTier", "Tier"]
