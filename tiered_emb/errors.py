"""Every error tiered_emb raises.

Each class derives from :class:`TieredEmbError` *and* the builtin a caller would
naturally catch (``ValueError``, ``KeyError``, ``OSError`` ...), and each message names
the field and the value given plus a hint of what to change.  A call that raises one of
these has changed nothing.
"""

from __future__ import annotations


class TieredEmbError(Exception):
    """Base of every tiered_emb error."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(f"{message}. Hint: {hint}" if hint else message)


class ConfigError(TieredEmbError, ValueError):
    """A configuration field has an invalid value."""


class DeviceError(TieredEmbError, RuntimeError):
    """The requested device (``device="cuda"``) is not usable."""


class UnknownTableError(TieredEmbError, KeyError):
    """A table name that the store does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return str(self.args[0])


class IdTypeError(TieredEmbError, TypeError):
    """Ids that are not integers."""


class IdRangeError(TieredEmbError, IndexError):
    """Ids that are negative or not below the table's ``num_rows``."""


class RowShapeError(TieredEmbError, ValueError):
    """Rows or gradients whose shape does not match (len(ids), dim)."""


class RowDtypeError(TieredEmbError, TypeError):
    """Rows or gradients of a dtype other than the table's."""


class NonFiniteGradientError(TieredEmbError, FloatingPointError):
    """A gradient (or a written row) holds NaN or infinity."""


class StoreExistsError(TieredEmbError, FileExistsError):
    """``TieredStore.create`` on a path that already exists."""


class StoreNotFoundError(TieredEmbError, FileNotFoundError):
    """``TieredStore.open`` on a path that holds no store."""


class StoreLockedError(TieredEmbError, BlockingIOError):
    """Another writer (in this or another process) holds the store."""


class CorruptStoreError(TieredEmbError, OSError):
    """The manifest or the LMDB environment cannot be read back."""


class StoreFormatError(TieredEmbError, ValueError):
    """A store written in a format this version does not read (the manifest names it)."""


class StoreFullError(TieredEmbError, OSError):
    """The disk under the store is full; the failed write was rolled back."""


class StoreClosedError(TieredEmbError, RuntimeError):
    """A call on a store after ``close()``."""


class PrefetchError(TieredEmbError, RuntimeError):
    """The background prefetch thread failed; raised in the step that needed its rows."""


class BackwardError(TieredEmbError, RuntimeError):
    """A second backward through an embedding output whose update the store already applied."""


class TraceFileError(TieredEmbError, OSError):
    """A trace file that is missing or not in the format it was read as."""


class MissingExtraError(TieredEmbError, ImportError):
    """An optional dependency (an extra such as ``bench``) is not installed."""


class ReadOnlyError(TieredEmbError, PermissionError):
    """A call that would change a store opened read-only (``TieredStore.open(path, mode="r")``)."""


class SnapshotNotFoundError(TieredEmbError, LookupError):
    """``open(path, snapshot=k)`` of a checkpoint the store no longer keeps (or never took)."""


class CopyError(TieredEmbError, TypeError):
    """Pickling or deep-copying a torch module whose rows live in a store (``torch.save(model)``)."""


class DistributedError(TieredEmbError, RuntimeError):
    """A tiered torch module trained where its rows would diverge across processes (DistributedDataParallel),
    or ranks of a sharded job that disagree (plans, batches) or stopped answering."""


class PlanError(TieredEmbError, ValueError):
    """A sharding plan that is invalid for its tables, or does not fit the ranks' limits."""


class StaleRowsWarning(UserWarning):
    """Dense weights loaded beside rows older than those they were saved with."""
