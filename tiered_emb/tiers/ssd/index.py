"""Where each row written since the last checkpoint lies: id -> (segment, position).

The SSD tier writes evicted rows into ``p:<table>`` as segments (many rows in one LMDB
value: one append instead of a B-tree insert per row) and finds a row through this
index, kept in memory: an open-addressing hash table of :mod:`tiered_emb.cache.index`'s
layout with int64 values, ``segment << POS_BITS | position``.  A newer segment's entry
replaces an older one's.  Entries are only added, until :meth:`SegmentIndex.clear` (the
checkpoint folds the segments into ``t:`` and drops them); the table doubles at half full.
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb.cache.index import EMPTY, hash_home, index_find_many, table_size_for

#: Positions within a segment take 20 bits (a segment holds at most 2**20 rows), numbers the
#: other 43 (:data:`MAX_SEGMENTS`: at 1,000 segments a second, 278 years).
POS_BITS = 20
POS_MASK = (1 << POS_BITS) - 1
MAX_SEGMENT_ROWS = 1 << POS_BITS
MAX_SEGMENTS = 1 << (63 - POS_BITS)


@numba.njit(cache=True, nogil=True)
def _loc_set(keys, vals, ids, locs):
    """``ids[i] -> locs[i]`` for each i in order, replacing a held entry; returns the entries added."""
    mask = keys.shape[0] - 1
    added = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        j = hash_home(key, mask)
        while True:
            k = keys[j]
            if k == key:
                break
            if k == EMPTY:
                keys[j] = key
                added += 1
                break
            j = (j + 1) & mask
        vals[j] = locs[i]
    return added


@numba.njit(cache=True, nogil=True)
def _loc_items(keys, vals, out_ids, out_locs):
    m = 0
    for j in range(keys.shape[0]):
        if keys[j] != EMPTY:
            out_ids[m] = keys[j]
            out_locs[m] = vals[j]
            m += 1
    return m


class SegmentIndex:
    """id (int64 >= 0) -> int64 location, with batch operations.

    Examples
    --------
    >>> ix = SegmentIndex()
    >>> ix.add(3, np.array([7, 2]))
    >>> ix.add(4, np.array([2]))
    >>> [divmod(int(x), 1 << POS_BITS) if x >= 0 else -1 for x in ix.find(np.array([2, 5, 7]))]
    [(4, 0), -1, (3, 0)]
    """

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.keys = np.full(8, EMPTY, dtype=np.int64)
        self.vals = np.zeros(8, dtype=np.int64)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, seq: int, ids: np.ndarray) -> None:
        """Segment ``seq`` holds ``ids`` (distinct), row ``i`` at position ``i``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not 0 <= seq < MAX_SEGMENTS or ids.shape[0] > MAX_SEGMENT_ROWS:
            raise ValueError(f"segment {seq} of {ids.shape[0]} rows is out of the index's range")
        self.set(ids, (np.int64(seq) << np.int64(POS_BITS)) + np.arange(ids.shape[0], dtype=np.int64))

    def set(self, ids: np.ndarray, locs: np.ndarray) -> None:
        """``ids[i]`` (distinct) lies at ``locs[i]`` now."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if 2 * (self.n + ids.shape[0]) > self.keys.shape[0]:
            old_ids, old_locs = self.items()
            self.keys = np.full(table_size_for(self.n + ids.shape[0]), EMPTY, dtype=np.int64)
            self.vals = np.zeros(self.keys.shape[0], dtype=np.int64)
            _loc_set(self.keys, self.vals, old_ids, old_locs)
        self.n += int(_loc_set(self.keys, self.vals, ids, np.ascontiguousarray(locs, dtype=np.int64)))

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The location of each of ``ids`` (int64), -1 where none."""
        out = np.empty(ids.shape[0], dtype=np.int64)
        if self.n == 0:
            out[:] = -1
        else:
            index_find_many(self.keys, self.vals, np.ascontiguousarray(ids, dtype=np.int64), out)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, locations)`` held, in id order."""
        ids = np.empty(self.n, dtype=np.int64)
        locs = np.empty(self.n, dtype=np.int64)
        _loc_items(self.keys, self.vals, ids, locs)
        order = np.argsort(ids, kind="stable")
        return ids[order], locs[order]
