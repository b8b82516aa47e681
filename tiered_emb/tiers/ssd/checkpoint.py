"""Checkpoints of the SSD tier: what is dirty written as segments, then the mark moved, atomically.

:meth:`Checkpointer.checkpoint` writes every row not yet in LMDB (the write-backs waiting
in memory and the dirty rows it is given) as segments of ``p:``, a bounded transaction
at a time, then writes the store's meta record and the new *mark* (the number of the
next segment) in one small write transaction: LMDB's atomic commit of that one makes the
checkpoint a single durable point.  The segments below the mark are the checkpoint's.
Its cost is the rows written since the last write-back, never the store's size.

A store reopens at its checkpoint (:meth:`~Checkpointer.discard_pending` deletes the
segments at or above the mark) or at its latest write (:meth:`~Checkpointer.promote_pending`
keeps them and moves the mark above them); either then indexes what is left, reading the
ids of each segment only.
"""

from __future__ import annotations

from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd import snapshots
from tiered_emb.tiers.ssd.context import SsdContext
from tiered_emb.tiers.ssd.segments import SegmentLog
from tiered_emb.tiers.ssd.writer import Writer

#: Segments a transaction of :meth:`Checkpointer.discard_pending` deletes at most.
DELETES_PER_TXN = 64


class Checkpointer:
    """Checkpoints, the choice of restore point at open, and the ``meta`` database."""

    def __init__(self, ctx: SsdContext, segments: SegmentLog, writer: Writer):
        self._lmdb = ctx.lmdb
        self._widths = dict(ctx.widths)
        self._held = ctx.held
        self._segments = segments
        self._writer = writer
        self._lock = ctx.lock
        #: how many checkpoints the store keeps (TierConfig.keep_checkpoints)
        self.keep = 1

    def checkpoint(self, batches, meta: dict, extra: bytes | None, blobs: dict | None = None, logs=None) -> int:
        """Make ``batches`` ({table: (ids, rows)}, or an iterable of them taken one at a time:
        :meth:`.Writer.write_pending`) and everything pending the new checkpoint, with
        ``meta`` (and ``blobs``: :func:`.snapshots.put`; ``logs``: ``(touch logs, the steps
        below which each table's go)``, :func:`.snapshots.put_logs`), atomically; returns
        the rows of ``batches``."""
        n = self._writer.write_pending(batches, durable=True)
        mark = self._segments.next_seq

        def fn(txn):
            self.put_meta(txn, meta, mark, extra, blobs)
            if logs is not None:
                snapshots.put_logs(txn, self._lmdb.meta, logs[0], self._lmdb.path)
                snapshots.drop_logs(txn, self._lmdb.meta, before=logs[1])

        self._lmdb.write(fn)
        self._segments.mark = mark  # (committed: compaction must keep the new checkpoint's copies)
        self._segments.marks = self.kept_marks()
        self._lmdb.env.sync(True)
        self._lmdb.clear_dead_readers()  # (a dead reader's snapshot would keep its pages from reuse)
        return n

    def put_meta(self, txn, meta: dict, mark: int, extra: bytes | None, blobs: dict | None = None) -> None:
        """The checkpoint's own transaction: its meta record, its mark, the trainer's bytes and ``blobs``."""
        snapshots.put(txn, self._lmdb.meta, meta, mark, extra, self.keep, blobs)

    def put_logs(self, logs: dict) -> None:
        """Write touch logs now, in a transaction of their own (:func:`.snapshots.put_logs`)."""
        self._lmdb.write(lambda txn: snapshots.put_logs(txn, self._lmdb.meta, logs, self._lmdb.path))

    def drop_logs_from(self, step: int) -> None:
        """Delete the touch logs of ``step`` and after (written after the checkpoint opened at)."""
        self._lmdb.write(lambda txn: snapshots.drop_logs(txn, self._lmdb.meta, from_step=step))

    def read_log(self, table: str, step: int):
        """The ids of ``table``'s touch log of ``step`` written so far."""
        with self._lmdb.corrupt_on_error("reading a touch log of"), self._lmdb.reading() as txn:
            return snapshots.read_log(txn, self._lmdb.meta, table, step, self._lmdb.path)

    def read_blob(self, name: str) -> bytes | None:
        """The blob ``name`` of the last checkpoint (None: none saved)."""
        epoch = int(self.read_meta().get("epoch", 0))
        with self._lmdb.corrupt_on_error("reading the checkpoint records of"), self._lmdb.reading() as txn:
            return snapshots.read_blob(txn, self._lmdb.meta, epoch, name, self._lmdb.path)

    def snapshots(self) -> list[tuple[int, int, dict]]:
        """``(epoch, mark, meta)`` of every checkpoint kept, oldest first."""
        with self._lmdb.corrupt_on_error("listing the checkpoints of"), self._lmdb.reading() as txn:
            return snapshots.listed(txn, self._lmdb.meta, self._lmdb.path)

    def kept_marks(self) -> list[int]:
        """The marks of the checkpoints kept, increasing (compaction keeps what each one reads)."""
        return sorted({mark for _, mark, _ in self.snapshots()} | {self._segments.mark})

    def open_at(self, epoch: int) -> None:
        """Open at kept checkpoint ``epoch``: it becomes the latest (the records of later ones
        dropped, in one transaction), then the segments written after it are deleted as by
        :meth:`discard_pending`."""
        with self._lmdb.corrupt_on_error("reading the checkpoints of"), self._lmdb.reading() as txn:
            snapshots.find(txn, self._lmdb.meta, epoch, self._lmdb.path)  # (raises before anything changes)
        self._lmdb.write(lambda txn: snapshots.back_to(txn, self._lmdb.meta, epoch, self._lmdb.path))
        self.discard_pending()

    def read_mark(self) -> int:
        """The mark of the last checkpoint (0 in a store of the format before marks: every
        segment there was written after its checkpoint)."""
        with self._lmdb.corrupt_on_error("reading the mark of"), self._lmdb.reading() as txn:
            return snapshots.read_mark(txn, self._lmdb.meta, self._lmdb.path)

    def discard_pending(self) -> None:
        """Open at the checkpoint: delete the segments written since, newest first, a bounded
        transaction at a time (a kill meanwhile leaves the writes up to some point, and the next
        open goes on), then index the rest."""
        mark = self.read_mark()
        for t in sorted(self._widths):
            db = self._lmdb.pending[t]
            while True:
                gone: list[int] = []

                def fn(txn, db=db, gone=gone, t=t):
                    gone.clear()
                    with txn.cursor(db=db) as cur:
                        # newest first: a kill meanwhile leaves the writes up to some point
                        while len(gone) < DELETES_PER_TXN and cur.last():
                            seq = int.from_bytes(cur.key(), "big")
                            if seq < mark:
                                break
                            if self._segments.moved_here(t, seq, cur.key(), cur.value()):
                                # (a damaged key may hide the checkpoint's own segment: never deleted)
                                raise self._segments.misplaced(t, seq)
                            gone.append(seq)
                            cur.delete()

                self._lmdb.write(fn)
                if not gone:
                    break
        with self._lmdb.corrupt_on_error("reading"), self._lmdb.reading() as txn:
            back = snapshots.going_back(txn, self._lmdb.meta)
        if back:  # (a going back to a checkpoint has now deleted all that came after it)
            self._lmdb.write(lambda txn: snapshots.gone_back(txn, self._lmdb.meta))
        self._segments.mark = mark
        self._load()
        with self._lock:
            self._held.written(None)

    def promote_pending(self) -> None:
        """Open at the latest write: keep the segments written since the checkpoint and make them its."""
        with self._lmdb.corrupt_on_error("reading"), self._lmdb.reading() as txn:
            back = snapshots.going_back(txn, self._lmdb.meta)
        if back:  # going back to a checkpoint was cut short: finish it (that checkpoint is the restore point)
            self.discard_pending()
            return
        self._segments.mark = self.read_mark()
        self._load()
        self.checkpoint({}, self.read_meta(), None)

    def _load(self) -> None:
        with self._lmdb.corrupt_on_error("reading"):
            for table in sorted(self._widths):
                self._segments.load(table)
        # the numbers from the mark on are the next writes' (below it: the checkpoint's)
        self._segments.next_seq = max(self._segments.next_seq, self._segments.mark)
        self._segments.marks = self.kept_marks()

    def read_meta(self) -> dict:
        """The meta record of the last checkpoint."""
        with self._lmdb.corrupt_on_error("reading the meta record of"), self._lmdb.reading() as txn:
            meta = snapshots.read_meta(txn, self._lmdb.meta, self._lmdb.path)
        if meta is None:
            raise CorruptStoreError(
                f"the LMDB environment {self._lmdb.path} has no meta record",
                "the store was never checkpointed; recreate it or restore a backup",
            )
        return meta

    def read_extra(self) -> bytes | None:
        """The trainer's bytes saved with the last checkpoint or one before it (None if none)."""
        with self._lmdb.corrupt_on_error("reading the extra record of"), self._lmdb.reading() as txn:
            kept = snapshots.listed(txn, self._lmdb.meta, self._lmdb.path)
            return snapshots.find(txn, self._lmdb.meta, kept[-1][0], self._lmdb.path)[2] if kept else None
