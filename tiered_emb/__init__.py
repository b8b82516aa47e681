"""tiered_emb: embedding tables across HBM, host DDR and LMDB on SSD, for recommendation training.

Importing this package never imports torch or cupy.
"""
__version__ = "0.1.0"

from .config import Normal, TableConfig, TierConfig, Uniform  # noqa: E402
from .errors import *  # noqa: E402,F401,F403
from .optimizers import SGD, Adagrad, Adam, RowWiseAdagrad  # noqa: E402
from .policies import POLICIES  # noqa: E402
from .store import TieredStore  # noqa: E402

__all__ = ["TieredStore", "TableConfig", "TierConfig", "Uniform", "Normal", "SGD", "Adagrad", "RowWiseAdagrad",
           "Adam", "POLICIES", "__version__"]
