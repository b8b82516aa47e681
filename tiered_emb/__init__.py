"""tiered_emb: embedding tables across HBM, host DDR and LMDB on SSD, for recommendation training.

Importing this package never imports torch or cupy.  Its messages go to the ``tiered_emb``
logger (:mod:`logging`), which shows nothing unless the application adds a handler (the
``tiered-emb`` command shows them on standard error).
"""

import logging

from tiered_emb import _kernel_cache

_kernel_cache.use()  # (before any module with a kernel is imported)

from tiered_emb._version import __version__  # noqa: E402
from tiered_emb.cache.policies import POLICIES  # noqa: E402
from tiered_emb.config import Normal, TableConfig, TierConfig, Uniform  # noqa: E402
from tiered_emb.errors import *  # noqa: F403, E402
from tiered_emb.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad  # noqa: E402
from tiered_emb.reader import StoreReader, verify_store  # noqa: E402
from tiered_emb.store import TieredStore  # noqa: E402

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
