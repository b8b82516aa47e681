"""The SSD tier: every row ever written, in one LMDB environment per store.

Rows live in ``p:<table>`` as *segments* (:mod:`.segments`): each write transaction
appends one value per table holding all its rows, found through an index in memory and
read from a map of the file (:mod:`.mapped`).  A checkpoint writes what is dirty and
moves a mark that says which segments are the checkpoint's (:mod:`.checkpoint`):
reopening deletes the segments above it and finds exactly the last checkpoint (or keeps
them, with ``restore="latest"``).  Compaction rewrites runs of segments that hold stale
copies (:mod:`.compaction`).  ``t:<table>`` holds rows one record per id only in stores
of the format before segments (read below the segments, never written).  Every
operation holds at most ``budget_bytes`` of rows at once beyond the index and the
write-backs waiting in memory.  The map doubles by itself when full; a full disk raises
:class:`~tiered_emb.errors.StoreFullError` after the transaction is rolled back
(:mod:`.lmdb_env`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import zstandard

from tiered_emb.errors import CorruptStoreError, UnknownTableError
from tiered_emb.tiers.protocol import put_arrays
from tiered_emb.tiers.ssd import codec
from tiered_emb.tiers.ssd.checkpoint import Checkpointer
from tiered_emb.tiers.ssd.codec import is_tombstone
from tiered_emb.tiers.ssd.compaction import Compactor
from tiered_emb.tiers.ssd.context import SsdContext, SsdSettings
from tiered_emb.tiers.ssd.held import HeldRows
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.reads import Reader
from tiered_emb.tiers.ssd.segments import SegmentLog
from tiered_emb.tiers.ssd.verify import verify
from tiered_emb.tiers.ssd.writer import Writer
from tiered_emb.tiers.ssd.written import WrittenIds


class SsdTier:
    """Every row ever written to a store, in LMDB at ``path``, for the tables of its
    :class:`.SsdSettings` (name -> record width: weights, then optimizer state).

    What it holds, each part a module of this package:

    - :attr:`lmdb` (:class:`.LmdbEnv`): the environment, its databases, map growth;
    - :attr:`written` (:class:`.WrittenIds`): a bitmap of the ids ever written, per table
      with ``num_rows`` (``SsdSettings.rows``): the others are never looked up;
    - :attr:`held` (:class:`.HeldRows`): write-backs waiting in memory (the buffer, then
      snapshots being written) and rows staged ahead of the step;
    - :attr:`segments` (:class:`.SegmentLog`): the segments of ``p:`` and their index;
    - :attr:`reader`, :attr:`writer`, :attr:`compactor`, :attr:`checkpoints`: the read
      path, the write path (writer thread and writer process), compaction of ``p:``, and
      checkpoints with the meta record.

    A read (:meth:`read`) skips ids whose written bit is clear, takes the newest copy of
    the others from memory (under the tier's lock), then reads the rest from LMDB in
    transactions begun after that look: the segments of ``p:`` the index names (one get
    per segment), then ``t:`` in key order.  A write-back (:meth:`write_pending` with
    ``durable=False``) sets the rows' bits and puts them in the buffer; once
    ``writeback_rows`` wait, the buffer becomes a snapshot, cut into segments and appended
    to ``p:`` in one transaction on the writer thread (through the writer process on
    POSIX), and the snapshot leaves the read path once its segments are indexed.  A
    durable write and a checkpoint do the same in this thread, with every waiting row.
    """

    def __init__(self, path: Path, settings: SsdSettings, existing: bool = False):
        """The tier in LMDB at ``path`` (a new environment there, or with ``existing`` the
        store's own), made as ``settings`` say (:class:`.SsdSettings`)."""
        self.path = Path(path)
        self.widths = dict(settings.widths)
        #: table name -> the code of its rows' dtype in segment headers (``codec.DTYPE_CODES``)
        self.dtypes = {n: codec.DTYPE_CODES[d] for n, d in sorted(settings.dtypes.items())}
        compression = self.compression = settings.compression
        budget_bytes = settings.budget_bytes
        tables = sorted(self.widths)
        # Guards the held rows, the segment index and the written bits (short sections only):
        # moving rows from a snapshot to p: must look atomic to a reader.
        self._lock = threading.Lock()
        self.held = HeldRows(self.widths, self._lock)
        self.staging = self.held.staging  # staged reads: counts of reads, rows, rows used, reads discarded
        zc = codec.PerThread(lambda: zstandard.ZstdCompressor(level=compression)) if compression else None
        zd = codec.PerThread(zstandard.ZstdDecompressor)
        self.lmdb = LmdbEnv(self.path, tables, settings.map_size_bytes, existing)
        table_rows = {n: settings.rows.get(n) for n in tables}
        self.table_rows, self._zd = table_rows, zd
        self.written = WrittenIds(self.lmdb)
        ctx = SsdContext(
            lmdb=self.lmdb,
            widths=self.widths,
            table_rows=table_rows,
            lock=self._lock,
            held=self.held,
            written=self.written,
            compression=compression,
            compressor=zc,
            decompressor=zd,
            budget_bytes=budget_bytes,
            dtypes=self.dtypes,
        )
        self.segments = SegmentLog(ctx)
        self.reader = Reader(ctx, self.segments)
        self.compactor = Compactor(ctx, self.segments)
        malloc_trim = budget_bytes // 4 if settings.tune_malloc else 0
        self.writer = Writer(
            ctx, self.segments, self.compactor, settings.writeback_rows, settings.background_writes, malloc_trim
        )
        self.checkpoints = Checkpointer(ctx, self.segments, self.writer)
        self.checkpoints.keep = settings.keep_checkpoints
        # ``p:`` is read (SegmentLog.load) by discard_pending or promote_pending, one of which
        # every store runs as it opens.
        try:
            with self.lmdb.corrupt_on_error("reading"):
                for n in tables:
                    self.written.load(n, table_rows[n])
        except BaseException:
            self.segments.close()
            self.lmdb.env.close()
            raise

    # ----------------------------------------------------------------- settings
    @property
    def writeback_rows(self) -> int:
        """Write-backs waiting in memory, all tables, that start a write into ``p:``."""
        return self.writer.writeback_rows

    @writeback_rows.setter
    def writeback_rows(self, rows: int) -> None:
        self.writer.writeback_rows = int(rows)

    @property
    def background_writes(self) -> bool:
        """Whether write-backs are written by the writer thread (the step goes on meanwhile)."""
        return self.writer.background_writes

    @property
    def writer_process(self) -> bool:
        """Whether the writer thread hands its writes to a writer process (False once one could not start)."""
        return self.writer.writer_process

    # ----------------------------------------------------------------- reads
    def read(self, table: str, ids: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """Read the records of ``ids`` (int64 (k,), distinct) into ``out_rows`` (k, W).

        Returns the found mask (bool (k,)).

        Newest copy first: the write-back buffer, the snapshots being written, then
        rows staged for this batch (equal to LMDB's), then ``p:``, then ``t:``.  Ids
        whose written bit is clear are nowhere here and are not looked up at all.
        """
        return self.reader.read(table, ids, out_rows)

    def stage(self, key: int, batch: dict[str, np.ndarray]) -> bool:
        """Read the LMDB records of ``batch`` ({table: distinct ids}) ahead of the step that needs them.

        Runs on any thread and takes none of the store's locks.  The rows are held under
        ``key`` until :meth:`unstage`; :meth:`read` then answers them from memory.  A
        read that overlapped an LMDB write is dropped (returns False): its rows may be
        older than the write.
        """
        return self.reader.stage(key, batch)

    def unstage(self, key: int) -> None:
        """Drop the rows staged under ``key``."""
        self.held.unstage(key)

    # ----------------------------------------------------------------- writes
    def write_pending(self, batches, durable: bool = True, defer_errors: bool = False) -> int:
        """Write ``{table: (ids, rows)}`` into the since-checkpoint databases; returns rows written.

        ``durable=False`` (write-backs of evicted rows): the rows wait in memory with the
        others until ``writeback_rows`` are waiting, then all go out in one transaction
        (on the writer thread with ``background_writes``); reads see them at once; a failed
        write is raised, or with ``defer_errors`` kept for :meth:`raise_failed_write`.
        ``durable=True`` writes every waiting row and then ``batches`` (a dict, or an iterable
        of dicts taken one at a time), now, a bounded transaction at a time.
        """
        return self.writer.write_pending(batches, durable, defer_errors)

    def write_sorted(self, table: str, ids: np.ndarray, rows: np.ndarray, defer_errors: bool = False) -> None:
        """Write ``rows`` (records) under ``ids`` (distinct, increasing) of ``table`` as one bulk
        write (:meth:`.Writer.write_sorted`): in the background with ``background_writes``."""
        self.writer.write_sorted(table, ids, rows, defer_errors)

    def raise_failed_write(self) -> None:
        """Raise the failure of an earlier write-back, once (its rows still wait in memory)."""
        self.writer.raise_failed_write()

    @property
    def failed_write(self) -> BaseException | None:
        """The failure of an earlier write-back not yet raised (None if there is none)."""
        return self.writer.failed

    @property
    def writing(self) -> bool:
        """Whether a write-back, or the index's merge after one, runs in the background now
        (it ends by itself)."""
        return self.writer.writing

    def wait_writes(self) -> None:
        """Wait for the writer thread; its error, if any, is raised by the next durable write."""
        self.writer.wait_writes()

    def compact(self, tables: list[str] | None = None) -> None:
        """Rewrite every run of segments of ``tables`` (None: those past the bound of
        :class:`.Compactor`) that holds stale copies.  Under the store's lock, with no write in flight."""
        self.writer.wait_writes()
        due = self.compactor.due() if tables is None else sorted(tables)
        if due:
            self.compactor.compact(due)

    def purge(self, tables: list[str]) -> None:
        """Rewrite every segment of ``tables`` that holds a stale copy (:meth:`.Compactor.purge`).
        Under the store's lock, with no write in flight."""
        self.writer.wait_writes()
        self.compactor.purge(sorted(tables))

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self, batches, meta: dict, extra: bytes | None, blobs: dict | None = None, logs=None) -> int:
        """Make ``batches`` (a dict or an iterable of them: :meth:`write_pending`) and everything
        pending the new checkpoint, with ``meta``, ``blobs`` (name -> bytes) and touch ``logs``
        (:meth:`.Checkpointer.checkpoint`), atomically."""
        return self.checkpoints.checkpoint(batches, meta, extra, blobs, logs)

    def read_blob(self, name: str) -> bytes | None:
        """The blob ``name`` saved with the last checkpoint, or before it (None: none)."""
        return self.checkpoints.read_blob(name)

    def discard_pending(self) -> None:
        """Drop what was written since the last checkpoint (reopen at the checkpoint)."""
        self.writer.wait_writes()
        self.checkpoints.discard_pending()

    def promote_pending(self) -> None:
        """Keep what was written since the last checkpoint (reopen at the latest flush)."""
        self.writer.wait_writes()
        self.checkpoints.promote_pending()

    def open_at(self, epoch: int) -> None:
        """Open at kept checkpoint ``epoch`` (:meth:`.Checkpointer.open_at`)."""
        self.writer.wait_writes()
        self.checkpoints.open_at(epoch)

    def snapshots(self) -> list[tuple[int, int, dict]]:
        """``(epoch, mark, meta)`` of every checkpoint kept, oldest first."""
        return self.checkpoints.snapshots()

    def read_meta(self) -> dict:
        """The meta record of the last checkpoint."""
        return self.checkpoints.read_meta()

    def read_extra(self) -> bytes | None:
        """The trainer's bytes saved with a checkpoint (None if none)."""
        return self.checkpoints.read_extra()

    # ----------------------------------------------------------------- introspection
    def table_stats(self, table: str) -> dict:
        """``rows`` (ids held: the segments' live rows, and the records of ``t:``), ``bytes``
        (LMDB pages of both), ``stored_rows`` (every copy the segments hold, stale ones too),
        and ``writeback_rows`` waiting in memory for the next write."""
        out = self.lmdb.db_stats(table)
        with self._lock:
            live = len(self.segments.index[table])
            return {
                "rows": out["rows"] + live,
                "bytes": out["bytes"] + out["pending_bytes"],
                "stored_rows": self.segments.stored_rows[table],
                "writeback_rows": self.held.waiting_rows(table),
            }

    def pending_rows(self, table: str) -> dict:
        """Rows written since the checkpoint: ``live`` (ids whose newest copy was) and
        ``stored`` (every copy the segments above the mark hold, stale ones too)."""
        self.writer.wait_writes()  # (no other change to the index while the writer thread runs)
        with self.lmdb.reading() as txn, txn.cursor(db=self.lmdb.pending[table]) as cur:
            above = []
            if cur.set_range(codec.segment_key(self.segments.mark)):
                above = [int.from_bytes(k, "big") for k in cur.iternext(keys=True, values=False)]
        with self._lock:
            return {"live": self.segments.pending(table)[0].shape[0], "stored": self.segments.nrows_of(above)}

    def pending_ids(self, table: str) -> np.ndarray:
        """The ids (int64, increasing) whose newest copy was written since the checkpoint."""
        self.writer.wait_writes()
        with self._lock:
            return self.segments.pending(table)[0]

    def stored_ids(self, table: str, chunk_rows: int = 1 << 20):
        """``(count, chunks)``: at most how many ids have a row in LMDB (the index's, tombstones
        of deleted rows included), and a generator of the ids that do (int64, increasing),
        at most ``chunk_rows`` at a time (:meth:`stored_rows`, their rows dropped)."""
        count, parts = self.stored_rows(table, chunk_rows)
        return count, (ids for ids, _ in parts)

    def stored_rows(self, table: str, chunk_rows: int = 1 << 20):
        """``(count, chunks)`` as :meth:`stored_ids`, each chunk ``(ids, records)``: the ids
        come from the index as it goes (a store of the format before segments: its ``t:``
        keys too, all at once), their records are read and the deleted ones skipped.
        Nothing may write to the tier meanwhile."""
        self.writer.wait_writes()
        ix = self.segments.index[table]
        with self._lock:
            ix.merge()
        if self.lmdb.records[table]:
            with self.lmdb.reading() as txn, txn.cursor(db=self.lmdb.main[table]) as cur:
                keys = b"".join(cur.iternext(keys=True, values=False))
            ids = np.union1d(ix.ids_between(0, len(ix)), np.frombuffer(keys, dtype=">i8").astype(np.int64))
            count, pieces = ids.shape[0], (ids[a : a + chunk_rows] for a in range(0, ids.shape[0], chunk_rows))
        else:
            count = len(ix)
            pieces = (ix.ids_between(a, a + chunk_rows) for a in range(0, count, chunk_rows))
        return count, (self._live(table, ids) for ids in pieces)

    def _live(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, records)`` of those of ``ids`` (listed by the index) whose row is not deleted."""
        rows = np.zeros((ids.shape[0], self.widths[table]), dtype=np.float32)  # (no word of a tombstone)
        found = self.read(table, ids, rows)
        if found.all():
            return ids, rows
        stored = np.zeros(ids.shape[0], dtype=bool)
        stored[self.written.maybe_stored(table, ids, np.arange(ids.shape[0]))] = True
        tombs = ~found & stored & is_tombstone(rows)
        if (~found & ~tombs).any():
            raise CorruptStoreError(
                f"table {table!r} of {self.path} lists rows it cannot read", "restore the store directory from a backup"
            )
        return ids[found], rows[found]

    def table(self, name: str) -> SsdTable:
        """Table ``name`` of this tier as a :class:`~tiered_emb.tiers.protocol.Tier`."""
        return SsdTable(self, name)

    def verify(self) -> dict:
        """Check every stored byte (:func:`.verify.verify`): what was checked and each damaged record."""
        return verify(self.lmdb, self.widths, self.table_rows, self._zd, self.dtypes)

    def index_bytes(self) -> int:
        """Bytes of RAM the SSD tier's index takes: the segment index and the written bits."""
        with self._lock:
            return self.segments.index_bytes() + self.written.nbytes()

    def file_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def writer_pid(self) -> int | None:
        """The writer process's pid while it runs (None before the first background write)."""
        proc = self.writer.process
        return proc.proc.pid if proc is not None else None

    def writer_handle(self):
        """The writer process's :class:`subprocess.Popen` while it runs (None before the first
        background write, after :meth:`close`, or where writes stay in this process)."""
        proc = self.writer.process
        return proc.proc if proc is not None else None

    def close(self) -> None:
        """Wait for the writer thread, end the writer process and close the environment
        (waiting write-backs are not written)."""
        self.writer.close()
        self.segments.close()
        self.lmdb.env.close()


class SsdTable:
    """One table of an :class:`SsdTier` as a :class:`~tiered_emb.tiers.protocol.Tier`: no
    capacity (every row ever written), a put a write-back (:meth:`SsdTier.write_pending`,
    not durable until the next checkpoint) that pushes nothing out, a read
    :meth:`SsdTier.read` (a deleted row is not found)."""

    capacity_rows: int | None = None

    def __init__(self, tier: SsdTier, name: str):
        if name not in tier.widths:
            raise UnknownTableError(
                f"no table {name!r} in the SSD tier at {tier.path}", f"tables: {sorted(tier.widths)}"
            )
        self.tier, self.name, self.width = tier, name, tier.widths[name]

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.zeros((np.shape(ids)[0], self.width), dtype=np.float32)
        found = self.tier.read(self.name, np.ascontiguousarray(ids, dtype=np.int64), rows)
        rows[~found] = 0.0  # (a tombstone's words, or a staged entry's, are read into its row)
        return rows, found

    def put(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids, rows = put_arrays(ids, rows, self.width)
        self.tier.write_pending({self.name: (ids, rows)}, durable=False)
        return ids[:0], np.empty((0, self.width), dtype=np.float32)
