"""The segment log of ``p:<table>``: rows written since the last checkpoint.

Each write transaction appends one value per table holding all its rows (format:
:func:`.codec.encode_segment`), under a sequence number that only grows.  An index in
memory (:class:`.index.SegmentIndex`, built from the segments' ids only when a store
keeps ``p:`` at open) says which segment holds each id's newest copy.  Why segments: a
B-tree insert per row rewrites most leaf pages of ``p:`` in each large transaction; an
append writes each row once.  The price: ``p:`` holds every copy written since the
checkpoint, stale ones too (:mod:`.compaction` bounds them).
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd.codec import (
    RAW,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    ZSTD,
    last_rows,
    put_segment,
    segment_key,
)
from tiered_emb.tiers.ssd.index import (
    MAX_SEGMENT_ROWS,
    MAX_SEGMENTS,
    POS_BITS,
    POS_MASK,
    SegmentIndex,
)
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.written import WrittenIds


class SegmentGone(Exception):
    """A segment the index names is no longer in ``p:`` (a checkpoint dropped it meanwhile)."""


class SegmentLog:
    """The segments of every table's ``p:``: where each row lies (:attr:`index`, table ->
    :class:`SegmentIndex`, changed under the tier's lock), the rows they hold, stale copies
    too (:attr:`stored_rows`), and the next segment's number (:attr:`next_seq`)."""

    def __init__(
        self,
        lmdb_env: LmdbEnv,
        widths: dict[str, int],
        table_rows: dict[str, int | None],
        written: WrittenIds,
        lock: threading.Lock,
        compressor,
        decompressor,
    ):
        self._lmdb = lmdb_env
        self._widths = dict(widths)
        self._table_rows = dict(table_rows)
        self._written = written
        self._lock = lock
        self._zc, self._zd = compressor, decompressor
        self.index: dict[str, SegmentIndex] = {n: SegmentIndex() for n in sorted(self._widths)}
        self.stored_rows = dict.fromkeys(sorted(self._widths), 0)
        self.next_seq = 0

    # ----------------------------------------------------------------- reading
    def load(self, table: str) -> None:
        """Index the segments of ``p:<table>`` (oldest first: a newer copy wins) and set their ids' bits."""
        index, num_rows = self.index[table], self._table_rows[table]
        with self._lmdb.reading(buffers=True) as txn, txn.cursor(db=self._lmdb.pending[table]) as cur:
            for key, value in cur:
                seq = int.from_bytes(key, "big")
                n, _ = self._head(table, seq, value)
                ids = np.frombuffer(value, dtype="<i8", count=n, offset=SEGMENT_HEADER.size).astype(np.int64)
                if (
                    len(key) != 8
                    or seq >= MAX_SEGMENTS
                    or n > MAX_SEGMENT_ROWS
                    or (n > 1 and not (ids[1:] > ids[:-1]).all())
                    or (n and (ids[0] < 0 or (num_rows is not None and ids[-1] >= num_rows)))
                ):
                    raise CorruptStoreError(
                        f"segment {bytes(key).hex()} of table {table!r} in {self._lmdb.path} is "
                        f"damaged (its key or its ids)",
                        "restore the store directory from a backup",
                    )
                index.add(seq, ids)
                self.stored_rows[table] += n
                self._written.set(table, ids)
                self.next_seq = max(self.next_seq, seq + 1)

    def _head(self, table: str, seq: int, value) -> tuple[int, int]:
        """``(rows, tag)`` of segment ``seq`` of ``table`` after checking its header and length."""
        width = self._widths[table]
        try:
            magic, version, tag, n, w = SEGMENT_HEADER.unpack_from(value)
        except Exception:  # (struct.error: shorter than a header)
            magic = None
        size = SEGMENT_HEADER.size + 8 * n + 4 * n * width if magic is not None else 0
        if (
            magic != SEGMENT_MAGIC
            or version != SEGMENT_VERSION
            or w != width
            or tag not in (RAW, ZSTD)
            or len(value) < size - (4 * n * width if tag == ZSTD else 0)
            or (tag == RAW and len(value) != size)
        ):
            raise CorruptStoreError(
                f"segment {seq} of table {table!r} in {self._lmdb.path} is damaged (its header or its length)",
                "restore the store directory from a backup",
            )
        return n, tag

    def _rows(self, table: str, seq: int, value) -> np.ndarray:
        """The rows (n, W) float32 of segment ``seq`` of ``table`` (a view of ``value`` when raw)."""
        n, tag = self._head(table, seq, value)
        at = SEGMENT_HEADER.size + 8 * n
        width = self._widths[table]
        if tag == RAW:
            return np.frombuffer(value, dtype="<f4", count=n * width, offset=at).reshape(n, width)
        try:
            body = self._zd.decompress(bytes(value[at:]), max_output_size=4 * n * width)
        except zstandard.ZstdError as err:
            raise CorruptStoreError(
                f"segment {seq} of table {table!r} in {self._lmdb.path} does not decompress ({err})",
                "restore from a backup",
            ) from err
        if len(body) != 4 * n * width:
            raise CorruptStoreError(
                f"segment {seq} of table {table!r} in {self._lmdb.path} holds {len(body)} bytes of "
                f"rows, expected {4 * n * width}",
                "restore from a backup",
            )
        return np.frombuffer(body, dtype="<f4").reshape(n, width)

    def read(self, txn, table: str, locs: np.ndarray, out_rows: np.ndarray, at: np.ndarray) -> None:
        """Rows at ``locs`` (index locations, int64) of ``p:<table>`` into ``out_rows[at]``; one
        get per segment.  Raises :class:`SegmentGone` for a segment no longer there."""
        order = np.argsort(locs, kind="stable")
        locs, at = locs[order], at[order]
        seqs = locs >> POS_BITS
        cuts = np.flatnonzero(seqs[1:] != seqs[:-1]) + 1
        db = self._lmdb.pending[table]
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, locs.shape[0]].tolist(), strict=False):
            seq = int(seqs[a])
            value = txn.get(segment_key(seq), db=db)
            if value is None:
                raise SegmentGone(seq)
            rows = self._rows(table, seq, value)
            pos = locs[a:b] & POS_MASK
            if pos[-1] >= rows.shape[0]:
                raise CorruptStoreError(
                    f"segment {seq} of table {table!r} in {self._lmdb.path} is shorter than its index says",
                    "restore the store directory from a backup",
                )
            out_rows[at[a:b]] = rows[pos]

    def read_live(self, txn, table: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)`` of the newest copy of each row of ``p:<table>``, in id order."""
        ids, locs = self.index[table].items()
        rows = np.empty((ids.shape[0], self._widths[table]), dtype=np.float32)
        try:
            self.read(txn, table, locs, rows, np.arange(ids.shape[0]))
        except SegmentGone as gone:
            raise self.gone(table, gone) from None
        return ids, rows

    def gone(self, table: str, gone: SegmentGone) -> CorruptStoreError:
        """The error of a segment the index names that is missing (only a checkpoint drops
        segments, and it holds the store's lock: only a staged read may meet one)."""
        return CorruptStoreError(
            f"segment {gone.args[0]} of table {table!r} in {self._lmdb.path} is indexed but missing",
            "restore the store directory from a backup",
        )

    # ----------------------------------------------------------------- writing
    def cut(self, snaps: list, batches: dict | None = None) -> list:
        """The segments of one write into ``p:``: per table, ``(table, number, ids, rows)`` of
        its rows in ``snaps`` (oldest first) then ``batches`` (newest), each id's last row,
        numbered on from :attr:`next_seq` (one writer at a time).  Their numbers are taken
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
            out += self.numbered(t, ids, rows)
        return out

    def numbered(self, table: str, ids: np.ndarray, rows) -> list:
        """``ids`` (and ``rows``, or their locations) cut into segments of ``table``, numbered on
        from :attr:`next_seq`, which takes them.  A segment holds at most :meth:`rows_per_segment`."""
        step = self.rows_per_segment(table)
        cuts = range(0, max(ids.shape[0], 1), step)
        if self.next_seq + len(cuts) > MAX_SEGMENTS:
            raise CorruptStoreError(
                f"{self._lmdb.path} has numbered {self.next_seq:,} segments since it opened, all it can",
                "close and reopen the store (its numbers start again after its checkpoint)",
            )
        out = [(table, self.next_seq + k, ids[a : a + step], rows[a : a + step]) for k, a in enumerate(cuts)]
        self.next_seq += len(out)
        return out

    def rows_per_segment(self, table: str) -> int:
        """Rows a segment of ``table`` holds at most: 2**20 and 256 MiB (LMDB takes values
        under 4 GiB), 1,024 with compression (a read decompresses every segment it needs whole)."""
        cap = 1 << 10 if self._zc is not None else MAX_SEGMENT_ROWS
        return max(1, min(cap, (256 << 20) // (8 + 4 * self._widths[table])))

    def put(self, txn, segments: list) -> None:
        """Append ``segments`` (:meth:`cut`) to ``p:`` in ``txn``, their ids' bits set first."""
        with self._lock:  # before the commit (rows from the write-back buffer have theirs already)
            for t, _, ids, _ in segments:
                self._written.set(t, ids)
        for t, seq, ids, rows in segments:
            put_segment(txn, self._lmdb.pending[t], seq, ids, rows, self._zc)

    def indexed(self, segments: list) -> None:
        """After ``segments`` are committed (under the tier's lock): reads find their rows in ``p:``."""
        for t, seq, ids, _ in segments:
            self.index[t].add(seq, ids)
            self.stored_rows[t] += ids.shape[0]

    def replaced(self, table: str, segments: list, live_rows: int) -> None:
        """After ``p:<table>`` is rewritten as ``segments`` holding ``live_rows`` (under the tier's lock)."""
        self.index[table].clear()
        for _, seq, seg_ids, _ in segments:
            self.index[table].add(seq, seg_ids)
        self.stored_rows[table] = live_rows

    def dropped(self) -> None:
        """After every ``p:`` is dropped (under the tier's lock)."""
        for index in self.index.values():
            index.clear()
        self.stored_rows = dict.fromkeys(self.stored_rows, 0)
        # (the numbers go on: a read staged before may still hold locations of dropped segments)
