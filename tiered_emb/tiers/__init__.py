"""The three tiers: HBM (:mod:`.hbm`), DDR (:mod:`.ddr`) and SSD/LMDB (:mod:`.ssd`)."""
from .ddr import DdrTier
from .hbm import DirectHbmTier, HbmTier
from .ssd import SsdTier

__all__ = ["HbmTier", "DirectHbmTier", "DdrTier", "SsdTier"]
