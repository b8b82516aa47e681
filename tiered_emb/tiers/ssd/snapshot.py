"""One checkpoint of an SSD tier, read beside the store's writer (a *reader*).

A reader opens the LMDB environment read-only, without the store's writer lock, and
holds one read transaction (:meth:`.LmdbEnv.pin`): LMDB's MVCC keeps every page that
transaction sees as it is, whatever the writer commits meanwhile, so the reader sees one
completed checkpoint, the same for every table.  In that transaction it reads the mark
of the checkpoint and indexes the segments below it, as the writer does when it opens
(:meth:`.SegmentLog.load`); rows are then gathered from the same segments by offset.
:meth:`SnapshotTier.refresh` pins a transaction at the newest checkpoint and moves the
index on to it, reading only the segments written or rewritten since (:mod:`.catchup`).

A reader takes one slot of LMDB's reader table while it holds its snapshot (two while a
read runs); the writer frees the slots of readers that died (:meth:`.LmdbEnv.clear_dead_readers`
at each checkpoint).  Pages a snapshot sees cannot be reused by the writer: a reader
that keeps an old snapshot for long makes the file grow; refresh it now and then.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import zstandard

from tiered_emb.errors import CorruptStoreError, StoreClosedError
from tiered_emb.tiers.ssd import catchup, codec, snapshots
from tiered_emb.tiers.ssd.context import SsdContext
from tiered_emb.tiers.ssd.held import HeldRows
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.reads import Reader
from tiered_emb.tiers.ssd.segments import SegmentGone, SegmentLog
from tiered_emb.tiers.ssd.verify import verify
from tiered_emb.tiers.ssd.written import WrittenIds


class SnapshotTier:
    """The rows of the last checkpoint of the SSD tier at ``path`` (tables of ``widths``,
    ``table_rows`` their ``num_rows``), read-only: :meth:`read`, :meth:`meta`,
    :attr:`extra`, :meth:`refresh`, :meth:`verify`, :meth:`close`."""

    def __init__(
        self,
        path: Path,
        widths: dict[str, int],
        table_rows: dict[str, int | None],
        budget_bytes: int,
        epoch: int | None = None,
        dtypes: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self.widths = dict(widths)
        self.dtypes = {n: codec.DTYPE_CODES[d] for n, d in sorted((dtypes or {}).items())}
        self.table_rows = {n: table_rows.get(n) for n in sorted(self.widths)}
        self._budget = budget_bytes
        self._lock = threading.Lock()
        self._zd = codec.PerThread(zstandard.ZstdDecompressor)
        self.lmdb = LmdbEnv(self.path, sorted(self.widths), 1 << 20, existing=True, readonly=True)
        self.segments: SegmentLog | None = None
        self._reader: Reader | None = None
        self.mark = 0
        self.meta: dict = {}
        self.extra: bytes | None = None
        self.kept: list[tuple[int, int | None]] = []
        #: refreshes that moved the index on (``caught_up``; the segments they read and forgot)
        #: and that built it from scratch (``indexed``)
        self.refreshes = {"caught_up": 0, "indexed": 0, "segments_read": 0, "segments_gone": 0}
        try:
            self.refresh(epoch)
        except BaseException:
            self.close()
            raise

    def refresh(self, epoch: int | None = None) -> None:
        """Move to the newest completed checkpoint (or kept checkpoint ``epoch``): a new
        snapshot, its index moved on from the old one's (:mod:`.catchup`: the segments
        written or rewritten since are read) or, where that cannot be, built again.  The old
        snapshot stays pinned until the new one is worked out (memory: both indexes while one
        is built again); if that fails, the old one is kept.  A catch-up that fails midway
        (some tables moved on) is followed by a build from scratch.  Where there is no old
        snapshot to go back to (that build failed too, or taking up a map the writer grew
        ended the old transaction, whose pages the writer may then reuse), the snapshot is
        dropped: reads raise :class:`~tiered_emb.errors.StoreClosedError` and the next
        refresh builds one again."""
        resizes = self.lmdb.map_resizes
        txn = self.lmdb.begin_read()
        old = self.lmdb.pin(txn)
        segments = plans = None
        # whether the old snapshot is gone: ended by taking up a map the writer grew (its pages
        # may be reused from now on), or its index began moving on in place
        moved = self.lmdb.map_resizes != resizes and old is not None
        try:
            with self.lmdb.corrupt_on_error("reading a snapshot of"), self.lmdb.reading() as pinned:
                db = self.lmdb.meta
                kept = snapshots.listed(pinned, db, self.path)
                if not kept:
                    raise CorruptStoreError(f"{self.path} has no meta record", "the store was never checkpointed")
                chosen = kept[-1][0] if epoch is None else epoch
                mark, meta, extra = snapshots.find(pinned, db, chosen, self.path, kept)
                info = [(e, snapshots.find(pinned, db, e, self.path, kept)[2]) for e, _, _ in kept]
            with self.lmdb.corrupt_on_error("reading"):
                plans = self._plans(old, txn, mark)
                if plans is not None:
                    moved = True
                    try:
                        self._catch_up(plans)
                    except Exception:  # (half moved on, some tables at the new snapshot: built again below)
                        plans = None
                if plans is None:
                    written = WrittenIds(self.lmdb)
                    ctx = SsdContext(
                        lmdb=self.lmdb,
                        widths=self.widths,
                        table_rows=self.table_rows,
                        lock=self._lock,
                        held=HeldRows(self.widths, self._lock),  # (a reader holds no write-backs)
                        written=written,
                        compression=None,
                        compressor=None,
                        decompressor=self._zd,
                        budget_bytes=self._budget,
                        dtypes=self.dtypes,
                    )
                    segments = SegmentLog(ctx)
                    for n in sorted(self.widths):
                        written.load(n, self.table_rows[n])
                        segments.load(n, below=mark)
        except BaseException:
            if segments is not None:
                segments.close()
            if moved:  # nothing to go back to: reads refuse until a refresh succeeds
                self._drop()  # (ends ``txn``, pinned)
                if old is not None:
                    old.abort()
                raise
            self.lmdb.pin(old)
            txn.abort()
            raise
        if plans is None:
            if self.segments is not None:
                self.segments.close()
            self.segments = segments
            self._reader = Reader(ctx, segments)
            self.refreshes["indexed"] += 1
        if old is not None:
            old.abort()
        self.mark, self.meta, self.extra = mark, meta, extra
        self.kept = [(e, None if x is None else len(x)) for e, x in info]

    def _catch_up(self, plans: list) -> None:
        """Move the index on in place by ``plans`` (:meth:`_plans`)."""
        for p in plans:
            self.segments.catch_up(p)
            self.refreshes["segments_read"] += len(p.fresh)
            self.refreshes["segments_gone"] += p.gone.shape[0]
        self.refreshes["caught_up"] += 1

    def _drop(self) -> None:
        """Forget the snapshot (a refresh failed after its index began moving on): nothing pinned,
        no index; :meth:`read` refuses and the next :meth:`refresh` indexes from scratch."""
        self.lmdb.unpin()
        if self.segments is not None:
            self.segments.close()
        self.segments = self._reader = None

    def _plans(self, old_txn, new_txn, mark: int) -> list | None:
        """Plans (:func:`.catchup.plan`) moving every table's index from the snapshot of
        ``old_txn`` to ``new_txn`` at ``mark``; None when it must be built from scratch (the
        first snapshot, an older checkpoint, a store that holds rows in ``t:``, or a plan
        that finds rows it cannot place)."""
        if self.segments is None or old_txn is None or any(self.lmdb.records[n] for n in self.widths):
            return None
        plans = []
        for n in sorted(self.widths):
            p = catchup.plan(self.segments, n, old_txn, new_txn, self.mark, mark)
            if p is None:
                return None
            plans.append(p)
        return plans

    def read(self, table: str, ids: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """Records of ``ids`` (int64, distinct) of the snapshot into ``out_rows``; the found mask."""
        if self._reader is None:
            raise self._dropped()
        try:
            return self._reader.read(table, ids, out_rows)
        except SegmentGone as gone:  # (nothing deletes a segment of a pinned snapshot)
            raise self.segments.gone(table, gone) from None

    def _dropped(self) -> StoreClosedError:
        return StoreClosedError(
            f"the reader of {self.path} has no snapshot: a refresh failed after it began moving its index on",
            "refresh it again (StoreReader.refresh), or open it again",
        )

    def rows(self, table: str) -> int:
        """Ids of ``table`` with a row in the snapshot (its segments; and ``t:`` of a format-2 store)."""
        if self.segments is None:
            raise self._dropped()
        n = len(self.segments.index[table])
        if self.lmdb.records[table]:
            n += self.lmdb.entries(self.lmdb.main[table])
        return n

    def verify(self) -> dict:
        """Check every stored byte (:func:`.verify.verify`); findings beyond the snapshot too."""
        return verify(self.lmdb, self.widths, self.table_rows, self._zd)

    def close(self) -> None:
        if self.segments is not None:
            self.segments.close()
            self.segments = None
        self.lmdb.close()


__all__ = ["SnapshotTier"]
