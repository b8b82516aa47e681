"""Compaction of ``p:``: a table's segments rewritten as few segments of its live rows.

``p:`` keeps every copy written since the checkpoint, stale ones too: rows written back
again and again would grow the file until the next checkpoint.  Before a write-back, a
table whose segments hold far more rows than it has live is rewritten, in one write
transaction that also drops the old segments.
"""

from __future__ import annotations

import threading

import numpy as np

from tiered_emb.tiers.ssd.codec import put_segment
from tiered_emb.tiers.ssd.held import HeldRows
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv
from tiered_emb.tiers.ssd.segments import SegmentGone, SegmentLog


class Compactor:
    """Finds the tables of ``segments`` due for compaction and rewrites them."""

    #: ``p:<table>`` is compacted when its segments hold more than this many times the rows
    #: it has live (and at least :attr:`COMPACT_MIN_ROWS`): the stale copies of rows written
    #: back again since the checkpoint, which would otherwise grow the file until the next one.
    COMPACT_RATIO = 4
    COMPACT_MIN_ROWS = 1 << 20

    def __init__(
        self,
        lmdb_env: LmdbEnv,
        widths: dict[str, int],
        held: HeldRows,
        segments: SegmentLog,
        lock: threading.Lock,
        compressor,
    ):
        self._lmdb = lmdb_env
        self._widths = dict(widths)
        self._held = held
        self._segments = segments
        self._lock = lock
        self._zc = compressor

    def due(self) -> list[str]:
        """The tables whose stale copies passed the bound, in name order."""
        stored, index = self._segments.stored_rows, self._segments.index
        return [
            t
            for t in sorted(self._widths)
            if stored[t] >= self.COMPACT_MIN_ROWS and stored[t] > self.COMPACT_RATIO * len(index[t])
        ]

    def compact(self, tables: list[str]) -> None:
        """Rewrite ``p:`` of each of ``tables`` as one segment of its live rows, in one transaction.

        With no write in flight, and under the store's lock (every read of ``p:`` holds it,
        but a staged one, which finds its segments gone and is discarded).  A failure rolls
        back and leaves ``p:`` as it was.
        """
        with self._lock:
            live = {t: self._segments.index[t].items() for t in tables}
        plan = {t: self._segments.numbered(t, *live[t]) for t in tables}  # numbers taken whether or not it commits

        def fn(txn):
            for t in tables:
                ids, locs = live[t]
                rows = np.empty((ids.shape[0], self._widths[t]), dtype=np.float32)
                try:
                    self._segments.read(txn, t, locs, rows, np.arange(ids.shape[0]))
                except SegmentGone as gone:
                    raise self._segments.gone(t, gone) from None
                txn.drop(self._lmdb.pending[t], delete=False)
                step = self._segments.rows_per_segment(t)
                for k, (_, seq, seg_ids, _) in enumerate(plan[t]):
                    put_segment(txn, self._lmdb.pending[t], seq, seg_ids, rows[k * step : (k + 1) * step], self._zc)

        self._lmdb.write(fn)
        with self._lock:
            for t in tables:
                self._segments.replaced(t, plan[t], live[t][0].shape[0])
            self._held.written(None)
