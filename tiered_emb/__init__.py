"""tiered_emb: embedding tables across HBM, host DDR and LMDB on SSD, for recommendation training.

Importing this package never imports torch or cupy.  Its messages go to the ``tiered_emb``
logger (:mod:`logging`), which shows nothing unless the application adds a handler (the
``tiered-emb`` command shows them on standard error).
"""

import logging

from tiered_emb._version import __version__
from tiered_emb.cache.policies import POLICIES
from tiered_emb.config import Normal, TableConfig, TierConfig, Uniform
from tiered_emb.errors import *  # noqa: F403
from tiered_emb.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad
from tiered_emb.reader import StoreReader, verify_store
from tiered_emb.store import TieredStore

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "POLICIES",
    "SGD",
    "Adagrad",
    "Adam",
    "Normal",
    "RowWiseAdagrad",
    "StoreReader",
    "TableConfig",
    "TierConfig",
    "TieredStore",
    "Uniform",
    "__version__",
    "verify_store",
]
