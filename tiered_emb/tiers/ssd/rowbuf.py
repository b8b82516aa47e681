"""An id -> record map in host memory, with every operation a Numba kernel over a batch.

The SSD tier keeps two kinds of rows beside LMDB: evicted rows waiting to be written
(the write-back buffer) and rows read ahead for a coming batch (staged reads).  Both
are looked up for every id the step misses, so a Python dict (one ``get`` per id) is
too slow; here an open-addressing index (:mod:`tiered_emb.cache.index`) maps an id to its
position in rows appended to a growing array.

Each entry carries a ``state`` byte: ``FOUND`` (the row is here) or ``ABSENT`` (a staged
read found no record in LMDB: the row is the initialiser's).  Lookups report 0 for ids
not held.  Removal unlinks the id from the index and leaves its row behind until the
next growth compacts the arrays.
"""

from __future__ import annotations

import numpy as np

from tiered_emb._jit import kernel, take_rows
from tiered_emb._order import stable_argsort
from tiered_emb.cache.index import EMPTY, index_del, index_find, index_prefetch, index_put, new_index

FOUND = 1
ABSENT = 2
#: Ids this far ahead have their hash bucket fetched while the current one is looked up.
_AHEAD = 8


@kernel
def _buf_put(keys, vals, ids, rows, states, n, new_ids, new_rows, new_states):
    """Insert or overwrite each ``new_ids[i]`` (later duplicates win); returns the new row count."""
    m = new_ids.shape[0]
    for i in range(m):
        if i + _AHEAD < m:  # (a hint: the bucket of the id further on, most often a cache miss)
            index_prefetch(keys, vals, new_ids[i + _AHEAD])
        key = new_ids[i]
        at = index_find(keys, vals, key)
        if at < 0:
            at = n
            n += 1
            index_put(keys, vals, key, at)
            ids[at] = key
        for j in range(rows.shape[1]):  # (a loop: a row assignment compiles its shape error)
            rows[at, j] = new_rows[i, j]
        states[at] = new_states[i]
    return n


@kernel
def _buf_get(keys, vals, rows, states, ids, out_rows, out_state):
    """For each ``ids[i]`` with ``out_state[i] == 0`` held here: its row into ``out_rows[i]``, its state."""
    hits = 0
    m = ids.shape[0]
    for i in range(m):
        if i + _AHEAD < m and out_state[i + _AHEAD] == 0:  # (a hint, as in _buf_put)
            index_prefetch(keys, vals, ids[i + _AHEAD])
        if out_state[i] != 0:
            continue
        at = index_find(keys, vals, ids[i])
        if at >= 0:
            for j in range(rows.shape[1]):
                out_rows[i, j] = rows[at, j]
            out_state[i] = states[at]
            hits += 1
    return hits


@kernel
def _buf_remove(keys, vals, ids):
    """Unlink every held ``ids[i]``; returns how many were held."""
    gone = 0
    for i in range(ids.shape[0]):
        if index_find(keys, vals, ids[i]) >= 0:
            index_del(keys, vals, ids[i])
            gone += 1
    return gone


@kernel
def _buf_live(keys, vals, out):
    """Positions of the held entries (any order) into ``out``; returns their count."""
    m = 0
    for i in range(keys.shape[0]):
        if keys[i] != EMPTY:
            out[m] = vals[i]
            m += 1
    return m


class RowBuffer:
    """Records of a set of ids, float32 of one width, each with a state byte.

    Parameters
    ----------
    width : int, floats per record
    capacity : int, rows before the first growth (it doubles as needed)

    Examples
    --------
    >>> b = RowBuffer(2)
    >>> b.put(np.array([7, 3]), np.array([[1, 2], [3, 4]], dtype=np.float32))
    >>> rows, state = np.zeros((3, 2), dtype=np.float32), np.zeros(3, dtype=np.uint8)
    >>> b.get(np.array([3, 5, 7]), rows, state)
    2
    >>> state.tolist(), rows[0].tolist()
    ([1, 0, 1], [3.0, 4.0])
    """

    def __init__(self, width: int, capacity: int = 256):
        self.width = int(width)
        self._alloc(max(int(capacity), 8))
        self.n = 0  # rows appended (live or removed)
        self.live = 0

    def _alloc(self, capacity: int) -> None:
        self.keys, self.vals = new_index(capacity)
        self.ids = np.empty(capacity, dtype=np.int64)
        self.rows = np.empty((capacity, self.width), dtype=np.float32)
        self.states = np.empty(capacity, dtype=np.uint8)

    def __len__(self) -> int:
        return self.live

    @property
    def capacity(self) -> int:
        """Rows it holds before it grows."""
        return int(self.ids.shape[0])

    def clear(self) -> None:
        """Hold nothing, keeping the memory (a buffer used again: its pages stay mapped)."""
        self.keys.fill(EMPTY)
        self.n = 0
        self.live = 0

    def _room(self, extra: int) -> None:
        if self.n + extra <= self.ids.shape[0]:
            return
        ids, rows, states = self.items(with_state=True)
        self._alloc(max(2 * self.ids.shape[0], 2 * (ids.shape[0] + extra)))
        self.n = 0
        self.n = _buf_put(self.keys, self.vals, self.ids, self.rows, self.states, 0, ids, rows, states)

    def put(self, ids: np.ndarray, rows: np.ndarray, states: np.ndarray | None = None) -> None:
        """Hold ``rows`` (k, width) for ``ids`` (k,), replacing what was held for them."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if ids.shape[0] == 0:
            return
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        states = (
            np.full(ids.shape[0], FOUND, dtype=np.uint8)
            if states is None
            else np.ascontiguousarray(states, dtype=np.uint8)
        )
        self._room(ids.shape[0])
        before = self.n
        self.n = _buf_put(self.keys, self.vals, self.ids, self.rows, self.states, self.n, ids, rows, states)
        self.live += self.n - before

    def get(self, ids: np.ndarray, out_rows: np.ndarray, out_state: np.ndarray) -> int:
        """Fill ``out_rows[i]`` / ``out_state[i]`` for held ids whose ``out_state[i]`` is still 0; returns how many."""
        if self.live == 0 or ids.shape[0] == 0:
            return 0
        return int(_buf_get(self.keys, self.vals, self.rows, self.states, ids, out_rows, out_state))

    def remove(self, ids: np.ndarray) -> int:
        """Forget ``ids`` (those held); returns how many were held."""
        if self.live == 0 or ids.shape[0] == 0:
            return 0
        gone = int(_buf_remove(self.keys, self.vals, np.ascontiguousarray(ids, dtype=np.int64)))
        self.live -= gone
        return gone

    def items(self, with_state: bool = False):
        """``(ids, rows)`` held, in id order (and their states with ``with_state``)."""
        at = np.empty(self.live, dtype=np.int64)
        m = _buf_live(self.keys, self.vals, at)
        at = at[:m]
        at = at[stable_argsort(self.ids[at])]
        out = (self.ids[at], take_rows(self.rows, at))  # (on the threads, the GIL let go: a writer thread's)
        return out + (self.states[at],) if with_state else out


class SortedRows:
    """Records of distinct ids in increasing order, as given (a bulk write waiting for its
    transaction): the read side of :class:`RowBuffer` (``get``, ``items``, ``len``) by a
    binary search, with no index to build."""

    def __init__(self, ids: np.ndarray, rows: np.ndarray):
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)
        self.rows = np.ascontiguousarray(rows, dtype=np.float32)
        self.width = self.rows.shape[1]

    def __len__(self) -> int:
        return self.ids.shape[0]

    def get(self, ids: np.ndarray, out_rows: np.ndarray, out_state: np.ndarray) -> int:
        """Fill ``out_rows[i]`` / ``out_state[i]`` for held ids whose ``out_state[i]`` is still 0; returns how many."""
        if self.ids.shape[0] == 0 or ids.shape[0] == 0:
            return 0
        at = np.minimum(np.searchsorted(self.ids, ids), self.ids.shape[0] - 1)
        hit = np.flatnonzero((self.ids[at] == ids) & (out_state == 0))
        out_rows[hit] = self.rows[at[hit]]
        out_state[hit] = FOUND
        return int(hit.shape[0])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids, self.rows
