"""Admission: a table's rows admitted after ``min_count`` sightings (``TableConfig.min_count``).

A production table sees new ids every minute, most a few times and never again; training
a row for each one fills the tiers and the disk with rows nothing reads again.  With
``min_count > 1`` an id's gradients are dropped until an update sees it for the
``min_count``-th time (a *sighting* is an update that holds the id, each update counting
an id once: an id in one batch is one sighting, however many bags hold it); from that
update on they apply as usual.  An id not admitted is never updated, so it reads as its
initial value, is never dirty, and nothing of it reaches LMDB.  Dropping, rather than
holding the gradients until admission, keeps memory bounded by configuration: held
gradients would grow with the ids seen.  A ``write`` sets a row whatever its count.

The counts: one byte per id for a bounded table whose ``num_rows`` fit in
``admission_bytes`` (exact), else a count-min sketch of ``admission_bytes`` bytes, 4
rows of byte counters under 4 seeded hashes of the id, with conservative update (only
the smallest counters grow).  A sketch never counts an id lower than it was seen, so an
id is never admitted late; collisions may admit one early, at a rate
``bench/bench_lifecycle.py`` measures (docs/tuning.md).  Counts saturate at ``min_count``.
Every count changes in the order the updates run, each update's ids in their order: the
result depends on the batches only (not on tiers, threads or prefetch).  The counts are
saved with each checkpoint, in its transaction (:mod:`tiered_emb.tiers.ssd.snapshots`),
and an open restores those of the checkpoint it opens at.
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._jit import kernel
from tiered_emb.config import TableConfig
from tiered_emb.errors import CorruptStoreError

#: Rows of a sketch, each under its own hash of the id.
SKETCH_ROWS = 4
_SEEDS = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93], dtype=np.uint64)


@kernel
def _mix(x):
    """splitmix64's finaliser: a bijection of 64 bits whose every output bit depends on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@kernel
def _sight_exact(counts, uids, need, out):
    for k in range(uids.shape[0]):
        c = counts[uids[k]]
        if c < need:
            c += 1
            counts[uids[k]] = c
        out[k] = c >= need


@numba.njit(cache=True, nogil=True)
def _sight_sketch(table, seeds, uids, need, out):
    rows, width = table.shape
    at = np.empty(rows, dtype=np.int64)
    for k in range(uids.shape[0]):
        x = np.uint64(uids[k])
        low = 255
        for r in range(rows):
            at[r] = np.int64(_mix(x ^ seeds[r]) % np.uint64(width))
            low = min(low, table[r, at[r]])
        if low < need:
            low += 1
            for r in range(rows):  # conservative update: only the counters below the new estimate
                if table[r, at[r]] < low:
                    table[r, at[r]] = low
        out[k] = low >= need


class Admission:
    """The admission counts of one table (``cfg.min_count > 1``)."""

    def __init__(self, cfg: TableConfig):
        self.need = cfg.min_count
        self.exact = cfg.num_rows is not None and cfg.num_rows <= cfg.admission_bytes
        if self.exact:
            self.counts = np.zeros(cfg.num_rows, dtype=np.uint8)
        else:
            self.counts = np.zeros((SKETCH_ROWS, cfg.admission_bytes // SKETCH_ROWS), dtype=np.uint8)

    def sight(self, uids: np.ndarray) -> np.ndarray:
        """Count one sighting of each of ``uids`` (distinct, in order); which are admitted now, bool (k,)."""
        out = np.empty(uids.shape[0], dtype=np.bool_)
        ids = np.ascontiguousarray(uids, dtype=np.int64)
        if self.exact:
            _sight_exact(self.counts, ids, self.need, out)
        else:
            _sight_sketch(self.counts, _SEEDS, ids, self.need, out)
        return out

    def to_bytes(self) -> bytes:
        return self.counts.tobytes()

    def load(self, data: bytes, what: str) -> None:
        """Take the counts :meth:`to_bytes` gave (CorruptStoreError if their size is not this table's)."""
        if len(data) != self.counts.nbytes:
            raise CorruptStoreError(
                f"the admission counts of {what} hold {len(data)} bytes, not {self.counts.nbytes}",
                "open with the table's min_count and admission_bytes of when it was saved, or restore a backup",
            )
        self.counts = np.frombuffer(data, dtype=np.uint8).reshape(self.counts.shape).copy()


def admission_of(cfg: TableConfig) -> Admission | None:
    """The counts of ``cfg``'s table, or None when every id is admitted at once (``min_count`` 1)."""
    return Admission(cfg) if cfg.min_count > 1 else None


__all__ = ["SKETCH_ROWS", "Admission", "admission_of"]
