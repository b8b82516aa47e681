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

import time

import numpy as np

from tiered_emb._jit import split_parts, take_rows
from tiered_emb._order import stable_argsort
from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd import decode
from tiered_emb.tiers.ssd.codec import (
    RAW,
    encode_segment,
    ids_crc,
    last_rows,
    put_segment,
    put_value,
    segment_key,
    sum_weights,
)
from tiered_emb.tiers.ssd.context import SsdContext
from tiered_emb.tiers.ssd.index import (
    MAX_SEGMENT_ROWS,
    MAX_SEGMENTS,
    POS_BITS,
    POS_MASK,
    SegmentIndex,
)
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv, TxnGate
from tiered_emb.tiers.ssd.mapped import (
    MappedFile,
    gather,
    gather_split,
    pack_rows,
    span,
    value_offset,
)

# a read's gather from the map is cut into slices of at least this many rows for Numba's threads
GATHER_SPLIT_FROM = 1024

#: Seconds a merge of the index in slices pauses between two, the tier's lock let go.
HANDOVER_S = 2e-4

#: The fewest entries a table's hash of new ids holds before it is merged
#: (:class:`.SegmentIndex`'s ``delta_rows``), whatever the budget and the tables' count.
DELTA_FLOOR = 1 << 12


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

    def __init__(self, ctx: SsdContext):
        self._lmdb = ctx.lmdb
        self._widths = dict(ctx.widths)
        #: table -> its rows' dtype code, in every segment's header (``codec.DTYPE_CODES``)
        self.dtypes = {n: ctx.dtypes.get(n, 0) for n in sorted(ctx.widths)}
        self._table_rows = dict(ctx.table_rows)
        self._written = ctx.written
        self._lock = ctx.lock
        self._zc, self._zd = ctx.compressor, ctx.decompressor
        budget_bytes = self._budget = ctx.budget_bytes
        # the index's hashes of recent ids: a quarter of the budget for all tables together
        # (32-64 bytes an entry), a table's at least DELTA_FLOOR entries
        delta = max(DELTA_FLOOR, budget_bytes // 256 // max(len(self._widths), 1))
        self.index: dict[str, SegmentIndex] = {
            n: SegmentIndex(delta, self._table_rows[n]) for n in sorted(self._widths)
        }
        self.stored_rows = dict.fromkeys(sorted(self._widths), 0)
        self.next_seq = 0
        self.mark = 0
        self.marks = [0]  # the marks of the checkpoints kept, increasing (the last: :attr:`mark`)
        self.base = np.full(64, -1, dtype=np.int64)
        self.nrows = np.zeros(64, dtype=np.int64)
        self.live = np.zeros(64, dtype=np.int64)  # rows of each segment the index names
        self.summed = np.zeros(64, dtype=np.int64)  # 1: each row is followed by its checksum
        self.gate = TxnGate()
        #: check each row read by offset against its checksum (off only to measure what checking costs)
        self.check_sums = True
        self._weights = {n: sum_weights(w) for n, w in self._widths.items()}
        self.mapped = MappedFile(self._lmdb.path / "data.mdb")
        self._psize = int(self._lmdb.env.stat()["psize"])

    @property
    def lmdb(self) -> LmdbEnv:
        return self._lmdb

    @property
    def table_rows(self) -> dict[str, int | None]:
        """Each table's ``num_rows`` (None: ids unbounded)."""
        return self._table_rows

    @property
    def page_size(self) -> int:
        return self._psize

    def catch_up(self, plan) -> None:
        """Apply ``plan`` (:func:`.catchup.plan`, worked out in the snapshot now pinned), under
        the tier's lock: the fresh segments indexed, oldest first (a copy replaces the one the
        index names unless that one is newer: each id placed in a gone segment has a copy at
        least as new among the fresh ones, the plan checked), the gone ones forgotten."""
        table, gone, fresh = plan
        index = self.index[table]
        with self._lock:
            if fresh:  # (before the rows are counted in :attr:`live`: numbers past those indexed so far)
                self._grow(max(f.seq for f in fresh))
            self.stored_rows[table] -= self.nrows_of([int(q) for q in gone])
            for f in fresh:
                n = f.ids.shape[0]
                locs = (np.int64(f.seq) << np.int64(POS_BITS)) + np.arange(n, dtype=np.int64)
                held = index.find(f.ids)
                newer = (held < 0) | ((held >> POS_BITS) <= f.seq)
                self._moved(index.set(f.ids[newer], locs[newer]), new=locs[newer])
                self._written.set(table, f.ids)
                self.next_seq = max(self.next_seq, f.seq + 1)
                self.stored_rows[table] += n
            self._unplace(sorted({int(q) for q in gone} - {f.seq for f in fresh}))  # (rewritten: placed again)
            for f in fresh:
                self._place(f.seq, f.head, f.value)
            index.merge()

    # ----------------------------------------------------------------- reading
    def load(self, table: str, below: int | None = None) -> None:
        """Index the segments of ``p:<table>`` (oldest first: a newer copy wins; those numbered
        ``below`` and after left out) and set their ids' bits.  One walk checks each segment
        and notes where it lies; then the index takes their ids, read in place in the map, a
        range of ids at a time (:meth:`.SegmentIndex.load_runs`; memory: the index and about
        a third of the budget).  Reads only the ids of each segment; a damaged one is raised
        before anything is indexed."""
        index, num_rows = self.index[table], self._table_rows[table]
        runs = []
        with self._lmdb.reading(buffers=True) as txn, txn.cursor(db=self._lmdb.pending[table]) as cur:
            for key, value in cur:
                seq = int.from_bytes(key, "big")
                if below is not None and seq >= below:
                    break
                if len(key) != 8 or seq >= MAX_SEGMENTS:
                    raise decode.damaged(self._lmdb.path, table, seq, f"its key {bytes(key).hex()}")
                h = self.head(table, seq, value)
                if h.n > MAX_SEGMENT_ROWS:
                    raise decode.damaged(self._lmdb.path, table, seq, f"{h.n:,} rows, more than a segment holds")
                ids = decode.ids_of(self._lmdb.path, table, seq, value, h, num_rows)  # (a view of the map)
                self.next_seq = max(self.next_seq, seq + 1)
                self._place(seq, h, value)
                self.stored_rows[table] += h.n
                runs.append((seq, ids))
            live = index.load_runs(runs, max(1 << 16, self._budget // 96))
        self.live[: live.shape[0]] += live
        # every id of a segment is in the index once: its bits set in order, a slice at a time
        for a in range(0, len(index), 1 << 20):
            self._written.set(table, index.ids[a : a + (1 << 20)])

    def reload(self, table: str) -> None:
        """Index ``table`` again from its segments, as an open does (after a purge dropped
        tombstones its index still named); under the tier's lock."""
        with self._lmdb.reading() as txn, txn.cursor(db=self._lmdb.pending[table]) as cur:
            seqs = [int.from_bytes(key, "big") for key in cur.iternext(keys=True, values=False)]
        self._unplace(seqs)
        self.stored_rows[table] = 0
        self.index[table].clear()
        self.load(table)

    def _grow(self, seq: int) -> None:
        """Make the per-segment arrays hold segment ``seq``."""
        if seq >= self.base.shape[0]:
            size = max(2 * self.base.shape[0], seq + 1)
            grow = size - self.base.shape[0]
            self.base = np.concatenate([self.base, np.full(grow, -1, dtype=np.int64)])
            self.nrows = np.concatenate([self.nrows, np.zeros(grow, dtype=np.int64)])
            self.live = np.concatenate([self.live, np.zeros(grow, dtype=np.int64)])
            self.summed = np.concatenate([self.summed, np.zeros(grow, dtype=np.int64)])

    def _place(self, seq: int, h: decode.Head, value) -> None:
        """Note where segment ``seq`` (layout ``h``, ``value`` a buffer of it) lies in the file."""
        self._grow(seq)
        off = value_offset(value, self._psize) if h.tag == RAW else -1
        self.nrows[seq] = h.n
        self.summed[seq] = int(h.crc is not None)
        self.base[seq] = -1 if off < 0 else (off + h.rows_at) // 4

    def _unplace(self, seqs) -> None:
        for seq in seqs:
            if seq < self.base.shape[0]:
                self.base[seq], self.nrows[seq], self.live[seq], self.summed[seq] = -1, 0, 0, 0

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
                self._place(seq, self.head(t, seq, value), value)

    def head(self, table: str, seq: int, value) -> decode.Head:
        """The layout of segment ``seq`` of ``table``, its header and length checked."""
        return decode.head(self._lmdb.path, table, seq, value, self._widths[table], self.dtypes[table])

    def moved_here(self, table: str, seq: int, key, value) -> bool:
        """Whether segment ``seq`` is whole but stored under another number (its header, length
        and ids are sound, the CRC of its number and ids is not): a damaged key."""
        if len(key) != 8:
            return False
        try:
            h = self.head(table, seq, value)
            ids = np.frombuffer(value, dtype="<i8", count=h.n, offset=h.ids_at)
        except CorruptStoreError:
            return False
        sound = decode.ids_sound(ids, self._table_rows[table])
        return sound and h.crc is not None and ids_crc(seq, ids) != h.crc

    def misplaced(self, table: str, seq: int) -> CorruptStoreError:
        return decode.damaged(
            self._lmdb.path,
            table,
            seq,
            "whole, but under another number: its key is damaged, and it may be the checkpoint's; nothing was deleted",
        )

    def records_of(self, table: str, seq: int, value) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, records)`` of segment ``seq`` of ``table``: its ids checked (a view of ``value``),
        its records (n, W + 1) uint32, each row's checksum the word past its W (n, W in a
        version 1 segment), not checked yet: :func:`.mapped.take_checked` checks the rows it takes."""
        h = self.head(table, seq, value)
        ids = decode.ids_of(self._lmdb.path, table, seq, value, h, self._table_rows[table])
        return ids, decode.records_of(self._lmdb.path, table, seq, value, h, self._zd)

    def read(self, table: str, ids: np.ndarray, locs: np.ndarray, out_rows: np.ndarray, at: np.ndarray) -> None:
        """Rows of ``ids`` at ``locs`` (index locations, int64) of ``p:<table>`` into
        ``out_rows[at]``, each checked against its checksum: from the map of the file where the
        segment's place is known, else one get per segment.  Raises :class:`SegmentGone` for a
        segment no longer there, :class:`CorruptStoreError` for a row that fails its check."""
        width = self._widths[table]
        with self.gate.reading():
            base, nrows, summed = self.base, self.nrows, self.summed
            slow = np.empty(locs.shape[0], dtype=np.uint8)
            n_slow, end = span(base, nrows, summed, locs, width, slow)
            if n_slow < locs.shape[0]:
                floats = self.mapped.cover(4 * int(end))
                if n_slow:
                    fast = slow == 0
                    f_ids, f_locs, f_at = ids[fast], locs[fast], at[fast]
                else:  # (the common case: no copies)
                    f_ids, f_locs, f_at = ids, locs, at
                args = (floats, base, nrows, summed, f_locs, f_ids, width, out_rows, f_at)
                parts = split_parts(f_locs.shape[0], GATHER_SPLIT_FROM)
                if parts > 1:
                    bad = gather_split(*args, self._weights[table], self.check_sums, parts)
                else:
                    bad = gather(*args, self._weights[table], self.check_sums)
                if bad >= 0:
                    raise self._bad_gather(table, f_ids, f_locs, bad)
                if not n_slow:
                    return
                rest = slow == 1
                ids, locs, at = ids[rest], locs[rest], at[rest]
            with self._lmdb.reading(buffers=True) as txn:
                self._read_gets(txn, table, ids, locs, out_rows, at)

    def _read_gets(self, txn, table: str, ids, locs: np.ndarray, out_rows: np.ndarray, at: np.ndarray) -> None:
        order = stable_argsort(locs)
        ids, locs, at = ids[order], locs[order], at[order]
        seqs = locs >> POS_BITS
        cuts = np.flatnonzero(seqs[1:] != seqs[:-1]) + 1
        db, width, path = self._lmdb.pending[table], self._widths[table], self._lmdb.path
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, locs.shape[0]].tolist(), strict=False):
            seq = int(seqs[a])
            value = txn.get(segment_key(seq), db=db)
            if value is None:
                raise SegmentGone(seq)
            h = self.head(table, seq, value)
            pos = locs[a:b] & POS_MASK
            if pos[-1] >= h.n:
                raise self.short(table, seq)
            records = decode.records_of(path, table, seq, value, h, self._zd)[pos]
            bad = decode.bad_rows(ids[a:b], records, width)
            if bad.shape[0]:
                seg_ids = decode.ids_of(path, table, seq, value, h, self._table_rows[table])
                raise decode.checksum_error(path, table, seq, seg_ids, pos[bad])
            out_rows[at[a:b]] = records[:, :width].view(np.float32)

    def _bad_gather(self, table: str, ids: np.ndarray, locs: np.ndarray, code: int) -> CorruptStoreError:
        """The error of what :func:`.mapped.gather` returned ``code`` for."""
        seq = int(locs[code >> 1] >> POS_BITS)
        if code & 1 == 0:
            return self.short(table, seq)
        n, base = int(self.nrows[seq]), int(self.base[seq])
        seg_ids = self.mapped.floats[base - 2 * n : base].view(np.int64)  # (right before the records)
        lo, hi = int(seg_ids[0]), int(seg_ids[-1])
        return CorruptStoreError(
            f"the row of id {int(ids[code >> 1])} in segment {seq} of table {table!r} (ids {lo}..{hi}) at byte "
            f"{4 * (base + (int(locs[code >> 1]) & POS_MASK) * (self._widths[table] + 1)):,} of "
            f"{self._lmdb.path / 'data.mdb'} fails its checksum",
            decode.RESTORE,
        )

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
                ids, rows = last_rows(*parts[t][0], take_rows, stable_argsort)
            else:
                ids, rows = last_rows(
                    np.concatenate([p[0] for p in parts[t]]),
                    np.concatenate([p[1] for p in parts[t]]),
                    take_rows,
                    stable_argsort,
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
        """Rows a segment of ``table`` holds at most: 2**16 and 64 MiB (ids, rows and their
        checksums), 1,024 with compression
        (a read decompresses every segment it needs whole)."""
        cap = 1 << 10 if self._zc is not None else 1 << 16
        return max(1, min(cap, (64 << 20) // (8 + 4 * (self._widths[table] + 1))))

    def encoded(self, segments: list) -> list:
        """``segments`` (:meth:`cut`) with each one's rows replaced by its LMDB value
        (:func:`.codec.encode_segment`): the CPU's part of a write, done outside its transaction."""
        return [
            (t, seq, ids, encode_segment(ids, rows, self._zc, seq, pack_rows, self.dtypes[t]))
            for t, seq, ids, rows in segments
        ]

    def put(self, txn, segments: list) -> None:
        """Append ``segments`` (:meth:`cut`, or :meth:`encoded`) to ``p:`` in ``txn``, their ids'
        bits set first."""
        with self._lock:  # before the commit (rows from the write-back buffer have theirs already)
            for t, _, ids, _ in segments:
                self._written.set(t, ids)
        for t, seq, ids, rows in segments:
            if isinstance(rows, np.ndarray) and rows.ndim == 2:
                put_segment(txn, self._lmdb.pending[t], seq, ids, rows, self._zc, pack=pack_rows, dtype=self.dtypes[t])
            else:
                put_value(txn, self._lmdb.pending[t], seq, rows)

    def found(self, segments: list) -> list:
        """Where the ids of ``segments`` lie in the index now (:meth:`.SegmentIndex.positions`):
        searched by the one writer with the tier's lock let go, so that :meth:`indexed` holds
        it only to change the index."""
        tables = sorted({s[0] for s in segments})
        # (the hash of new ids grown first, with the lock let go: at most every id is new)
        grown = {t: self.index[t].grown(sum(s[2].shape[0] for s in segments if s[0] == t)) for t in tables}
        with self._lock:
            for t in tables:
                self.index[t].reserve(grown[t])
            views = {t: self.index[t].view() for t in tables}
        return [SegmentIndex.positions(views[t], ids) for t, _, ids, _ in segments]

    def merge_due(self) -> None:
        """Merge each table's hash of new ids that is due into its sorted arrays
        (:meth:`.SegmentIndex.merge_slices`), the tier's lock held over each slice and let go
        between them, so that reads, and the next write-back's indexing, go on meanwhile.
        By the writer thread (or the one writer where there is none)."""
        for t in sorted(self.index):
            with self._lock:
                if not self.index[t].merge_due:
                    continue
                held = self.index[t].begin_merge()  # (the hash frozen: sorted with the lock let go)
            items = (*self.index[t].delta_items(held), held[3])
            with self._lock:
                steps = self.index[t].merge_slices(items=items)
            more = True
            while more:
                with self._lock:
                    more = next(steps, False) is None
                # (the lock is not fair: taken again at once, a step waiting for it would wait
                # for the whole merge; a pause lets it in between slices)
                time.sleep(HANDOVER_S)

    def indexed(self, segments: list, found: list | None = None) -> None:
        """After ``segments`` are committed and located (under the tier's lock): reads find their
        rows.  ``found``: :meth:`found` of ``segments``."""
        for k, (t, seq, ids, _) in enumerate(segments):
            self._moved(self.index[t].add(seq, ids, found[k] if found else None), seq, ids.shape[0])
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
