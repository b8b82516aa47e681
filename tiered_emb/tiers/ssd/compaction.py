"""Compaction of ``p:``: runs of a table's segments rewritten as fewer segments of the rows they still need.

``p:`` keeps every copy written, stale ones too: rows written back again and again would
grow the file without end.  A table whose segments hold far more rows than it has live
is compacted a *run* at a time: a few consecutive segments (by number, all between the
same two marks of the checkpoints kept), at most ``budget_bytes`` of rows, rewritten in one write
transaction that deletes them and puts the rows they still need under the highest of
their numbers.  Each write-back compacts at most one run, and the next one starts where
it stopped (:attr:`Compactor.cursor`), so the work is spread over the run and bounded
in memory.

Which rows a run still needs: each id's newest copy within the run, when the index
names it (the copy every read takes), or when the newest copy lies at or past the first
kept mark after the run (the run may hold the copy that checkpoint reads, when the
store is reopened at it).  Why consecutive segments and their own
numbers: a segment reopening reads newer than the run stays newer, an older one stays
older, so the newest copy of every id is the same before and after.
"""

from __future__ import annotations

import bisect

import numpy as np

from tiered_emb.tiers.ssd.codec import is_tombstone, put_segment, segment_key
from tiered_emb.tiers.ssd.context import SsdContext
from tiered_emb.tiers.ssd.decode import checksum_error
from tiered_emb.tiers.ssd.index import POS_BITS
from tiered_emb.tiers.ssd.mapped import pack_rows, take_checked
from tiered_emb.tiers.ssd.segments import SegmentLog


class _NoGain(Exception):
    """A run that needs every row it holds (its transaction is rolled back)."""


class Compactor:
    """Finds the tables of ``segments`` due for compaction and rewrites them, a run at a time."""

    #: A table is compacted while its segments hold more than this many times the rows it
    #: has live (and at least :attr:`COMPACT_MIN_ROWS`).
    COMPACT_RATIO = 2
    COMPACT_MIN_ROWS = 1 << 20

    def __init__(self, ctx: SsdContext, segments: SegmentLog):
        self._lmdb = ctx.lmdb
        self._widths = dict(ctx.widths)
        self._held = ctx.held
        self._segments = segments
        self._lock = ctx.lock
        self._zc = ctx.compressor
        self.budget_bytes = int(ctx.budget_bytes)
        self.cursor = dict.fromkeys(sorted(self._widths), 0)  # the number the next run starts at
        self.runs = 0
        #: while :meth:`purge` runs: ``"stale"``, every segment holding a stale copy is worth a
        #: run; ``"all"``, every segment below the oldest kept mark (for its tombstones)
        self.purging: str | None = None
        self._dropped: set[str] = set()  # tables whose tombstones a purge dropped
        # table -> {segment -> (mark, rows)}: segments that hold only rows still needed at that
        # mark (a run that kept every row, or a run's output that kept rows the index does not
        # name: the checkpoint's copies of rows written since); not taken again, nor counted
        # by :meth:`due`, until the mark moves
        self._tried: dict[str, dict[int, tuple[int, int]]] = {t: {} for t in sorted(self._widths)}
        # the rows a run keeps, taken into the same memory run after run (a quarter of
        # ``budget_bytes`` at most, or one segment): fresh pages cost more than the copy
        self._kept = np.empty(0, dtype=np.uint32)

    def due(self) -> list[str]:
        """The tables whose stale copies passed the bound, in name order.  The segments that
        hold only rows a kept checkpoint still reads (tried at this mark) count on neither
        side: no run can shrink them before the mark moves, and counting their stale copies
        would keep the bound passed, every write-back waiting for the writer to compact the
        rest ever harder."""
        seg = self._segments
        out = []
        for t in sorted(self._widths):
            stored, live = seg.stored_rows[t], len(seg.index[t])
            if stored < self.COMPACT_MIN_ROWS:
                continue
            held = self._held_by_mark(t)
            if held.shape[0]:
                stored -= int(seg.nrows[held].sum())
                live -= int(seg.live[held].sum())
            if stored > self.COMPACT_RATIO * live:
                out.append(t)
        return out

    def _held_by_mark(self, table: str) -> np.ndarray:
        """The numbers of ``table``'s segments tried at the current mark and unchanged since
        (int64); the entries of earlier marks are dropped."""
        seg, tried = self._segments, self._tried[table]
        for seq in [q for q, (mark, _) in tried.items() if mark != seg.mark]:
            del tried[seq]
        return np.array(
            [q for q, (_, n) in tried.items() if q < seg.nrows.shape[0] and int(seg.nrows[q]) == n > 0],
            dtype=np.int64,
        )

    def step(self) -> None:
        """Compact one run of each table that is due, the run that begins at its stalest
        segment (under the store's lock, no write in flight)."""
        for t in self.due():
            self.compact_run(t, stalest=True)

    def compact(self, tables: list[str]) -> None:
        """Compact every run of each of ``tables``, oldest first (:meth:`compact_run` until none is left)."""
        for t in tables:
            self.cursor[t] = 0
            while self.compact_run(t):
                pass

    def purge(self, tables: list[str]) -> None:
        """:meth:`compact` taking every segment that holds a stale copy, however few: after
        it, a row's old copies (a deleted row's bytes) are in no segment but those a kept
        checkpoint reads (LMDB keeps the freed pages in its file until it reuses them).

        It also drops the tombstones nothing needs: one in a run below the oldest kept mark
        (every kept checkpoint reads it as its id's newest copy) whose id has no older copy
        left, which the first pass, oldest segments first, has made sure of (every older copy
        was stale, and no kept checkpoint read it); a second pass reads every segment below
        that mark for them.  Each table that lost one is indexed again from its segments at
        the end (the runs' moves named them until then)."""
        try:
            for self.purging in ("stale", "all"):
                self.compact(tables)
        finally:
            self.purging = None
            for table in sorted(self._dropped):  # (their index still names the dropped tombstones)
                with self._lock:
                    self._segments.reload(table)
            self._dropped.clear()

    def compact_run(self, table: str, stalest: bool = False) -> bool:
        """Rewrite the next run of ``table`` from :attr:`cursor`; False when there was none left
        (the cursor is back at the start).  With ``stalest``, the run that begins at the
        segment worth compacting with the smallest share of live rows instead (the cursor
        left as it is): the fewest rows copied for the rows freed.  A failure rolls back and
        leaves ``p:`` as it was."""
        start = self._stalest(table) if stalest else self.cursor[table]
        run = self._next_run(table, start) if start is not None else []
        if not stalest:
            self.cursor[table] = run[-1] + 1 if run else 0
        if not run:
            return False
        old_rows = self._segments.nrows_of(run)
        moved: tuple[np.ndarray, np.ndarray] = (np.empty(0, np.int64), np.empty(0, np.int64))
        out: list = []

        def fn(txn):
            nonlocal moved, out
            ids, rows, moved_at = self.needed(txn, table, run)  # (raises _NoGain: nothing to reclaim)
            # (segments written under another setting may be larger than this one's: the
            # run's numbers must hold what it keeps)
            step = max(self._segments.rows_per_segment(table), -(-ids.shape[0] // len(run)))
            n_out = -(-ids.shape[0] // step)
            keys = run[len(run) - n_out :]  # the highest numbers of the run
            db = self._lmdb.pending[table]
            for seq in run:
                txn.delete(segment_key(seq), db=db)
            out = [(table, seq, ids[k * step : (k + 1) * step], None) for k, seq in enumerate(keys)]
            for k, (_, seq, seg_ids, _) in enumerate(out):
                put_segment(
                    txn,
                    db,
                    seq,
                    seg_ids,
                    rows[k * step : (k + 1) * step],
                    self._zc,
                    append=False,
                    pack=pack_rows,
                    dtype=self._segments.dtypes[table],
                )
            pos = np.arange(ids.shape[0], dtype=np.int64)
            locs = (np.asarray(keys, dtype=np.int64)[pos // step] << np.int64(POS_BITS)) + pos % step
            moved = (ids[moved_at], locs[moved_at])

        with self._segments.gate.exclusive():
            try:
                self._lmdb.write(fn, buffers=True)  # (the run read, and its kept rows copied, before any write)
            except _NoGain:
                for seq in run:
                    self._tried[table][seq] = (self._segments.mark, int(self._segments.nrows[seq]))
                return True
            with self._lock:  # first: a failed locate below leaves reads going through LMDB
                self._segments.replaced(table, run, old_rows, out, moved)
                self._held.written(None)
            self._segments.locate(out)
        for _, seq, seg_ids, _ in out:
            if self._segments.live[seq] < seg_ids.shape[0]:
                self._tried[table][seq] = (self._segments.mark, seg_ids.shape[0])
        self.runs += 1
        return True

    def _worth(self, table: str, seq: int) -> bool:
        """Whether segment ``seq`` is at least half stale copies (and was not rewritten at this
        mark already, keeping copies only a reopening at the checkpoint reads)."""
        seg = self._segments
        n = int(seg.nrows[seq]) if seq < seg.nrows.shape[0] else 0
        if self.purging == "all":
            worth = seq < min(seg.marks, default=0)
        else:
            worth = int(seg.live[seq]) < n if self.purging else 2 * int(seg.live[seq]) <= n
        return n > 0 and worth and self._tried[table].get(seq) != (seg.mark, n)

    def _stalest(self, table: str) -> int | None:
        """The number of ``table``'s segment worth compacting (:meth:`_worth`) whose rows are
        the fewest live for their count, the lowest number on a tie; None when none is."""
        seg = self._segments
        with self._lmdb.reading() as txn, txn.cursor(db=self._lmdb.pending[table]) as cur:
            if not cur.first():
                return None
            seqs = np.frombuffer(b"".join(cur.iternext(keys=True, values=False)), dtype=">u8").astype(np.int64)
        seqs = seqs[seqs < seg.nrows.shape[0]]
        n, live = seg.nrows[seqs], seg.live[seqs]
        worth = (n > 0) & (2 * live <= n) & ~np.isin(seqs, self._held_by_mark(table))
        if self.purging or not worth.any():  # (a purge takes its runs in order, from the cursor)
            return None
        share = np.where(worth, live / np.maximum(n, 1), np.inf)
        return int(seqs[int(np.argmin(share))])

    def _next_run(self, table: str, start: int) -> list[int]:
        """The numbers of the segments of the run from segment ``start`` on: the first segment
        worth compacting, and those right after it that are too, on its side of the mark,
        their rows within a quarter of the budget."""
        marks, width = self._segments.marks, self._widths[table]
        row_bytes = 8 + 4 * (width + 1)  # (its id, its words and their checksum)
        run: list[int] = []
        total = 0
        with self._lmdb.reading() as txn, txn.cursor(db=self._lmdb.pending[table]) as cur:
            if not cur.set_range(segment_key(start)):
                return run
            for key in cur.iternext(keys=True, values=False):
                seq = int.from_bytes(key, "big")
                if not self._worth(table, seq):
                    if run:
                        break
                    continue
                n = self._segments.nrows_of([seq])
                side = bisect.bisect_right(marks, seq) != bisect.bisect_right(marks, run[0]) if run else False
                if run and (side or 4 * (total + n) * row_bytes > self.budget_bytes):
                    break
                run.append(seq)
                total += n
        return run

    def needed(self, txn, table: str, run: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, rows, moved_at)``: the rows ``run`` still needs, in id order, and the
        positions among them of those the index names (whose location moves).  Only those
        rows are copied out of the segments, each checked against its checksum; the stale
        copies go unread (``tiered-emb verify`` reads every row).  Raises ``_NoGain``, before
        any row is copied, when the run needs every row it holds."""
        db = self._lmdb.pending[table]
        segs = [self._segments.records_of(table, seq, txn.get(segment_key(seq), db=db)) for seq in run]
        ids = np.concatenate([seg_ids for seg_ids, _ in segs]).astype(np.int64)
        locs = np.concatenate(
            [
                (np.int64(seq) << np.int64(POS_BITS)) + np.arange(s[0].shape[0], dtype=np.int64)
                for seq, s in zip(run, segs, strict=True)
            ]
        )
        locs_all = locs.shape[0]
        # each id's last copy in the run (segments in number order: the last is the newest)
        last = ids.shape[0] - 1 - np.unique(ids[::-1], return_index=True)[1]
        ids, locs = ids[last], locs[last]
        with self._lock:
            now = self._segments.index[table].find(ids)
        named = now == locs
        # a kept checkpoint after the run reads the run's copy unless a newer one lies before its mark
        after = [m for m in self._segments.marks if m > run[0]]
        keep = named | (bool(after) & ((now >> POS_BITS) >= (after[0] if after else 0)))
        # (a store of the format before segments may hold an older copy in t:, read below them)
        if self.purging and run[-1] < min(self._segments.marks, default=0) and not self._lmdb.records[table]:
            # (see purge: no older copy, no checkpoint needs it)
            gone = named & is_tombstone(self._take(table, run, segs, last))
            if gone.any():
                keep &= ~gone
                self._dropped.add(table)
        if keep.all() and keep.shape[0] == locs_all:
            raise _NoGain  # (before any row is copied)
        return ids[keep], self._take(table, run, segs, last[keep]), np.flatnonzero(named[keep])

    def _take(self, table: str, run: list[int], segs: list, at: np.ndarray) -> np.ndarray:
        """The rows (k, W) float32 at positions ``at`` of the run's records laid end to end
        (``segs``: each segment's ``(ids, records)``), each checked against its checksum; valid
        until the next call."""
        width = self._widths[table]
        if self._kept.shape[0] < at.shape[0] * width:  # (room for every row of the run: grown once)
            self._kept = np.empty(sum(seg_ids.shape[0] for seg_ids, _ in segs) * width, dtype=np.uint32)
        out = self._kept[: at.shape[0] * width].reshape(at.shape[0], width)
        starts = np.cumsum([0] + [seg_ids.shape[0] for seg_ids, _ in segs])
        part = np.searchsorted(starts, at, side="right") - 1
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(len(segs) + 1))
        for k, (seg_ids, records) in enumerate(segs):
            dst = order[bounds[k] : bounds[k + 1]]
            if not dst.shape[0]:
                continue
            src = at[dst] - starts[k]
            bad = take_checked(records, src, seg_ids, out, dst)
            if bad >= 0:
                raise checksum_error(self._lmdb.path, table, run[k], seg_ids, src[bad : bad + 1])
        return out.view(np.float32)
