"""The SSD tier's read path: memory first, then the segments of ``p:``, then ``t:``; and staged reads.

A read takes the newest copy of each row: the write-back buffer, the snapshots being
written, rows staged for this batch (equal to LMDB's), then ``p:`` through the segment
index (gathered from the map of the file, :mod:`.mapped`), then, in a store of the format
before segments only, the records of ``t:`` in key order (one sequential walk).  Ids whose written
bit is clear are nowhere here and are not looked up at all.
"""

from __future__ import annotations

import lmdb
import numpy as np
import zstandard

from tiered_emb._order import stable_argsort
from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd.codec import RAW, ZSTD, is_tombstone, lmdb_keys
from tiered_emb.tiers.ssd.context import SsdContext
from tiered_emb.tiers.ssd.rowbuf import ABSENT, FOUND, RowBuffer
from tiered_emb.tiers.ssd.segments import SegmentGone, SegmentLog


def _cursor_get_many(cur, keys: list[bytes]) -> list[tuple[bytes, bytes]]:
    """``(key, value)`` of each of ``keys`` held by ``cur``'s database, in the order of ``keys``.

    A loop of ``set_key`` (``Cursor.getmulti`` and ``Cursor.get`` cost the same).
    py-lmdb drops the GIL around every key whichever call is used, so beside a thread
    running pure Python each key waits for its turn (docs/benchmarks.md).
    """
    got = []
    for key in keys:
        if cur.set_key(key):
            got.append((key, cur.value()))
    return got


class Reader:
    """Reads of the SSD tier's rows, for any thread: :meth:`read` (the step's) and
    :meth:`stage` (ahead of the step, on the lookahead thread)."""

    def __init__(self, ctx: SsdContext, segments: SegmentLog):
        self._lmdb = ctx.lmdb
        self._widths = dict(ctx.widths)
        self._held = ctx.held
        self._segments = segments
        self._written = ctx.written
        self._lock = ctx.lock
        self._zd = ctx.decompressor

    def read(self, table: str, ids: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """Read the records of ``ids`` (int64 (k,), distinct) into ``out_rows`` (k, W).

        Returns the found mask (bool (k,)): a row whose newest copy is a tombstone (a
        deleted row, :func:`.codec.tombstones`) is not found.
        """
        found = self._read(table, ids, out_rows)
        if found.any():
            found &= ~is_tombstone(out_rows)
        return found

    def _read(self, table: str, ids: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        at = self._written.maybe_stored(table, ids, np.arange(ids.shape[0]))
        if at.shape[0] == ids.shape[0]:
            return self._read_held(table, ids, out_rows)
        if at.shape[0] == 0:
            return np.zeros(ids.shape[0], dtype=bool)
        # the ids never written are nowhere here: marked absent at once, the others read
        # straight into their rows of ``out_rows``
        state = np.full(ids.shape[0], ABSENT, dtype=np.uint8)
        state[at] = 0
        return self._read_held(table, ids, out_rows, state)

    def _read_held(
        self, table: str, ids: np.ndarray, out_rows: np.ndarray, state: np.ndarray | None = None
    ) -> np.ndarray:
        """:meth:`read` of ids that may be held (each one looked for in memory, then LMDB);
        ``state``: ids already answered are not 0 there (None: none)."""
        state = np.zeros(ids.shape[0], dtype=np.uint8) if state is None else state
        if ids.shape[0] == 0:
            return state.astype(bool)
        with self._lock:
            self._held.get(table, ids, out_rows, state)
            todo = np.flatnonzero(state == 0)
            locs = self._segments.index[table].find(ids[todo])
        # LMDB last, in transactions begun after the look above: a snapshot gone since was
        # committed (and indexed) first, so the transaction sees its rows.
        if todo.shape[0]:
            try:
                self.read_lmdb(table, ids[todo], out_rows, todo, state, locs)
            except SegmentGone as gone:  # only compaction deletes segments, under the store's lock, as this read
                raise self._segments.gone(table, gone) from None
        return state == FOUND

    def read_lmdb(
        self, table: str, ids: np.ndarray, out_rows: np.ndarray, at: np.ndarray, state: np.ndarray, locs: np.ndarray
    ) -> None:
        """Records of ``ids`` (distinct) into ``out_rows[at]``, ``state[at]`` = FOUND where found:
        from the segments of ``p:`` at ``locs`` (their index locations, -1: none), the rest from ``t:``."""
        n_p = int(np.count_nonzero(locs >= 0))
        try:
            if n_p == ids.shape[0]:  # (the common case: every row in a segment, no copies)
                self._segments.read(table, ids, locs, out_rows, at)
                state[at] = FOUND
                return
            in_p = locs >= 0
            if n_p:
                self._segments.read(table, ids[in_p], locs[in_p], out_rows, at[in_p])
                state[at[in_p]] = FOUND
                ids, at = ids[~in_p], at[~in_p]
            if ids.shape[0] == 0 or not self._lmdb.records[table]:
                return
            # rows of a store of the format before segments, one record per id in ``t:``
            order = stable_argsort(ids)  # key order: one sequential walk
            ids, at = ids[order], at[order]
            # bytes, not buffers: py-lmdb's buffer objects cost more than the copies they save
            with self._lmdb.reading() as txn:
                with txn.cursor(db=self._lmdb.main[table]) as cur:
                    got = _cursor_get_many(cur, lmdb_keys(ids))
                if got:
                    self._decode_many(got, ids, at, out_rows, state)
        except lmdb.Error as err:
            raise CorruptStoreError(
                f"reading table {table!r} from {self._lmdb.path} failed ({err})",
                "restore the store directory from a backup",
            ) from err

    def _decode_many(self, got, ids, at, out_rows, state) -> None:
        """Decode ``got`` ((key, value) pairs of :func:`_cursor_get_many` over sorted ``ids``) into ``out_rows[at]``."""
        got_ids = np.frombuffer(b"".join(k for k, _ in got), dtype=">i8").astype(np.int64)
        at = at[np.searchsorted(ids, got_ids)]
        width = out_rows.shape[1]
        values = [v for _, v in got]
        if all(len(v) == 1 + 4 * width for v in values):  # every record raw-sized: decode as one array
            raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), 1 + 4 * width)
            if (raw[:, 0] == RAW).all():
                out_rows[at] = np.ascontiguousarray(raw[:, 1:]).view(np.float32)
                state[at] = FOUND
                return
        for j, v in enumerate(values):
            self._decode(v, out_rows[at[j]])
        state[at] = FOUND

    def _decode(self, value, out_row: np.ndarray) -> None:
        """One record of ``t:`` (a tag byte, then the row's bytes, raw or zstd) into ``out_row``."""
        tag = value[0]
        body = bytes(value[1:])
        if tag == ZSTD:
            try:
                body = self._zd.decompress(body)
            except zstandard.ZstdError as err:
                raise CorruptStoreError(
                    f"an LMDB record of {self._lmdb.path} does not decompress ({err})", "restore from a backup"
                ) from err
        elif tag != RAW:
            raise CorruptStoreError(
                f"an LMDB record of {self._lmdb.path} has unknown tag {tag}", "restore from a backup"
            )
        if len(body) != out_row.nbytes:
            raise CorruptStoreError(
                f"an LMDB record of {self._lmdb.path} has {len(body)} bytes, expected {out_row.nbytes}",
                "restore from a backup",
            )
        out_row[:] = np.frombuffer(body, dtype=np.float32)

    # ----------------------------------------------------------------- staged reads
    def stage(self, key: int, batch: dict[str, np.ndarray]) -> bool:
        """Read the LMDB records of ``batch`` ({table: distinct ids}) ahead of the step that needs them.

        Runs on any thread and takes none of the store's locks.  The rows are held under
        ``key`` until they are unstaged; :meth:`read` then answers them from memory.  A
        read that overlapped an LMDB write is dropped (returns False): its rows may be
        older than the write.
        """
        with self._lock:
            gen = self._held.gen
        staged = {}
        for table in sorted(batch):
            ids = np.ascontiguousarray(batch[table], dtype=np.int64)
            rows = np.empty((ids.shape[0], self._widths[table]), dtype=np.float32)
            state = np.zeros(ids.shape[0], dtype=np.uint8)
            at = self._written.maybe_stored(table, ids, np.arange(ids.shape[0]))
            if at.shape[0]:
                with self._lock:
                    locs = self._segments.index[table].find(ids[at])
                try:
                    self.read_lmdb(table, ids[at], rows, at, state, locs)
                except (SegmentGone, CorruptStoreError) as err:
                    # a compaction since rewrote the segments it looked at: as a read that
                    # overlapped a write (damage that was there before is raised)
                    with self._lock:
                        if self._held.gen == gen:
                            if isinstance(err, SegmentGone):
                                raise self._segments.gone(table, err) from None
                            raise
                        self._held.staging_dropped()
                    return False
            state[state == 0] = ABSENT
            buf = RowBuffer(self._widths[table], ids.shape[0])
            buf.put(ids, rows, state)
            staged[table] = buf
        with self._lock:
            return self._held.keep_staged(key, staged, gen)
