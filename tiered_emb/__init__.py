"""tiered_emb: embedding tables across HBM, host DDR and LMDB on SSD, for recommendation training.

Importing this package never imports torch or cupy.
"""
from tiered_emb._version import __version__

from tiered_emb.config import Normal, TableConfig, TierConfig, Uniform  # noqa: E402
from tiered_emb.errors import *  # noqa: E402,F401,F403
from tiered_emb.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad  # noqa: E402
from tiered_emb.cache.policies import POLICIES  # noqa: E402
from tiered_emb.store import TieredStore  # noqa: E402

__all__ = ["TieredStore", "TableConfig", "TierConfig", "Uniform", "Normal", "SGD", "Adagrad", "RowWiseAdagrad",
           "Adam", "POLICIES", "__version__"]
