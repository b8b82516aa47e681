"""Rows the SSD tier holds in memory beside LMDB: write-backs waiting, and staged reads.

Write-backs of evicted rows wait in a buffer per table (the newest copy of those rows)
and go to ``p:`` in one transaction once enough are waiting: one commit per many steps
instead of one per table per step.  A full buffer becomes a *snapshot* that stays
readable until its transaction commits (on the writer thread with background writes).

Rows read ahead for coming batches are *staged* (key -> table -> rows), each equal to
LMDB's record (or its absence) for as long as it is held: every LMDB write drops the
staged copies of the rows it writes, and :attr:`HeldRows.gen` counts LMDB writes so that
a read that overlapped one is dropped.

Every method but :meth:`HeldRows.unstage` runs under the tier's lock (the caller takes
it), which also guards the segment index and the written bits: one short section can
then move rows from a snapshot to ``p:`` atomically for readers.
"""

from __future__ import annotations

import threading

import numpy as np

from tiered_emb.tiers.ssd.rowbuf import RowBuffer


class HeldRows:
    """The write-back buffer (:attr:`writeback`, table -> :class:`RowBuffer`), the snapshots
    being written (:attr:`flushing`, oldest first) and the staged reads (:attr:`staged`,
    key -> table -> :class:`RowBuffer`), for tables of ``widths`` (name -> record width)."""

    def __init__(self, widths: dict[str, int], lock: threading.Lock):
        self._widths = dict(widths)
        self._lock = lock
        self.writeback: dict[str, RowBuffer] = {n: RowBuffer(w) for n, w in sorted(self._widths.items())}
        self.flushing: list[dict[str, RowBuffer]] = []
        self._buffered = 0  # rows in :attr:`writeback`, all tables
        # a committed snapshot's buffer per table, the next buffer of that table: its memory
        # is in use already (a put into fresh memory cost several times one into memory in
        # use: docs/architecture.md)
        self._spare: dict[str, RowBuffer] = {}
        self.staged: dict[int, dict[str, RowBuffer]] = {}
        self.gen = 0
        self.staging = {"reads": 0, "rows": 0, "used": 0, "discarded": 0}

    def put(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add write-backs (``rows`` (k, W) float32 under ``ids`` int64 (k,)) of ``table``."""
        buf = self.writeback[table]
        before = len(buf)
        buf.put(ids, rows)
        self._buffered += len(buf) - before

    def buffered_rows(self) -> int:
        """Rows waiting in the buffer (not the snapshots), all tables."""
        return self._buffered

    def get(self, table: str, ids: np.ndarray, out_rows: np.ndarray, state: np.ndarray) -> None:
        """Rows of ``ids`` held here into ``out_rows``, ``state`` set where found: the buffer,
        then the snapshots newest first, then the staged reads (each in order of key)."""
        self.writeback[table].get(ids, out_rows, state)
        for snap in reversed(self.flushing):
            if table in snap:
                snap[table].get(ids, out_rows, state)
        for key in sorted(self.staged):
            staged = self.staged[key].get(table)
            if staged is not None:
                self.staging["used"] += staged.get(ids, out_rows, state)

    def waiting(self) -> list[dict[str, RowBuffer]]:
        """Every write-back not yet in LMDB, oldest first; the buffer starts afresh."""
        snaps = self.flushing + [self.writeback]
        self.flushing = snaps
        self.writeback = {n: self._next_buffer(n, w, snaps[-1][n]) for n, w in sorted(self._widths.items())}
        self._buffered = 0
        return snaps

    def _next_buffer(self, table: str, width: int, last: RowBuffer) -> RowBuffer:
        """The buffer of ``table`` after ``last``: sized as ``last`` grew to (growing re-inserts
        every row, and sorts them, at each doubling; a buffer sized to the rows it last held
        grew once more each time, as the put that crosses the write-back threshold comes on
        top of them), at most twice the rows it held, so that one large put does not size
        every buffer after it.  The spare, emptied, where it is large enough and at most
        four times that."""
        want = max(len(last), min(last.capacity, 2 * len(last)))
        spare = self._spare.pop(table, None)
        if spare is not None and want <= spare.capacity <= 4 * max(want, 256):
            spare.clear()
            return spare
        return RowBuffer(width, want)

    def waiting_with(self, table: str, rows) -> list[dict]:
        """:meth:`waiting`, with ``rows`` (a :class:`.rowbuf.SortedRows` of ``table``) after
        every other write-back: the newest."""
        self.waiting()
        self.flushing.append({table: rows})
        return list(self.flushing)

    def committed(self, snaps: list[dict[str, RowBuffer]] | None = None) -> None:
        """``snaps`` (None: every snapshot) are in LMDB: they leave the read path, and their
        buffers are kept as the spares of their tables (one a table, the newest)."""
        done = self.flushing if snaps is None else [s for s in self.flushing if any(s is x for x in snaps)]
        self.flushing = [] if snaps is None else [s for s in self.flushing if not any(s is x for x in snaps)]
        for snap in done:
            for name, buf in snap.items():
                if isinstance(buf, RowBuffer):
                    self._spare[name] = buf

    def waiting_rows(self, table: str) -> int:
        """Rows of ``table`` waiting in memory for the next write."""
        return len(self.writeback[table]) + sum(len(s[table]) for s in self.flushing if table in s)

    def written(self, table_ids: list[tuple[str, np.ndarray]] | None) -> None:
        """Bookkeeping after an LMDB write of ``(table, ids)`` pieces (None: of every row):
        staged copies of the rows written are stale."""
        self.gen += 1
        if table_ids is None:
            self.staged.clear()
            return
        for staged in self.staged.values():
            for t, ids in table_ids:
                if t in staged:
                    staged[t].remove(ids)

    def keep_staged(self, key: int, staged: dict[str, RowBuffer], gen: int) -> bool:
        """Hold ``staged`` under ``key`` unless an LMDB write came since ``gen`` (then False)."""
        self.staging["reads"] += 1
        if gen != self.gen:
            self.staging["discarded"] += 1
            return False
        self.staged[key] = staged
        self.staging["rows"] += sum(len(b) for b in staged.values())
        return True

    def staging_dropped(self) -> None:
        """Count a staged read given up (its segments were dropped meanwhile)."""
        self.staging["reads"] += 1
        self.staging["discarded"] += 1

    def unstage(self, key: int) -> None:
        """Drop the rows staged under ``key``."""
        with self._lock:
            self.staged.pop(key, None)
