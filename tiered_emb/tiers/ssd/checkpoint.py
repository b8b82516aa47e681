"""Checkpoints of the SSD tier: ``p:`` folded into ``t:``, and the meta record, atomically.

:meth:`Checkpointer.checkpoint` folds the newest copy of each row of ``p:`` (and every
write-back waiting in memory) into ``t:``, drops ``p:`` and writes the store's meta
record in *one* write transaction, so LMDB's atomic commit makes the checkpoint a single
durable point.  A store reopens at its checkpoint (:meth:`~Checkpointer.discard_pending`
drops ``p:``) or at its latest write (:meth:`~Checkpointer.promote_pending` reads ``p:``
and makes it the checkpoint).
"""

from __future__ import annotations

import json
import threading

import numpy as np

from tiered_emb.errors import ConfigError, CorruptStoreError
from tiered_emb.tiers.ssd import codec
from tiered_emb.tiers.ssd.held import HeldRows
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.rowbuf import RowBuffer
from tiered_emb.tiers.ssd.segments import SegmentLog
from tiered_emb.tiers.ssd.writer import Writer
from tiered_emb.tiers.ssd.written import WrittenIds


class Checkpointer:
    """Checkpoints, the choice of restore point at open, and the ``meta`` database.

    ``legacy_pending``: ``p:`` holds rows as an older version wrote them (a record per id;
    format tiered_emb/1): only dropped (:meth:`discard_pending`), never read.
    """

    def __init__(
        self,
        lmdb_env: LmdbEnv,
        widths: dict[str, int],
        held: HeldRows,
        segments: SegmentLog,
        written: WrittenIds,
        writer: Writer,
        lock: threading.Lock,
        compressor,
    ):
        self._lmdb = lmdb_env
        self._widths = dict(widths)
        self._held = held
        self._segments = segments
        self._written = written
        self._writer = writer
        self._lock = lock
        self._zc = compressor
        self.legacy_pending = False

    def checkpoint(self, batches: dict[str, tuple[np.ndarray, np.ndarray]], meta: dict, extra: bytes | None) -> int:
        """Make ``batches`` and everything pending the new checkpoint, with ``meta``, atomically."""
        batches = {t: b for t, b in sorted(batches.items()) if b[0].shape[0]}
        self._writer.wait_writes()
        with self._lock:
            snaps = self._held.waiting()
        main, pending = self._lmdb.main, self._lmdb.pending

        def fn(txn):
            for t in sorted(self._widths):
                if len(self._segments.index[t]):  # the newest copy of each row of p:, in id order
                    codec.put_rows(txn, main[t], *self._segments.read_live(txn, t), self._zc)
                txn.drop(pending[t], delete=False)
            self.put_waiting(txn, snaps)
            for t in sorted(batches):
                self.put_rows(txn, t, main[t], *batches[t])
            txn.put(b"meta", json.dumps(meta, sort_keys=True).encode(), db=self._lmdb.meta)
            if extra is not None:
                txn.put(b"extra", bytes(extra), db=self._lmdb.meta)

        self._lmdb.write(fn)
        with self._lock:
            self._segments.dropped()
            self._held.committed()
            self._writer.forget_failure()
            self._held.written(None)
        self._lmdb.env.sync(True)
        return sum(b[0].shape[0] for b in batches.values())

    def put_rows(self, txn, table: str, db, ids: np.ndarray, rows: np.ndarray) -> None:
        """Put ``rows`` under ``ids`` in ``db`` of ``table``, their written bits set first."""
        with self._lock:  # before the commit (rows from the write-back buffer have theirs already)
            self._written.set(table, ids)
        codec.put_rows(txn, db, ids, rows, self._zc)

    def put_waiting(self, txn, snaps: list[dict[str, RowBuffer]]) -> None:
        """Write write-back snapshots, oldest first, into ``t:`` (a checkpoint)."""
        for snap in snaps:
            for t, buf in sorted(snap.items()):
                if len(buf):
                    self.put_rows(txn, t, self._lmdb.main[t], *buf.items())

    def discard_pending(self) -> None:
        """Drop what was written since the last checkpoint (reopen at the checkpoint)."""

        def fn(txn):
            for t in sorted(self._widths):
                txn.drop(self._lmdb.pending[t], delete=False)

        self._lmdb.write(fn)
        with self._lock:
            self._segments.dropped()
            self._held.written(None)
        self.legacy_pending = False

    def promote_pending(self) -> None:
        """Keep what was written since the last checkpoint (reopen at the latest flush)."""
        if self.legacy_pending:
            raise ConfigError(
                f"the rows written after the last checkpoint of {self._lmdb.path} are in the format of "
                "an older tiered_emb (tiered_emb/1), which restore='latest' does not read",
                "open it with restore='checkpoint' (those rows are given up), or reopen it with the "
                "version that wrote it and checkpoint it there",
            )
        with self._lmdb.corrupt_on_error("reading"):
            for table in sorted(self._widths):
                self._segments.load(table)
        self.checkpoint({}, self.read_meta(), None)

    def read_meta(self) -> dict:
        """The meta record of the last checkpoint."""
        with self._lmdb.corrupt_on_error("reading the meta record of"), self._lmdb.reading() as txn:
            v = txn.get(b"meta", db=self._lmdb.meta)
        if v is None:
            raise CorruptStoreError(
                f"the LMDB environment {self._lmdb.path} has no meta record",
                "the store was never checkpointed; recreate it or restore a backup",
            )
        try:
            return json.loads(bytes(v))
        except ValueError as err:
            raise CorruptStoreError(
                f"the meta record of {self._lmdb.path} is not JSON", "restore from a backup"
            ) from err

    def read_extra(self) -> bytes | None:
        """The trainer's bytes saved with a checkpoint (None if none)."""
        with self._lmdb.corrupt_on_error("reading the extra record of"), self._lmdb.reading() as txn:
            v = txn.get(b"extra", db=self._lmdb.meta)
        return None if v is None else bytes(v)
