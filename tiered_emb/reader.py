"""A store read beside its writer: ``TieredStore.open(path, mode="r")``.

Any number of processes may read a store while one writer trains it: an evaluation job,
a server, a second trainer's lookups.  A reader takes no lock of the store, sees one
completed checkpoint (every table at the same one, never a half-written one) and moves
to the newest with :meth:`StoreReader.refresh`.  It reads rows from disk (through the
page cache), with no tiers of its own; what is on disk is :mod:`.tiers.ssd.snapshot`'s.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from numpy.typing import ArrayLike

from tiered_emb import _directory
from tiered_emb._args import snapshot_arg, table_ids
from tiered_emb._jit import move_rows
from tiered_emb.config import TableConfig
from tiered_emb.errors import ConfigError, ReadOnlyError, StoreClosedError, UnknownTableError
from tiered_emb.init import init_rows_into
from tiered_emb.precision import values_of
from tiered_emb.step.plan import dedupe
from tiered_emb.tiers.ssd.snapshot import SnapshotTier
from tiered_emb.tiers.ssd.verify import verify_path

#: what a writer does that a reader cannot
WRITES = frozenset(
    {
        "apply_gradients",
        "apply_pooled_gradients",
        "bring_up",
        "checkpoint",
        "delete",
        "flush",
        "gradient_update",
        "pooled_update",
        "prefetch",
        "read_ahead",
        "release",
        "set_learning_rate",
        "stepping",
        "write",
    }
)


class StoreReader:
    """The last checkpoint of the store at ``path``, read-only, beside its writer.

    :meth:`lookup` and :meth:`peek` answer as the writer's would have at that checkpoint
    (rows never written: their initial values); :meth:`refresh` moves to the newest
    checkpoint; :meth:`stats`, :meth:`verify`, :attr:`extra`, :attr:`epoch` report.  A
    call that would change the store raises :class:`~tiered_emb.errors.ReadOnlyError`.

    Examples
    --------
    >>> import tempfile, numpy as np
    >>> from tiered_emb import TieredStore, TableConfig, TierConfig
    >>> d = tempfile.mkdtemp() + "/s"
    >>> with TieredStore.create(d, [TableConfig("t", dim=2)], TierConfig(hbm_rows=4, device="cpu")) as w:
    ...     w.write("t", np.array([5]), np.ones((1, 2), np.float32))
    >>> with TieredStore.open(d, mode="r") as r:  # (from any process but a writer's: no lock taken)
    ...     r.lookup("t", np.array([5]))
    array([[1., 1.]], dtype=float32)
    """

    mode = "r"

    def __init__(self, path: str | os.PathLike[str], snapshot: int | None = None):
        self.path = Path(path)
        _, tables, tiers, seed = _directory.read_manifest(self.path)
        _directory.check_data_file(self.path)
        self.seed = seed
        #: the tiers the writer was last opened with (the manifest's): a reader has none of its own
        self.tiers = tiers
        self._tables = {t.name: t for t in tables}
        self._lock = threading.Lock()
        self._counts = {n: {"lookups": 0, "hits": 0, "misses": 0} for n in sorted(self._tables)}
        self._ssd: SnapshotTier | None = SnapshotTier(
            self.path / "lmdb",
            {t.name: t.record_width for t in tables},
            {t.name: t.num_rows for t in tables},
            tiers.budget_bytes,
            snapshot,
            {t.name: t.dtype for t in tables},
        )

    @classmethod
    def opened(
        cls, path: str | os.PathLike[str], mode: str, tiers: object, restore: str, snapshot: int | None = None
    ) -> StoreReader:
        """What ``TieredStore.open(path, tiers, restore, mode)`` gives for a ``mode`` other than "w"."""
        if mode != "r":
            raise ConfigError(f"mode={mode!r} is invalid", "use 'w' (the writer) or 'r' (a reader beside it)")
        if tiers is not None or restore != "checkpoint":
            raise ConfigError(
                "a reader (mode='r') sees the last checkpoint with no tiers of its own",
                "leave tiers and restore out with mode='r'",
            )
        snapshot_arg(snapshot)
        return cls(path, snapshot)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """End the snapshot (its reader slot is freed) and close the files (idempotent)."""
        with self._lock:
            if self._ssd is not None:
                self._ssd.close()
                self._ssd = None

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._ssd is None

    def _open(self) -> SnapshotTier:
        if self._ssd is None:
            raise StoreClosedError(
                f"reader of {str(self.path)!r} is closed", "open it again with TieredStore.open(path, mode='r')"
            )
        return self._ssd

    def refresh(self, snapshot: int | None = None) -> int:
        """Move to the newest completed checkpoint (or kept checkpoint ``snapshot``); returns
        its :attr:`epoch`."""
        snapshot_arg(snapshot)
        with self._lock:
            self._open().refresh(snapshot)
            return self.epoch

    @property
    def refreshes(self) -> dict[str, int]:
        """How this reader's refreshes went: ``caught_up`` moved its index on to the newer
        checkpoint (reading ``segments_read`` segments, forgetting ``segments_gone``),
        ``indexed`` built it from scratch (the first snapshot counts one)."""
        with self._lock:
            return dict(self._open().refreshes)

    def snapshots(self) -> list[int]:
        """The numbers of the checkpoints the store kept when this snapshot was taken."""
        return [e for e, _ in self._open().kept]

    def kept_checkpoints(self) -> list[dict[str, Any]]:
        """Each checkpoint kept: ``{"epoch", "extra_bytes"}`` (None: no ``extra``)."""
        return [{"epoch": e, "extra_bytes": n} for e, n in self._open().kept]

    # ------------------------------------------------------------------ reading
    @property
    def tables(self) -> dict[str, TableConfig]:
        """The store's tables by name (a copy), each with the learning rate of the checkpoint read."""
        rates = self._open().meta.get("lr", {})
        return {n: t.with_learning_rate(rates[n]) if n in rates else t for n, t in self._tables.items()}

    def table_config(self, table: str) -> TableConfig:
        """The configuration of ``table``; UnknownTableError (with the names there are) if none."""
        if table not in self._tables:
            raise UnknownTableError(f"no table {table!r} in {self.path}", f"tables: {sorted(self._tables)}")
        return self.tables[table]

    @property
    def epoch(self) -> int:
        """The number of the checkpoint this reader sees (how many the store had taken)."""
        return int(self._open().meta.get("epoch", 0))

    @property
    def extra(self) -> bytes | None:
        """The ``extra`` bytes saved with the checkpoint this reader sees (or an earlier one)."""
        return self._open().extra

    def lookup(self, table: str, ids: ArrayLike) -> np.ndarray:
        """Rows of ``ids`` at the checkpoint: float32 (n, dim), NumPy."""
        return self.peek(table, ids)

    def peek(self, table: str, ids: ArrayLike, with_state: bool = False) -> np.ndarray:
        """As :meth:`lookup`; with ``with_state`` whole records (n, dim + state_width)."""
        cfg = self.table_config(table)
        uids, inverse = dedupe(table_ids(table, ids, cfg.num_rows))
        rows = np.empty((uids.shape[0], cfg.record_width), dtype=np.float32)
        with self._lock:
            found = self._open().read(table, uids, rows)
            counts = self._counts[table]
            counts["lookups"] += uids.shape[0]
            counts["hits"] += int(found.sum())
            counts["misses"] += int((~found).sum())
        if not found.all():
            fresh = np.flatnonzero(~found)
            init_rows_into(cfg, uids[fresh], self.seed, rows, fresh)
        values = values_of(cfg, rows)  # (weights decoded from the table's dtype; float32: the records)
        width = cfg.value_width if with_state else cfg.dim
        out = np.empty((inverse.shape[0], width), dtype=np.float32)
        move_rows(values, inverse, out, None, width)  # (one copy a row, on the threads)
        return out

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per table: ``ssd`` with ``rows`` (ids with a row at the checkpoint), and the distinct
        ids looked up here (``lookups``), found on disk (``hits``) or initial (``misses``)."""
        with self._lock:
            ssd = self._open()
            return {n: {"ssd": dict(self._counts[n], rows=ssd.rows(n))} for n in sorted(self._tables)}

    def disk_bytes(self) -> int:
        """Bytes of the LMDB files on disk."""
        return sum(f.stat().st_size for f in (self.path / "lmdb").iterdir() if f.is_file())

    def verify(self) -> dict:
        """As :meth:`TieredStore.verify`: every stored byte checked (at the newest state on disk)."""
        with self._lock:
            return self._open().verify()

    def __getattr__(self, name: str) -> Callable[..., NoReturn]:
        if name not in WRITES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        def refuse(*args: object, **kwargs: object) -> NoReturn:
            raise ReadOnlyError(
                f"{name}() would change {str(self.path)!r}, open read-only (mode='r')",
                "open the store with TieredStore.open(path) to change it (one writer at a time)",
            )

        return refuse


def verify_store(path: str | os.PathLike[str]) -> dict:
    """Check every byte of the store at ``path`` (as :meth:`TieredStore.verify`), without its
    lock and without indexing it: beside a writer, or on a store too damaged to open.
    Memory: one segment at a time."""
    path = Path(path)
    _, tables, _, _ = _directory.read_manifest(path)
    _directory.check_data_file(path)
    widths = {t.name: t.record_width for t in tables}
    return verify_path(path / "lmdb", widths, {t.name: t.num_rows for t in tables}, {t.name: t.dtype for t in tables})


__all__ = ["WRITES", "StoreReader", "verify_store"]
