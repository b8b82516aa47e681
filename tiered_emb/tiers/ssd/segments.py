"""The segment log of ``p:<table>``: every row the SSD tier holds.

Each write transaction appends one value per table holding all its rows (format:
:func:`.codec.encode_segment`), under a sequence number that only grows.  An index in
memory (:class:`.index.SegmentIndex`, built from the segments' ids when a store opens)
says which segment holds each id's newest copy.  Why segments: a B-tree insert per row
rewrites most leaf pages in each large transaction; an append writes each row once, and
a segment of many rows lies on LMDB's overflow pages, contiguous in the file, where
:mod:`.mapped` gathers its rows by offset.

The checkpoint is a *mark* (:attr:`SegmentLog.mark`): the segments numbered below it
are the checkpoint's, those at or above it were written since.  So a checkpoint writes
what is dirty and moves the mark, whatever the store's size; opening at the checkpoint
deletes the segments at or above it.  ``p:`` holds stale copies too (:mod:`.compaction`
bounds them).  Stores of the format before (tiered_emb/2) also hold rows as one record
per id in ``t:``; those are read below every segment and never written again.
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
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv, TxnGate
from tiered_emb.tiers.ssd.mapped import MappedFile, gather, value_offset
from tiered_emb.tiers.ssd.written import WrittenIds


class SegmentGone(Exception):
    """A segment the index names is no longer in ``p:`` (a compaction replaced it meanwhile)."""


class SegmentLog:
    """The segments of every table's ``p:``: where each row lies (:attr:`index`, table ->
    :class:`SegmentIndex`, changed under the tier's lock), the rows they hold, stale copies
    too (:attr:`stored_rows`), the next segment's number (:attr:`next_seq`) and the
    checkpoint's mark (:attr:`mark`).

    Per segment number: :attr:`base`, the float32 offset of its first row in ``data.mdb``
    (-1: not known, read through LMDB: a small or compressed segment, or none),
    :attr:`nrows`, its rows, and :attr:`live`, those the index names (the others are stale
    copies, what compaction reclaims).  Reads of segments hold :attr:`gate` shared; a change that
    deletes segments holds it exclusively from its commit until the index follows.
    """

    def __init__(
        self,
        lmdb_env: LmdbEnv,
        widths: dict[str, int],
        table_rows: dict[str, int | None],
        written: WrittenIds,
        lock: threading.Lock,
        compressor,
        decompressor,
        budget_bytes: int = 256 << 20,
    ):
        self._lmdb = lmdb_env
        self._widths = dict(widths)
        self._table_rows = dict(table_rows)
        self._written = written
        self._lock = lock
        self._zc, self._zd = compressor, decompressor
        # the index's hash of recent ids: a quarter of the budget (32-64 bytes an entry)
        delta = max(1 << 16, budget_bytes // 256)
        self.index: dict[str, SegmentIndex] = {n: SegmentIndex(delta) for n in sorted(self._widths)}
        self.stored_rows = dict.fromkeys(sorted(self._widths), 0)
        self.next_seq = 0
        self.mark = 0
        self.base = np.full(64, -1, dtype=np.int64)
        self.nrows = np.zeros(64, dtype=np.int64)
        self.live = np.zeros(64, dtype=np.int64)  # rows of each segment the index names
        self.gate = TxnGate()
        self.mapped = MappedFile(self._lmdb.path / "data.mdb")
        self._psize = int(self._lmdb.env.stat()["psize"])

    # ----------------------------------------------------------------- reading
    def load(self, table: str) -> None:
        """Index the segments of ``p:<table>`` (oldest first: a newer copy wins) and set their
        ids' bits; reads only the ids of each segment (memory: the index)."""
        index, num_rows = self.index[table], self._table_rows[table]
        index.bulk = 16
        with self._lmdb.reading(buffers=True) as txn, txn.cursor(db=self._lmdb.pending[table]) as cur:
            for key, value in cur:
                seq = int.from_bytes(key, "big")
                n, tag = self.head(table, seq, value)
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
                self.next_seq = max(self.next_seq, seq + 1)
                self._place(seq, n, tag, value)
                self._moved(index.add(seq, ids), seq, n)
                self.stored_rows[table] += n
                self._written.set(table, ids)
        index.bulk = 0
        index.merge()

    def _place(self, seq: int, n: int, tag: int, value) -> None:
        """Note where segment ``seq`` (``n`` rows, ``value`` a buffer of it) lies in the file."""
        if seq >= self.base.shape[0]:
            size = max(2 * self.base.shape[0], seq + 1)
            self.base = np.concatenate([self.base, np.full(size - self.base.shape[0], -1, dtype=np.int64)])
            self.nrows = np.concatenate([self.nrows, np.zeros(size - self.nrows.shape[0], dtype=np.int64)])
            self.live = np.concatenate([self.live, np.zeros(size - self.live.shape[0], dtype=np.int64)])
        off = value_offset(value, self._psize) if tag == RAW else -1
        self.nrows[seq] = n
        self.base[seq] = -1 if off < 0 else (off + SEGMENT_HEADER.size + 8 * n) // 4

    def _unplace(self, seqs) -> None:
        for seq in seqs:
            if seq < self.base.shape[0]:
                self.base[seq], self.nrows[seq], self.live[seq] = -1, 0, 0

    def _moved(self, old: np.ndarray, seq: int | None = None, n: int = 0, new: np.ndarray | None = None) -> None:
        """Count rows the index named elsewhere before (``old`` locations, -1: none) that it
        names now in segment ``seq`` (``n`` of them) or at ``new`` locations."""
        gone = old[old >= 0] >> POS_BITS
        if gone.shape[0]:
            self.live[: gone.max() + 1] -= np.bincount(gone)
        if seq is not None:
            self.live[seq] += n
        if new is not None and new.shape[0]:
            came = new >> POS_BITS
            self.live[: came.max() + 1] += np.bincount(came)

    def locate(self, segments: list) -> None:
        """After ``segments`` (:meth:`cut`) are committed, before they are indexed: where they lie."""
        with self._lmdb.reading(buffers=True) as txn:
            for t, seq, _, _ in segments:
                value = txn.get(segment_key(seq), db=self._lmdb.pending[t])
                if value is None:  # (not committed after all: the index will not name it)
                    continue
                n, tag = self.head(t, seq, value)
                self._place(seq, n, tag, value)

    def head(self, table: str, seq: int, value) -> tuple[int, int]:
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

    def rows_of(self, table: str, seq: int, value) -> np.ndarray:
        """The rows (n, W) float32 of segment ``seq`` of ``table`` (a view of ``value`` when raw)."""
        n, tag = self.head(table, seq, value)
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

    def read(self, table: str, locs: np.ndarray, out_rows: np.ndarray, at: np.ndarray) -> None:
        """Rows at ``locs`` (index locations, int64) of ``p:<table>`` into ``out_rows[at]``: from
        the map of the file where the segment's place is known, else one get per segment.
        Raises :class:`SegmentGone` for a segment no longer there."""
        with self.gate.reading():
            base, nrows = self.base, self.nrows
            seqs = locs >> POS_BITS
            fast = seqs < base.shape[0]
            fast[fast] = base[seqs[fast]] >= 0
            if fast.any():
                floats = self.mapped.cover(4 * int((base[seqs[fast]] + nrows[seqs[fast]] * self._widths[table]).max()))
                bad = gather(floats, base, nrows, locs[fast], self._widths[table], out_rows, at[fast])
                if bad >= 0:
                    raise self.short(table, int(seqs[fast][bad]))
                if fast.all():
                    return
                locs, at = locs[~fast], at[~fast]
            with self._lmdb.reading(buffers=True) as txn:
                self._read_gets(txn, table, locs, out_rows, at)

    def _read_gets(self, txn, table: str, locs: np.ndarray, out_rows: np.ndarray, at: np.ndarray) -> None:
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
            rows = self.rows_of(table, seq, value)
            pos = locs[a:b] & POS_MASK
            if pos[-1] >= rows.shape[0]:
                raise self.short(table, seq)
            out_rows[at[a:b]] = rows[pos]

    def short(self, table: str, seq: int) -> CorruptStoreError:
        return CorruptStoreError(
            f"segment {seq} of table {table!r} in {self._lmdb.path} is shorter than its index says",
            "restore the store directory from a backup",
        )

    def gone(self, table: str, gone: SegmentGone) -> CorruptStoreError:
        """The error of a segment the index names that is missing (only a compaction deletes
        segments, on the step's thread: only a staged read may meet one)."""
        return CorruptStoreError(
            f"segment {gone.args[0]} of table {table!r} in {self._lmdb.path} is indexed but missing",
            "restore the store directory from a backup",
        )

    def pending(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, locations)`` of the rows whose newest copy was written since the checkpoint, in id order."""
        ids, locs = self.index[table].items()
        keep = (locs >> POS_BITS) >= self.mark
        return ids[keep], locs[keep]

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
            if len(parts[t]) == 1:  # (no copy)
                ids, rows = last_rows(*parts[t][0])
            else:
                ids, rows = last_rows(
                    np.concatenate([p[0] for p in parts[t]]), np.concatenate([p[1] for p in parts[t]])
                )
            out += self.numbered(t, ids, rows)
        return out

    def numbered(self, table: str, ids: np.ndarray, rows) -> list:
        """``ids`` and ``rows`` cut into segments of ``table``, numbered on from :attr:`next_seq`,
        which takes them.  A segment holds at most :meth:`rows_per_segment`."""
        step = self.rows_per_segment(table)
        cuts = range(0, max(ids.shape[0], 1), step)
        if self.next_seq + len(cuts) > MAX_SEGMENTS:
            raise CorruptStoreError(
                f"{self._lmdb.path} has numbered {self.next_seq:,} segments, all it can",
                "export the store and import it into a new one (tiered-emb export / import)",
            )
        out = [(table, self.next_seq + k, ids[a : a + step], rows[a : a + step]) for k, a in enumerate(cuts)]
        self.next_seq += len(out)
        return out

    def rows_per_segment(self, table: str) -> int:
        """Rows a segment of ``table`` holds at most: 2**16 and 64 MiB, 1,024 with compression
        (a read decompresses every segment it needs whole)."""
        cap = 1 << 10 if self._zc is not None else 1 << 16
        return max(1, min(cap, (64 << 20) // (8 + 4 * self._widths[table])))

    def put(self, txn, segments: list) -> None:
        """Append ``segments`` (:meth:`cut`) to ``p:`` in ``txn``, their ids' bits set first."""
        with self._lock:  # before the commit (rows from the write-back buffer have theirs already)
            for t, _, ids, _ in segments:
                self._written.set(t, ids)
        for t, seq, ids, rows in segments:
            put_segment(txn, self._lmdb.pending[t], seq, ids, rows, self._zc)

    def indexed(self, segments: list) -> None:
        """After ``segments`` are committed and located (under the tier's lock): reads find their rows."""
        for t, seq, ids, _ in segments:
            self._moved(self.index[t].add(seq, ids), seq, ids.shape[0])
            self.stored_rows[t] += ids.shape[0]

    def replaced(
        self, table: str, old: list[int], old_rows: int, segments: list, moved: tuple[np.ndarray, np.ndarray]
    ) -> None:
        """After segments ``old`` of ``table`` (``old_rows`` rows) are rewritten as ``segments``
        (committed, not yet located), under the tier's lock: ``moved`` ``(ids, locations)`` are the
        rows whose newest copy moved."""
        self._moved(self.index[table].set(*moved), new=moved[1])
        kept = {s[1] for s in segments}
        self._unplace([q for q in old if q not in kept])
        for _, seq, ids, _ in segments:  # read through LMDB until :meth:`locate` finds them
            self.base[seq], self.nrows[seq] = -1, ids.shape[0]
        self.stored_rows[table] += sum(s[2].shape[0] for s in segments) - old_rows

    def nrows_of(self, seqs: list[int]) -> int:
        return int(sum(int(self.nrows[q]) for q in seqs if q < self.nrows.shape[0]))

    def index_bytes(self) -> int:
        """Bytes of the index and the per-segment arrays."""
        return sum(ix.nbytes for ix in self.index.values()) + self.base.nbytes + self.nrows.nbytes

    def close(self) -> None:
        self.mapped.close()
