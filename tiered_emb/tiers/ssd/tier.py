"""The SSD tier: every row ever written, in one LMDB environment per store.

Two named databases per table:

- ``t:<table>``: rows as of the last checkpoint, one record per id;
- ``p:<table>``: rows written back since (dirty evictions and :meth:`flush`), as
  *segments*: each write transaction appends one value per table holding all its rows
  (format: :func:`tiered_emb.tiers.ssd.writer_main.encode_segment`), under a sequence
  number that only grows.  An index in memory (:class:`~.index.SegmentIndex`, built
  from the segments' ids when the store opens) says which segment holds each id's newest
  copy.  Why: a B-tree insert per row cost ~1.2 us in the DLRM job (each 65,536-row
  transaction rewrote most leaf pages of ``p:``); an append costs ~0.05 us a row.

A read looks in ``p:`` (through the index) first, then ``t:``.  :meth:`checkpoint` folds
the newest copy of each row of ``p:`` into ``t:``, drops ``p:`` and writes the store's
meta record in *one* write transaction, so LMDB's atomic commit makes the checkpoint a
single durable point: reopening drops ``p:`` and finds exactly the last checkpoint (or
keeps it, with ``restore="latest"``).  ``p:`` holds every copy written since the
checkpoint, stale ones too, so it grows with the rows written back between checkpoints.

Keys of ``t:`` are the id as 8 big-endian bytes (LMDB's byte order is then id order); a
value is one tag byte (0 raw, 1 zstd) and the record's float32 bytes: weights, then
optimizer state.  The map doubles by itself when full; a full disk raises
:class:`~tiered_emb.errors.StoreFullError` after the transaction is rolled back.

A table with ``num_rows`` also has a bitmap of the ids ever written here (built from
the keys when the store opens, set by every write before the rows become visible): a
read looks (in the write-back buffers, the staged reads and LMDB) only for ids whose
bit is set.  Most rows a young store brings up were never written (they are
initialised), and looking for them cost as much as finding one.
"""
from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numba
import numpy as np
import zstandard

from tiered_emb.errors import ConfigError, CorruptStoreError, StoreFullError, StoreLockedError
from tiered_emb.tiers.ssd import writer_main
from tiered_emb.tiers.ssd.writer_main import RAW as _RAW, ZSTD as _ZSTD, disk_full, frame_bytes, lmdb_keys, put_rows, read_frame
from tiered_emb.tiers.ssd.writer_main import SEGMENT_HEADER, SEGMENT_MAGIC, SEGMENT_VERSION, last_rows, put_segment, segment_key
from tiered_emb.tiers.ssd.rowbuf import ABSENT, FOUND, RowBuffer
from tiered_emb.tiers.ssd.index import MAX_SEGMENT_ROWS, MAX_SEGMENTS, POS_BITS, POS_MASK, SegmentIndex
_META_DB = b"meta"


class _TxnGate:
    """Read transactions of any thread against a map resize (LMDB allows one only with no transaction open)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False

    @contextmanager
    def reading(self):
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def resizing(self):
        with self._cond:
            while self._resizing or self._readers:
                self._cond.wait()
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


@numba.njit(cache=True, nogil=True)
def _set_bits(bits, ids):
    """Set the bit of each of ``ids`` (int64, each < 8 * len(bits)) in ``bits`` (uint8)."""
    for i in range(ids.shape[0]):
        x = ids[i]
        bits[x >> 3] |= np.uint8(1 << (x & 7))


@numba.njit(cache=True, nogil=True)
def _with_bit(bits, ids, at):
    """The entries of ``at`` (int64) whose id ``ids[at[j]]`` has its bit set, in order."""
    out = np.empty(at.shape[0], dtype=np.int64)
    m = 0
    for j in range(at.shape[0]):
        x = ids[at[j]]
        if bits[x >> 3] & (1 << (x & 7)):
            out[m] = at[j]
            m += 1
    return out[:m]


def _cursor_get_many(cur, keys: list[bytes]) -> list[tuple[bytes, bytes]]:
    """``(key, value)`` of each of ``keys`` held by ``cur``'s database, in the order of ``keys``.

    A loop of ``set_key`` (``Cursor.getmulti`` and ``Cursor.get`` measure the same).
    py-lmdb 3.0.0 drops the GIL around every key whichever call is used, so beside a
    thread running pure Python each key waits for its turn (2,300 keys: 2.5 ms alone,
    ~1.1 s beside a thread spinning in Python; docs/benchmarks.md).  An earlier
    measurement here had ``set_key`` keep the GIL (0.27 ms beside such a thread), most
    likely under an older py-lmdb.
    """
    got = []
    for key in keys:
        if cur.set_key(key):
            got.append((key, cur.value()))
    return got


class _SegmentGone(Exception):
    """A segment the index names is no longer in ``p:`` (a checkpoint dropped it meanwhile)."""


class SsdTier:
    def __init__(self, path: Path, table_widths: dict[str, int], compression: int | None,
                 map_size_bytes: int, writeback_rows: int = 1 << 16, background_writes: bool = True,
                 table_rows: dict[str, int | None] | None = None, legacy_pending: bool = False,
                 existing: bool = False):
        self.path = Path(path)
        self.widths = dict(table_widths)
        # Write-backs of evicted rows wait in memory (the newest copy of those rows) and go
        # to the since-checkpoint databases in one transaction once ``writeback_rows`` are
        # waiting: one commit per many steps instead of one per table per step.  With
        # ``background_writes`` that transaction runs on a writer thread while the rows
        # stay readable from its snapshot (``_flushing``) until it commits.
        self.writeback_rows = int(writeback_rows)
        self.background_writes = bool(background_writes)
        # The writer thread hands each transaction to a writer process (its own GIL; see
        # tiers/ssd/writer_main.py).
        self.writer_process = self.background_writes and WRITER_PROCESS
        self._proc: _WriterProcess | None = None
        self._mu = threading.Lock()  # guards _wb, _flushing, _staged, _gen (short sections only)
        self._gate = _TxnGate()
        self._wb: dict[str, RowBuffer] = {n: RowBuffer(w) for n, w in sorted(self.widths.items())}
        self._flushing: list[dict[str, RowBuffer]] = []  # snapshots not yet committed, oldest first
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        # Rows read ahead for coming batches (key -> table -> rows), each equal to LMDB's
        # record (or its absence) for as long as it is held: every LMDB write drops the
        # staged copies of the rows it writes.  ``_gen`` counts LMDB writes.
        self._staged: dict[int, dict[str, RowBuffer]] = {}
        self._gen = 0
        self.staging = {"reads": 0, "rows": 0, "used": 0, "discarded": 0}
        self.compression = compression
        self._max_dbs, self._max_readers = 2 * len(self.widths) + 2, 64
        self._zc = zstandard.ZstdCompressor(level=compression) if compression else None
        self._zd = zstandard.ZstdDecompressor()
        try:
            self.env = lmdb.open(str(self.path), map_size=map_size_bytes, max_dbs=self._max_dbs,
                                 subdir=True, readahead=False, meminit=False, max_readers=self._max_readers)
            self._check_length()
            if existing:
                try:
                    self._check_tables()
                except BaseException:
                    self.env.close()
                    raise
            self._meta = self.env.open_db(_META_DB)
            self._main = {n: self.env.open_db(b"t:" + n.encode()) for n in sorted(self.widths)}
            self._pending = {n: self.env.open_db(b"p:" + n.encode()) for n in sorted(self.widths)}
        except lmdb.LockError as err:
            raise StoreLockedError(f"LMDB environment {self.path} is locked", "close the other writer first") from err
        except OverflowError as err:
            raise ConfigError(f"map_size_bytes={map_size_bytes} is more than LMDB can map ({err})",
                              "use a smaller TierConfig.map_size_bytes (the map grows by itself when full)") from err
        except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.BadValsizeError,
                lmdb.PageNotFoundError) as err:
            raise CorruptStoreError(f"LMDB environment {self.path} is corrupt or not an LMDB file ({err})",
                                    "restore the store directory from a backup") from err
        except lmdb.Error as err:
            raise CorruptStoreError(f"LMDB environment {self.path} cannot be opened ({err})",
                                    "check the store directory and its permissions") from err
        # Ids ever written here, per table with ``num_rows`` (a bit each; None: look for
        # every id).  Bits are only ever set, before the rows enter the write-back buffer
        # or an LMDB transaction, so a clear bit means the id is held nowhere here.
        self._written_bits: dict[str, np.ndarray | None] = {}
        # Where each row of ``p:`` lies (changed under ``_mu``), and the next segment's number.
        self._seg: dict[str, SegmentIndex] = {n: SegmentIndex() for n in sorted(self.widths)}
        self._seg_rows = {n: 0 for n in sorted(self.widths)}  # rows in the segments, stale copies too
        self._seq = 0
        # ``p:`` is read (:meth:`_load_segments`) only by promote_pending: every store opens
        # with discard_pending or promote_pending, and a damaged ``p:`` then stops only the latter.
        self._table_rows = {n: (table_rows or {}).get(n) for n in sorted(self.widths)}
        # ``p:`` as an older version wrote it (a record per id; format tiered_emb/1): only
        # dropped (discard_pending), never read.
        self._legacy_pending = False
        try:
            with self._corrupt_on_lmdb_error("reading"):
                for n in sorted(self.widths):
                    rows = (table_rows or {}).get(n)
                    self._written_bits[n] = None if rows is None else self._bits_from_keys(n, int(rows))
                    if legacy_pending:
                        self._legacy_pending |= self._entries(self._pending[n]) > 0
        except BaseException:
            self.env.close()
            raise

    def _check_tables(self) -> None:
        """Raise CorruptStoreError unless LMDB holds a ``t:`` database for exactly the tables
        given (an existing store's manifest), before any is opened (opening one creates it):
        a table renamed in the manifest would otherwise answer with fresh rows while its own
        stayed out of reach."""
        with self._corrupt_on_lmdb_error("listing the tables of"), self.env.begin() as txn:
            held = sorted(bytes(k)[2:].decode("utf-8", "replace") for k, _ in txn.cursor() if bytes(k)[:2] == b"t:")
        listed = sorted(self.widths)
        if held != listed:
            raise CorruptStoreError(f"the manifest lists tables {listed} but LMDB in {self.path} holds {held}",
                                    "restore manifest.json (or the store directory) from a backup")

    @contextmanager
    def _corrupt_on_lmdb_error(self, doing: str):
        """An LMDB error (a damaged page: wrong type, bad transaction) as :class:`CorruptStoreError`."""
        try:
            yield
        except lmdb.Error as err:
            raise CorruptStoreError(f"{doing} {self.path} failed ({type(err).__name__}: {err})",
                                    "restore the store directory from a backup") from err

    def _check_length(self) -> None:
        """Raise CorruptStoreError when ``data.mdb`` is shorter than its last committed page:
        LMDB maps the file, and a page past its end would kill the process (SIGBUS) on first read."""
        need = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        have = (self.path / "data.mdb").stat().st_size
        if have < need:
            self.env.close()
            raise CorruptStoreError(f"LMDB file {self.path / 'data.mdb'} is truncated ({have} bytes, its pages "
                                    f"reach {need})", "restore the store directory from a backup")

    def _bits_from_keys(self, table: str, num_rows: int) -> np.ndarray:
        """The bitmap of the ids stored in ``t:`` of ``table`` (one walk over the keys, a
        million at a time: measured 0.18-0.27 s for 1.27M rows); :meth:`_load_segments` adds ``p:``'s."""
        bits = np.zeros((num_rows + 7) // 8, dtype=np.uint8)
        with self._gate.reading(), self.env.begin() as txn:
            for db in (self._main[table],):
                with txn.cursor(db=db) as cur:
                    keys = cur.iternext(keys=True, values=False)
                    while True:
                        ids = np.frombuffer(b"".join(itertools.islice(keys, 1 << 20)), dtype=">i8").astype(np.int64)
                        if ids.shape[0] == 0:
                            break
                        if ids.min() < 0 or ids.max() >= num_rows:
                            raise CorruptStoreError(f"table {table!r} in {self.path} holds ids outside [0, {num_rows})",
                                                    "open it with the num_rows it was created with")
                        _set_bits(bits, ids)
        return bits

    def _load_segments(self, table: str) -> None:
        """Index the segments of ``p:<table>`` (oldest first: a newer copy wins) and set their ids' bits."""
        index, bits, num_rows = self._seg[table], self._written_bits[table], self._table_rows[table]
        with self._gate.reading(), self.env.begin(buffers=True) as txn, txn.cursor(db=self._pending[table]) as cur:
            for key, value in cur:
                seq = int.from_bytes(key, "big")
                n, _ = self._segment_head(table, seq, value)
                ids = np.frombuffer(value, dtype="<i8", count=n, offset=SEGMENT_HEADER.size).astype(np.int64)
                if len(key) != 8 or seq >= MAX_SEGMENTS or n > MAX_SEGMENT_ROWS \
                        or (n > 1 and not (ids[1:] > ids[:-1]).all()) \
                        or (n and (ids[0] < 0 or (num_rows is not None and ids[-1] >= num_rows))):
                    raise CorruptStoreError(f"segment {bytes(key).hex()} of table {table!r} in {self.path} is damaged "
                                            f"(its key or its ids)", "restore the store directory from a backup")
                index.add(seq, ids)
                self._seg_rows[table] += n
                if bits is not None:
                    _set_bits(bits, ids)
                self._seq = max(self._seq, seq + 1)

    def _segment_head(self, table: str, seq: int, value) -> tuple[int, int]:
        """``(rows, tag)`` of segment ``seq`` of ``table`` after checking its header and length."""
        width = self.widths[table]
        try:
            magic, version, tag, n, w = SEGMENT_HEADER.unpack_from(value)
        except Exception:  # (struct.error: shorter than a header)
            magic = None
        size = SEGMENT_HEADER.size + 8 * n + 4 * n * width if magic is not None else 0
        if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION or w != width or tag not in (_RAW, _ZSTD) \
                or len(value) < size - (4 * n * width if tag == _ZSTD else 0) or (tag == _RAW and len(value) != size):
            raise CorruptStoreError(f"segment {seq} of table {table!r} in {self.path} is damaged (its header or "
                                    "its length)", "restore the store directory from a backup")
        return n, tag

    def _segment_rows(self, table: str, seq: int, value) -> np.ndarray:
        """The rows (n, W) float32 of segment ``seq`` of ``table`` (a view of ``value`` when raw)."""
        n, tag = self._segment_head(table, seq, value)
        at = SEGMENT_HEADER.size + 8 * n
        width = self.widths[table]
        if tag == _RAW:
            return np.frombuffer(value, dtype="<f4", count=n * width, offset=at).reshape(n, width)
        try:
            body = self._zd.decompress(bytes(value[at:]), max_output_size=4 * n * width)
        except zstandard.ZstdError as err:
            raise CorruptStoreError(f"segment {seq} of table {table!r} in {self.path} does not decompress ({err})",
                                    "restore from a backup") from err
        if len(body) != 4 * n * width:
            raise CorruptStoreError(f"segment {seq} of table {table!r} in {self.path} holds {len(body)} bytes of rows, "
                                    f"expected {4 * n * width}", "restore from a backup")
        return np.frombuffer(body, dtype="<f4").reshape(n, width)

    def _read_segments(self, txn, table: str, locs: np.ndarray, out_rows: np.ndarray, at: np.ndarray) -> None:
        """Rows at ``locs`` (index locations) of ``p:<table>`` into ``out_rows[at]``; one get per segment."""
        order = np.argsort(locs, kind="stable")
        locs, at = locs[order], at[order]
        seqs = locs >> POS_BITS
        cuts = np.flatnonzero(seqs[1:] != seqs[:-1]) + 1
        db = self._pending[table]
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, locs.shape[0]].tolist()):
            seq = int(seqs[a])
            value = txn.get(segment_key(seq), db=db)
            if value is None:
                raise _SegmentGone(seq)
            rows = self._segment_rows(table, seq, value)
            pos = locs[a:b] & POS_MASK
            if pos[-1] >= rows.shape[0]:
                raise CorruptStoreError(f"segment {seq} of table {table!r} in {self.path} is shorter than its index says",
                                        "restore the store directory from a backup")
            out_rows[at[a:b]] = rows[pos]

    # ----------------------------------------------------------------- encoding
    def _decode(self, value, out_row: np.ndarray) -> None:
        tag = value[0]
        body = bytes(value[1:])
        if tag == _ZSTD:
            try:
                body = self._zd.decompress(body)
            except zstandard.ZstdError as err:
                raise CorruptStoreError(f"an LMDB record of {self.path} does not decompress ({err})",
                                        "restore from a backup") from err
        elif tag != _RAW:
            raise CorruptStoreError(f"an LMDB record of {self.path} has unknown tag {tag}", "restore from a backup")
        if len(body) != out_row.nbytes:
            raise CorruptStoreError(f"an LMDB record of {self.path} has {len(body)} bytes, expected {out_row.nbytes}",
                                    "restore from a backup")
        out_row[:] = np.frombuffer(body, dtype=np.float32)

    # ----------------------------------------------------------------- reads
    def read(self, table: str, ids: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """Read the records of ``ids`` (int64 (k,), distinct) into ``out_rows`` (k, W); returns the found mask (bool (k,)).

        Newest copy first: the write-back buffer, the snapshots being written, then
        rows staged for this batch (equal to LMDB's), then ``p:``, then ``t:``.  Ids
        whose written bit is clear are nowhere here and are not looked up at all.
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        at = self._maybe_stored(table, ids, np.arange(ids.shape[0]))
        if at.shape[0] == ids.shape[0]:
            return self._read_held(table, ids, out_rows)
        found = np.zeros(ids.shape[0], dtype=bool)
        if at.shape[0]:
            sub = np.empty((at.shape[0], out_rows.shape[1]), dtype=np.float32)
            hit = self._read_held(table, ids[at], sub)
            out_rows[at[hit]] = sub[hit]
            found[at] = hit
        return found

    def _read_held(self, table: str, ids: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """:meth:`read` of ids that may be held (each one looked for in memory, then LMDB)."""
        state = np.zeros(ids.shape[0], dtype=np.uint8)
        if ids.shape[0] == 0:
            return state.astype(bool)
        with self._mu:
            self._wb[table].get(ids, out_rows, state)
            for snap in reversed(self._flushing):
                if table in snap:
                    snap[table].get(ids, out_rows, state)
            for key in sorted(self._staged):
                staged = self._staged[key].get(table)
                if staged is not None:
                    self.staging["used"] += staged.get(ids, out_rows, state)
            todo = np.flatnonzero(state == 0)
            locs = self._seg[table].find(ids[todo])
        # LMDB last, in transactions begun after the look above: a snapshot gone since was
        # committed (and indexed) first, so the transaction sees its rows.
        if todo.shape[0]:
            try:
                self._read_lmdb(table, ids[todo], out_rows, todo, state, locs)
            except _SegmentGone as gone:  # only a checkpoint drops segments, and it holds the store's lock
                raise self._gone(table, gone) from None
        return state == FOUND

    def _maybe_stored(self, table: str, ids: np.ndarray, at: np.ndarray) -> np.ndarray:
        """The entries of ``at`` whose id may be held here (all of them without a bitmap)."""
        bits = self._written_bits[table]
        return at if bits is None or at.shape[0] == 0 else _with_bit(bits, ids, at)

    def _read_lmdb(self, table: str, ids: np.ndarray, out_rows: np.ndarray, at: np.ndarray, state: np.ndarray,
                   locs: np.ndarray) -> None:
        """Records of ``ids`` (distinct) into ``out_rows[at]``, ``state[at]`` = FOUND where found:
        from the segments of ``p:`` at ``locs`` (their index locations, -1: none), the rest from ``t:``."""
        in_p = locs >= 0
        try:
            if in_p.any():
                # Buffers: a segment is read in place (a copy of it would cost more than its rows).
                with self._gate.reading(), self.env.begin(buffers=True) as txn:
                    self._read_segments(txn, table, locs[in_p], out_rows, at[in_p])
                state[at[in_p]] = FOUND
                ids, at = ids[~in_p], at[~in_p]
            if ids.shape[0] == 0:
                return
            order = np.argsort(ids, kind="stable")  # key order: one sequential walk
            ids, at = ids[order], at[order]
            # bytes, not buffers: py-lmdb's buffer objects cost more than the copies they save
            # (measured 430 -> 250 us for 500 records of one table)
            with self._gate.reading(), self.env.begin() as txn:
                with txn.cursor(db=self._main[table]) as cur:
                    got = _cursor_get_many(cur, lmdb_keys(ids))
                if got:
                    self._decode_many(got, ids, at, out_rows, state)
        except lmdb.Error as err:
            raise CorruptStoreError(f"reading table {table!r} from {self.path} failed ({err})",
                                    "restore the store directory from a backup") from err

    def _decode_many(self, got, ids, at, out_rows, state) -> None:
        """Decode ``got`` ((key, value) pairs of :func:`_cursor_get_many` over sorted ``ids``) into ``out_rows[at]``."""
        got_ids = np.frombuffer(b"".join(k for k, _ in got), dtype=">i8").astype(np.int64)
        at = at[np.searchsorted(ids, got_ids)]
        width = out_rows.shape[1]
        values = [v for _, v in got]
        if all(len(v) == 1 + 4 * width for v in values):  # every record raw-sized: decode as one array
            raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), 1 + 4 * width)
            if (raw[:, 0] == _RAW).all():
                out_rows[at] = np.ascontiguousarray(raw[:, 1:]).view(np.float32)
                state[at] = FOUND
                return
        for j, v in enumerate(values):
            self._decode(v, out_rows[at[j]])
        state[at] = FOUND

    # ----------------------------------------------------------------- staged reads
    def stage(self, key: int, batch: dict[str, np.ndarray]) -> bool:
        """Read the LMDB records of ``batch`` ({table: distinct ids}) ahead of the step that needs them.

        Runs on any thread and takes none of the store's locks.  The rows are held under
        ``key`` until :meth:`unstage`; :meth:`read` then answers them from memory.  A
        read that overlapped an LMDB write is dropped (returns False): its rows may be
        older than the write.
        """
        with self._mu:
            gen = self._gen
        staged = {}
        for table in sorted(batch):
            ids = np.ascontiguousarray(batch[table], dtype=np.int64)
            rows = np.empty((ids.shape[0], self.widths[table]), dtype=np.float32)
            state = np.zeros(ids.shape[0], dtype=np.uint8)
            at = self._maybe_stored(table, ids, np.arange(ids.shape[0]))
            if at.shape[0]:
                with self._mu:
                    locs = self._seg[table].find(ids[at])
                try:
                    self._read_lmdb(table, ids[at], rows, at, state, locs)
                except _SegmentGone:  # dropped by a checkpoint since: as a read that overlapped a write
                    with self._mu:
                        self.staging["reads"] += 1
                        self.staging["discarded"] += 1
                    return False
            state[state == 0] = ABSENT
            buf = RowBuffer(self.widths[table], ids.shape[0])
            buf.put(ids, rows, state)
            staged[table] = buf
        with self._mu:
            self.staging["reads"] += 1
            if gen != self._gen:
                self.staging["discarded"] += 1
                return False
            self._staged[key] = staged
            self.staging["rows"] += sum(len(b) for b in staged.values())
        return True

    def unstage(self, key: int) -> None:
        """Drop the rows staged under ``key``."""
        with self._mu:
            self._staged.pop(key, None)

    def _written(self, table_ids: dict[str, np.ndarray] | None) -> None:
        """Bookkeeping after an LMDB write (under ``_mu``): staged copies of written rows are stale."""
        self._gen += 1
        if table_ids is None:
            self._staged.clear()
            return
        for staged in self._staged.values():
            for t, ids in table_ids.items():
                if t in staged:
                    staged[t].remove(ids)

    # ----------------------------------------------------------------- writes
    def _write(self, fn) -> None:
        """Run ``fn(txn)`` in one write transaction; grow the map and retry when full."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                with self._gate.resizing():
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as err:
                if disk_full(err, self.path):
                    raise StoreFullError(f"the disk under {self.path} is full ({err}); the write was rolled back",
                                         "free disk space or move the store, then call flush()/checkpoint() again") from err
                raise CorruptStoreError(f"writing to {self.path} failed ({err}); the write was rolled back",
                                        "check the disk and the store directory") from err

    def _set_written(self, table: str, ids: np.ndarray) -> None:
        """Set the written bits of ``ids`` (under ``_mu``: setting a bit rewrites its whole byte,
        so two threads setting bits of one byte at once could lose one)."""
        bits = self._written_bits[table]
        if bits is not None:
            _set_bits(bits, np.ascontiguousarray(ids, dtype=np.int64))

    def _put_rows(self, txn, table: str, db, ids: np.ndarray, rows: np.ndarray) -> None:
        with self._mu:  # before the commit (rows from the write-back buffer have theirs already)
            self._set_written(table, ids)
        put_rows(txn, db, ids, rows, self._zc)

    def _put_waiting(self, txn, snaps: list[dict[str, RowBuffer]]) -> None:
        """Write write-back snapshots, oldest first, into ``t:`` (a checkpoint)."""
        for snap in snaps:
            for t, buf in sorted(snap.items()):
                if len(buf):
                    self._put_rows(txn, t, self._main[t], *buf.items())

    def _segments(self, snaps: list[dict[str, RowBuffer]], batches: dict | None = None) -> list:
        """The segments of one write into ``p:``: per table, ``(table, number, ids, rows)`` of
        its rows in ``snaps`` (oldest first) then ``batches`` (newest), each id's last row,
        numbered on from :attr:`_seq` (one writer at a time).  Their numbers are taken
        whether or not the write commits: a writer process that died after its commit, before
        its reply, leaves segments that are not indexed, and the rows' next write must
        still append above them (a gap in the numbers is harmless)."""
        parts: dict[str, list] = {}
        for snap in snaps:
            for t, buf in sorted(snap.items()):
                if len(buf):
                    parts.setdefault(t, []).append(buf.items())
        for t, (ids, rows) in sorted((batches or {}).items()):
            parts.setdefault(t, []).append((np.ascontiguousarray(ids, dtype=np.int64), rows))
        out = []
        for t in sorted(parts):
            ids, rows = last_rows(np.concatenate([p[0] for p in parts[t]]), np.concatenate([p[1] for p in parts[t]]))
            out += self._numbered(t, ids, rows)
        return out

    def _numbered(self, table: str, ids: np.ndarray, rows) -> list:
        """``ids`` (and ``rows``, or their locations) cut into segments of ``table``, numbered on
        from :attr:`_seq`, which takes them.  A segment holds at most :meth:`_rows_per_segment`."""
        step = self._rows_per_segment(table)
        cuts = range(0, max(ids.shape[0], 1), step)
        if self._seq + len(cuts) > MAX_SEGMENTS:
            raise CorruptStoreError(f"{self.path} has numbered {self._seq:,} segments since it opened, all it can",
                                    "close and reopen the store (its numbers start again after its checkpoint)")
        out = [(table, self._seq + k, ids[a:a + step], rows[a:a + step]) for k, a in enumerate(cuts)]
        self._seq += len(out)
        return out

    def _rows_per_segment(self, table: str) -> int:
        """Rows a segment of ``table`` holds at most: 2**20 and 256 MiB (LMDB takes values
        under 4 GiB), 1,024 with compression (a read decompresses every segment it needs whole)."""
        cap = 1 << 10 if self._zc is not None else MAX_SEGMENT_ROWS
        return max(1, min(cap, (256 << 20) // (8 + 4 * self.widths[table])))

    def _put_segments(self, txn, segments: list) -> None:
        with self._mu:  # before the commit (rows from the write-back buffer have theirs already)
            for t, _, ids, _ in segments:
                self._set_written(t, ids)
        for t, seq, ids, rows in segments:
            put_segment(txn, self._pending[t], seq, ids, rows, self._zc)

    def _indexed(self, segments: list) -> None:
        """After ``segments`` are committed (under ``_mu``): reads find their rows in ``p:``."""
        for t, seq, ids, _ in segments:
            self._seg[t].add(seq, ids)
            self._seg_rows[t] += ids.shape[0]

    #: ``p:<table>`` is compacted when its segments hold more than this many times the rows
    #: it has live (and at least :attr:`COMPACT_MIN_ROWS`): the stale copies of rows written
    #: back again since the checkpoint, which would otherwise grow the file until the next one.
    COMPACT_RATIO = 4
    COMPACT_MIN_ROWS = 1 << 20

    def _compact_due(self) -> list[str]:
        return [t for t in sorted(self.widths)
                if self._seg_rows[t] >= self.COMPACT_MIN_ROWS and self._seg_rows[t] > self.COMPACT_RATIO * len(self._seg[t])]

    def _compact(self, tables: list[str]) -> None:
        """Rewrite ``p:`` of each of ``tables`` as one segment of its live rows, in one transaction.

        With no write in flight, and under the store's lock (every read of ``p:`` holds it,
        but a staged one, which finds its segments gone and is discarded).  A failure rolls
        back and leaves ``p:`` as it was.
        """
        with self._mu:
            live = {t: self._seg[t].items() for t in tables}
        plan = {t: self._numbered(t, *live[t]) for t in tables}  # numbers taken whether or not it commits

        def fn(txn):
            for t in tables:
                ids, locs = live[t]
                rows = np.empty((ids.shape[0], self.widths[t]), dtype=np.float32)
                try:
                    self._read_segments(txn, t, locs, rows, np.arange(ids.shape[0]))
                except _SegmentGone as gone:
                    raise self._gone(t, gone) from None
                txn.drop(self._pending[t], delete=False)
                step = self._rows_per_segment(t)
                for k, (_, seq, seg_ids, _) in enumerate(plan[t]):
                    put_segment(txn, self._pending[t], seq, seg_ids, rows[k * step:(k + 1) * step], self._zc)

        self._write(fn)
        with self._mu:
            for t in tables:
                self._seg[t].clear()
                for _, seq, seg_ids, _ in plan[t]:
                    self._seg[t].add(seq, seg_ids)
                self._seg_rows[t] = live[t][0].shape[0]
            self._written(None)

    def _waiting(self) -> list[dict[str, RowBuffer]]:
        """Every write-back not yet in LMDB, oldest first; the buffer starts afresh (under ``_mu``)."""
        snaps = self._flushing + [self._wb]
        self._flushing = snaps
        # Sized as the last one filled: growing from empty re-inserts every row at each doubling.
        self._wb = {n: RowBuffer(w, len(snaps[-1][n])) for n, w in sorted(self.widths.items())}
        return snaps

    @staticmethod
    def _ids_of(snaps) -> dict[str, np.ndarray]:
        out: dict[str, list] = {}
        for snap in snaps:
            for t, buf in snap.items():
                if len(buf):
                    out.setdefault(t, []).append(buf.items()[0])
        return {t: np.concatenate(parts) for t, parts in sorted(out.items())}

    def raise_failed_write(self) -> None:
        """Raise the failure of an earlier write-back, once (its rows still wait in memory)."""
        if self._writer_error is not None:
            err, self._writer_error = self._writer_error, None
            raise err

    def wait_writes(self) -> None:
        """Wait for the writer thread; its error, if any, is raised by the next durable write."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write_behind(self, defer_errors: bool = False) -> None:
        """Hand every waiting write-back to the writer thread (after the previous one is done).

        A failed write's rows stay waiting in memory, retried by the next write.  The failure
        is raised here, or with ``defer_errors`` kept for :meth:`raise_failed_write`: an
        operation that is changing rows goes on to its end, and the next one raises it
        before it changes anything (all or nothing).
        """
        self.wait_writes()
        if self._writer_error is not None:
            if defer_errors:
                return
            self.raise_failed_write()
        due = self._compact_due()
        if due:
            try:
                self._compact(due)
            except Exception as err:  # (the rows wait in memory, the next write tries again)
                if not defer_errors:
                    raise
                self._writer_error = err
                return
        with self._mu:
            snaps = self._waiting()
        if not self.background_writes:
            try:
                self._commit_waiting(snaps)
            except Exception as err:
                if not defer_errors:
                    raise
                self._writer_error = err
            return
        self._writer = threading.Thread(target=self._commit_waiting, args=(snaps, True), name="tiered_emb-writer",
                                        daemon=True)
        self._writer.start()

    def _commit_waiting(self, snaps, on_thread: bool = False) -> None:
        try:
            segments = self._segments(snaps)
            if not (on_thread and self.writer_process and self._write_by_process(segments)):
                # (also where the writer process cannot start)
                self._write(lambda txn: self._put_segments(txn, segments))
        except BaseException as err:
            if not on_thread:
                raise
            self._writer_error = err
            return
        with self._mu:
            self._indexed(segments)  # before the snapshots leave the read path: reads then look in p:
            self._flushing = [s for s in self._flushing if not any(s is x for x in snaps)]
            self._written(self._ids_of(snaps))

    def writer_pid(self) -> int | None:
        """The writer process's pid while it runs (None before the first background write)."""
        proc = self._proc
        return proc.proc.pid if proc is not None else None

    def _gone(self, table: str, gone: "_SegmentGone") -> CorruptStoreError:
        return CorruptStoreError(f"segment {gone.args[0]} of table {table!r} in {self.path} is indexed but missing",
                                 "restore the store directory from a backup")

    def _write_by_process(self, segments: list) -> bool:
        """Append ``segments`` (:meth:`_segments`) to ``p:`` in one transaction of the writer
        process; False (nothing written) when the process cannot start: this store's writes
        stay in this process from then on.  Grows the map and sends the write again when
        the map is full; a failure is rolled back (the rows stay waiting in memory) and
        raised as :class:`StoreFullError` or :class:`CorruptStoreError`."""
        if not segments:
            return True
        if hasattr(signal, "pthread_sigmask"):
            # A write into a dead process's pipe raises here (EPIPE), instead of a SIGPIPE
            # that kills the trainer when it runs with SIGPIPE's default action.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        while True:
            if self._proc is None:
                try:
                    self._proc = _WriterProcess(self)
                except _WriterStartError as err:  # (no python with lmdb here: a frozen or embedded app)
                    self.writer_process = False
                    try:  # told once; under -W error it must not fail the write
                        warnings.warn(f"{err}; this store's write-backs are written by its writer thread from now on",
                                      RuntimeWarning, stacklevel=2)
                    except Warning:
                        pass
                    return False
            try:
                reply = self._proc.write(segments, int(self.env.info()["map_size"]))
            except CorruptStoreError:
                self._proc.close()
                self._proc = None  # the next write starts another one
                raise
            if reply.get("error") == "map_full":
                with self._gate.resizing():
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
                continue
            if reply.get("error") == "full":
                raise StoreFullError(f"the disk under {self.path} is full ({reply['message']}); the write was "
                                     "rolled back", "free disk space or move the store, then call flush()/checkpoint() again")
            if "error" in reply:
                raise CorruptStoreError(f"writing to {self.path} failed ({reply['message']}); the write was rolled back",
                                        "check the disk and the store directory")
            return True

    def write_pending(self, batches: dict[str, tuple[np.ndarray, np.ndarray]], durable: bool = True,
                      defer_errors: bool = False) -> int:
        """Write ``{table: (ids, rows)}`` into the since-checkpoint databases; returns rows written.

        ``durable=False`` (write-backs of evicted rows): the rows wait in memory with the
        others until ``writeback_rows`` are waiting, then all go out in one transaction
        (on the writer thread with ``background_writes``); reads see them at once; a failed
        write is raised, or with ``defer_errors`` kept for :meth:`raise_failed_write`.
        ``durable=True`` writes them, and every waiting row, now.
        """
        batches = {t: b for t, b in sorted(batches.items()) if b[0].shape[0]}
        n = sum(b[0].shape[0] for b in batches.values())
        if not durable:
            with self._mu:
                for t, (ids, rows) in batches.items():
                    self._set_written(t, ids)  # first: a read that finds the bit clear will not look
                    self._wb[t].put(ids, rows)
                waiting = sum(len(b) for b in self._wb.values())
            if waiting >= self.writeback_rows:
                self._write_behind(defer_errors)
            return n
        self.wait_writes()
        with self._mu:
            snaps = self._waiting()
        if not batches and not any(len(b) for s in snaps for b in s.values()):
            return 0
        segments = self._segments(snaps, batches)  # the snapshots are older than ``batches``
        self._write(lambda txn: self._put_segments(txn, segments))
        with self._mu:
            self._indexed(segments)
            self._flushing = []
            self._writer_error = None
            self._written(None)
        return n

    def checkpoint(self, batches: dict[str, tuple[np.ndarray, np.ndarray]], meta: dict, extra: bytes | None) -> int:
        """Make ``batches`` and everything pending the new checkpoint, with ``meta``, atomically."""
        batches = {t: b for t, b in sorted(batches.items()) if b[0].shape[0]}
        self.wait_writes()
        with self._mu:
            snaps = self._waiting()

        def fn(txn):
            for t in sorted(self.widths):
                if len(self._seg[t]):  # the newest copy of each row of p:, in id order
                    ids, locs = self._seg[t].items()
                    rows = np.empty((ids.shape[0], self.widths[t]), dtype=np.float32)
                    try:
                        self._read_segments(txn, t, locs, rows, np.arange(ids.shape[0]))
                    except _SegmentGone as gone:
                        raise self._gone(t, gone) from None
                    put_rows(txn, self._main[t], ids, rows, self._zc)
                txn.drop(self._pending[t], delete=False)
            self._put_waiting(txn, snaps)
            for t in sorted(batches):
                self._put_rows(txn, t, self._main[t], *batches[t])
            txn.put(b"meta", json.dumps(meta, sort_keys=True).encode(), db=self._meta)
            if extra is not None:
                txn.put(b"extra", bytes(extra), db=self._meta)

        self._write(fn)
        with self._mu:
            self._dropped_segments()
            self._flushing = []
            self._writer_error = None
            self._written(None)
        self.env.sync(True)
        return sum(b[0].shape[0] for b in batches.values())

    def discard_pending(self) -> None:
        """Drop what was written since the last checkpoint (reopen at the checkpoint)."""
        def fn(txn):
            for t in sorted(self.widths):
                txn.drop(self._pending[t], delete=False)
        self._write(fn)
        with self._mu:
            self._dropped_segments()
            self._written(None)
        self._legacy_pending = False

    def _dropped_segments(self) -> None:
        """After ``p:`` is dropped (under ``_mu``)."""
        for index in self._seg.values():
            index.clear()
        self._seg_rows = dict.fromkeys(self._seg_rows, 0)
        # (the numbers go on: a read staged before may still hold locations of dropped segments)

    def promote_pending(self) -> None:
        """Keep what was written since the last checkpoint (reopen at the latest flush)."""
        if self._legacy_pending:
            raise ConfigError(f"the rows written after the last checkpoint of {self.path} are in the format of an "
                              "older tiered_emb (tiered_emb/1), which restore='latest' does not read",
                              "open it with restore='checkpoint' (those rows are given up), or reopen it with the "
                              "version that wrote it and checkpoint it there")
        with self._corrupt_on_lmdb_error("reading"):
            for table in sorted(self.widths):
                self._load_segments(table)
        self.checkpoint({}, self.read_meta(), None)

    def read_meta(self) -> dict:
        with self._corrupt_on_lmdb_error("reading the meta record of"), self._gate.reading(), \
                self.env.begin() as txn:
            v = txn.get(b"meta", db=self._meta)
        if v is None:
            raise CorruptStoreError(f"the LMDB environment {self.path} has no meta record",
                                    "the store was never checkpointed; recreate it or restore a backup")
        try:
            return json.loads(bytes(v))
        except ValueError as err:
            raise CorruptStoreError(f"the meta record of {self.path} is not JSON", "restore from a backup") from err

    def read_extra(self) -> bytes | None:
        with self._corrupt_on_lmdb_error("reading the extra record of"), self._gate.reading(), self.env.begin() as txn:
            v = txn.get(b"extra", db=self._meta)
        return None if v is None else bytes(v)

    # ----------------------------------------------------------------- introspection
    def _entries(self, db) -> int:
        with self._gate.reading(), self.env.begin() as txn:
            return int(txn.stat(db)["entries"])

    def table_stats(self, table: str) -> dict:
        with self._gate.reading(), self.env.begin() as txn:
            out = {}
            for label, db in (("rows", self._main[table]), ("pending_rows", self._pending[table])):
                st = txn.stat(db)
                out[label] = int(st["entries"])
                out[label.replace("rows", "bytes")] = int(st["psize"] * (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]))
        with self._mu:  # rows (not segments) of p:, and those waiting in memory for the next write
            out["pending_rows"] = len(self._seg[table])
            out["writeback_rows"] = len(self._wb[table]) + sum(len(s[table]) for s in self._flushing if table in s)
        return out

    def file_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def close(self) -> None:
        """Wait for the writer thread, end the writer process and close the environment
        (waiting write-backs are not written)."""
        self.wait_writes()
        if self._proc is not None:
            self._proc.close()
            self._proc = None
        self.env.close()


#: Whether background write-backs go through a writer process (POSIX: it relies on the
#: parent's pipes closing and on re-parenting at the parent's death; elsewhere the writer
#: thread writes itself).
WRITER_PROCESS = os.name == "posix"


class _WriterStartError(Exception):
    """The writer process could not start or open the environment."""


class _WriterProcess:
    """The trainer's side of one writer process (protocol: tiers/ssd/writer_main.py).  Used by
    the writer thread only, one write at a time.

    The process runs in a session of its own (a Ctrl-C or a signal to the trainer's process
    group does not reach it) with this interpreter's ``sys.path``.  It is ended by
    :meth:`close`, or when this object is collected (a store dropped without ``close()``),
    or at exit; a process forked from this one does not keep its pipe (each pipe end is
    pointed at /dev/null in the fork), so the process still sees its input close.
    """

    #: Seconds the process has to start and open the environment.
    START_TIMEOUT_S = 60

    def __init__(self, tier: SsdTier):
        self.path = tier.path
        if getattr(sys, "frozen", False) or not sys.executable:  # sys.executable is the app, or none
            raise _WriterStartError(f"the LMDB writer process for {self.path} cannot start (no Python interpreter "
                                    "to run it: a frozen or embedded app)")
        paths = [p for p in sys.path if isinstance(p, str) and p and os.pathsep not in p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        try:
            self.proc = subprocess.Popen([sys.executable, writer_main.__file__, str(os.getpid())],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                         start_new_session=True, env=env)
        except (OSError, TypeError, ValueError) as err:
            raise _WriterStartError(f"the LMDB writer process for {self.path} cannot start ({err})") from err
        self._end = weakref.finalize(self, _end_process, self.proc)
        _RUNNING.add(self)
        hello = {"path": str(tier.path), "map_size": int(tier.env.info()["map_size"]), "max_dbs": tier._max_dbs,
                 "max_readers": tier._max_readers, "compression": tier.compression,
                 "dbs": ["p:" + t for t in sorted(tier.widths)]}
        try:
            reply = self._call(hello, [], timeout=self.START_TIMEOUT_S, max_reply=1 << 12)
        except CorruptStoreError as err:
            self.close()
            raise _WriterStartError(f"the LMDB writer process for {self.path} could not start ({err.args[0]}; "
                                    "its error, if any, is on stderr)") from err
        if reply.get("ok") is not True:
            self.close()
            raise _WriterStartError(f"the LMDB writer process for {self.path} could not open it ({reply})")

    def write(self, segments, map_size: int) -> dict:
        """Send one write (``[(table, number, ids int64, rows float32)]``) and return the process's reply."""
        head = {"map_size": map_size, "parts": [["p:" + t, int(seq), int(ids.shape[0]), int(rows.shape[1])]
                                                 for t, seq, ids, rows in segments]}
        return self._call(head, [a for _, _, ids, rows in segments for a in (ids, rows)])

    def _call(self, head: dict, arrays, timeout: float | None = None, max_reply: int | None = None) -> dict:
        """Send a frame (and ``arrays``' bytes) and return the reply; ``timeout`` seconds for
        it to begin and ``max_reply`` bytes at most (for the start: a program that is not
        the writer may answer anything, or nothing)."""
        try:
            self.proc.stdin.write(frame_bytes(head))
            for a in arrays:
                self.proc.stdin.write(memoryview(a).cast("B"))
            self.proc.stdin.flush()
            if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
                self.proc.kill()
                reply = None
            else:
                reply = read_frame(self.proc.stdout, max_reply)
        except (OSError, ValueError):  # a broken pipe: the process is gone; or not a frame
            reply = None
        if reply is None:
            try:
                status = self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                status = None
            raise CorruptStoreError(f"the LMDB writer process of {self.path} ended (exit status {status}) before its "
                                    "reply; its write was rolled back, or committed and is written again",
                                    "the rows wait in memory: the next write starts a new writer process")
        return reply

    def close(self) -> None:
        """End the process and reap it (between writes: it holds no transaction)."""
        _RUNNING.discard(self)
        self._end()


def _end_process(proc: subprocess.Popen) -> None:
    """Close the writer process's input (it exits at its end: a frame cut short is never
    committed, so this may run while the writer thread is sending one, as at interpreter
    exit) and its output, and reap it (killed if it lingers)."""
    if hasattr(signal, "sigtimedwait"):
        # Closing flushes what a failed write left in the buffer: a SIGPIPE that raises is taken back.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        try:
            proc.stdin.close()
        except (OSError, ValueError):
            pass  # already gone
        finally:
            signal.sigtimedwait({signal.SIGPIPE}, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_RUNNING: "weakref.WeakSet[_WriterProcess]" = weakref.WeakSet()


def _forget_pipes_in_fork() -> None:
    """In a process forked from this one: point every writer pipe end it inherited at
    /dev/null, so that a writer still sees its input close when its trainer closes it or
    dies (the fork itself never talks to the writers; its copies of these objects just
    close /dev/null)."""
    if not _RUNNING:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for w in list(_RUNNING):
            for f in (w.proc.stdin, w.proc.stdout):
                try:
                    os.dup2(null, f.fileno())
                except (OSError, ValueError):
                    pass
        _RUNNING.clear()
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pipes_in_fork)
