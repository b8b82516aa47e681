"""Where each stored row lies: id -> (segment, position), in 12-16 bytes a row.

The SSD tier keeps rows in segments (many rows in one LMDB value) and finds a row's
newest copy through this index, kept in memory.  Its bulk is two sorted arrays, ids and
their locations (``segment << POS_BITS | position``, int64): 12 bytes a row where the
table has at most 2**32 rows (ids kept as uint32), else 16.  A directory of buckets (one
for about every 16 rows: half a byte a row) gives the run of positions that an id's top
bits lead to, so a lookup is a few cache misses whatever the index's size, and a batch
fetches the entries of ids further on while it searches.  Ids not yet in the arrays go
to a small open-addressing hash (:mod:`tiered_emb.cache.index`'s layout, int64 values),
merged into the arrays when it holds ``delta_rows`` or 1/64 of the arrays' rows: in
place, from the back, after the arrays grow by ``ndarray.resize`` (``realloc``, which
moves the pages of a large array without copying them), so a merge never holds a second
copy of the index; the directory is built again at the next lookup.  Ids appended above
every one held are searched as one run past the directory until they are 1/16 of the
rows.  An id already in the arrays is changed there.  A store that opens stages its
segments instead (:meth:`SegmentIndex.stage`): up to 1/16 of the rows are sorted together
(a stable sort of sorted runs) and merged in at once.  Entries are only added or moved,
until :meth:`SegmentIndex.clear`.
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._jit import prefetch_hint, split_parts
from tiered_emb._order import stable_argsort
from tiered_emb.cache.index import EMPTY, hash_home, index_find, table_size_for

#: Positions within a segment take 20 bits (a segment holds at most 2**20 rows), numbers the
#: other 43 (:data:`MAX_SEGMENTS`: at 1,000 segments a second, 278 years).
POS_BITS = 20
POS_MASK = (1 << POS_BITS) - 1
MAX_SEGMENT_ROWS = 1 << POS_BITS
MAX_SEGMENTS = 1 << (63 - POS_BITS)


#: A query this many ids ahead has its directory entry, and its bucket of ids, fetched
#: while the current one is searched: each is a cache miss on a large index.
_AHEAD = 8


@numba.njit(cache=True, nogil=True)
def _loc_set(keys, vals, ids, locs, old):
    """``ids[i] -> locs[i]`` for each i in order, replacing a held entry (its location into
    ``old[i]``, else -1); returns the entries added."""
    mask = keys.shape[0] - 1
    added = 0
    m = ids.shape[0]
    for i in range(m):
        if i + _AHEAD < m:  # (a hint: the bucket of the id further on, a cache miss on a large hash)
            home = hash_home(ids[i + _AHEAD], mask)
            prefetch_hint(keys, home)
            prefetch_hint(vals, home)
        key = ids[i]
        j = hash_home(key, mask)
        old[i] = -1
        while True:
            k = keys[j]
            if k == key:
                old[i] = vals[j]
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


# a batch of finds is cut into slices of at least this many ids for Numba's threads: about
# 0.2 ms of work each, well above the cost of waking the pool
FIND_SPLIT_FROM = 4096


@numba.njit(cache=True, nogil=True)
def _build_dir(arr_ids, n, shift, dir_):
    """``dir_[b]`` = the first position whose id ``>> shift`` is at least ``b`` (``n`` past
    the last), for every ``b`` below ``len(dir_)``."""
    b = 0
    nb = dir_.shape[0]
    for i in range(n):
        hb = np.int64(arr_ids[i]) >> shift
        while b <= hb and b < nb:
            dir_[b] = i
            b += 1
    while b < nb:
        dir_[b] = n
        b += 1


@numba.njit(inline="always")
def _range(dir_, shift, covered, n, q):
    """``(lo, hi)``: the positions where ``q`` may lie, by its bucket: the bucket's own
    positions, the last bucket's run on into the rows added since the directory was built
    (all above those it covers), past the last bucket only those rows."""
    nb = dir_.shape[0] - 1
    b = q >> shift
    if b >= nb:
        return covered, n
    if b == nb - 1:
        return dir_[b], n
    return dir_[b], dir_[b + 1]


@numba.njit(inline="always")
def _search(arr_ids, lo, hi, q):
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(arr_ids[mid]) < q:
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(cache=True, nogil=True)
def _positions(arr_ids, n, dir_, shift, covered, ids, at):
    """``at[i]`` = the position of ``ids[i]`` in ``arr_ids[:n]``, -1 where absent; returns
    how many are absent.  Queries ``_AHEAD`` on have their directory entry and bucket
    fetched early (hints: nothing depends on them)."""
    absent = 0
    m = ids.shape[0]
    nb = dir_.shape[0] - 1
    for i in range(m):
        if i + 2 * _AHEAD < m:
            b = ids[i + 2 * _AHEAD] >> shift
            if 0 <= b < nb:
                prefetch_hint(dir_, b)
        if i + _AHEAD < m and ids[i + _AHEAD] >= 0:
            lo, hi = _range(dir_, shift, covered, n, ids[i + _AHEAD])
            if lo < hi:
                prefetch_hint(arr_ids, (lo + hi) >> 1)
        q = ids[i]
        if q < 0:
            at[i] = -1
            absent += 1
            continue
        lo, hi = _range(dir_, shift, covered, n, q)
        p = _search(arr_ids, lo, hi, q)
        if p < n and np.int64(arr_ids[p]) == q:
            at[i] = p
        else:
            at[i] = -1
            absent += 1
    return absent


@numba.njit(cache=True, nogil=True)
def _find(arr_ids, arr_locs, n, dir_, shift, covered, keys, vals, has_delta, ids, out):
    """Location of each of ``ids`` (-1 where none): the sorted arrays, then the hash.  The
    location or hash bucket ``_AHEAD`` on is fetched early (a hint, as in :func:`_positions`)."""
    _positions(arr_ids, n, dir_, shift, covered, ids, out)
    m = ids.shape[0]
    mask = keys.shape[0] - 1
    for i in range(m):
        if i + _AHEAD < m:
            if out[i + _AHEAD] >= 0:
                prefetch_hint(arr_locs, out[i + _AHEAD])
            elif has_delta and ids[i + _AHEAD] >= 0:
                home = hash_home(ids[i + _AHEAD], mask)
                prefetch_hint(keys, home)
                prefetch_hint(vals, home)
        if out[i] >= 0:
            out[i] = arr_locs[out[i]]
        elif has_delta:
            out[i] = index_find(keys, vals, ids[i])


@numba.njit(parallel=True, cache=True, nogil=True)
def _find_split(arr_ids, arr_locs, n, dir_, shift, covered, keys, vals, has_delta, ids, out, parts):
    """:func:`_find` over ``parts`` consecutive slices of ``ids`` at once, on Numba's threads
    (the index is only read; each slice writes its own part of ``out``)."""
    m = ids.shape[0]
    for c in numba.prange(parts):
        lo = m * c // parts
        hi = m * (c + 1) // parts
        _find(arr_ids, arr_locs, n, dir_, shift, covered, keys, vals, has_delta, ids[lo:hi], out[lo:hi])


@numba.njit(cache=True, nogil=True)
def _set_at(arr_locs, at, locs, missing, old):
    """``arr_locs[at[i]] = locs[i]`` where ``at[i]`` is a position (the location it had into
    ``old[i]``); ``missing[i]`` = the others.  Returns how many are missing."""
    absent = 0
    for i in range(at.shape[0]):
        missing[i] = at[i] < 0
        if at[i] >= 0:
            old[i] = arr_locs[at[i]]
            arr_locs[at[i]] = locs[i]
        else:
            absent += 1
    return absent


@numba.njit(cache=True, nogil=True)
def _set_sorted(arr_ids, arr_locs, n, dir_, shift, covered, ids, locs, missing, old):
    """Change the location of each of ``ids`` held in the arrays (the one it had into
    ``old[i]``); ``missing[i]`` = the others.  Returns how many are missing."""
    at = np.empty(ids.shape[0], dtype=np.int64)
    _positions(arr_ids, n, dir_, shift, covered, ids, at)
    return _set_at(arr_locs, at, locs, missing, old)


@numba.njit(cache=True, nogil=True)
def _merge_back(arr_ids, arr_locs, n, new_ids, new_locs):
    """Merge ``new_ids`` (sorted, none in ``arr_ids[:n]``) into the arrays, whose length is
    ``n + len(new_ids)``, from the back, in place."""
    i = n - 1
    j = new_ids.shape[0] - 1
    w = n + new_ids.shape[0] - 1
    while j >= 0:
        if i >= 0 and arr_ids[i] > new_ids[j]:
            arr_ids[w] = arr_ids[i]
            arr_locs[w] = arr_locs[i]
            i -= 1
        else:
            arr_ids[w] = new_ids[j]
            arr_locs[w] = new_locs[j]
            j -= 1
        w -= 1


class SegmentIndex:
    """id (int64 >= 0) -> int64 location, with batch operations.

    ``num_rows``: ids are below it (None: any int64 >= 0); at most 2**32, the arrays keep
    ids as uint32 (12 bytes a row instead of 16).

    Examples
    --------
    >>> ix = SegmentIndex()
    >>> ix.add(3, np.array([7, 2])).tolist()  # where each id was before: nowhere
    [-1, -1]
    >>> [divmod(int(x), 1 << POS_BITS) for x in ix.add(4, np.array([2]))]  # segment 3, position 1
    [(3, 1)]
    >>> [divmod(int(x), 1 << POS_BITS) if x >= 0 else -1 for x in ix.find(np.array([2, 5, 7]))]
    [(4, 0), -1, (3, 0)]
    """

    #: The directory has a bucket for about every this many rows (8 bytes each).
    BUCKET_ROWS = 16
    #: Rows searched as one run before a directory is worth building.
    DIR_MIN_ROWS = 256

    def __init__(self, delta_rows: int = 1 << 16, num_rows: int | None = None):
        self.delta_rows = max(1, int(delta_rows))
        self.num_rows = num_rows
        self.id_dtype = np.dtype(np.uint32 if num_rows is not None and num_rows <= 1 << 32 else np.int64)
        self.stamp = 0  # counts what moves rows of the arrays: merges, staged loads, clears
        self.clear()

    def clear(self) -> None:
        self.stamp += 1  # (positions found before are stale)
        self.ids = np.empty(0, dtype=self.id_dtype)  # sorted; the arrays own their memory (resized in place)
        self.locs = np.empty(0, dtype=np.int64)
        self._empty_delta()
        self.n_delta = 0
        self._staged: list[tuple[int, np.ndarray]] = []
        self._n_staged = 0
        self._drop_dir()

    def _drop_dir(self) -> None:
        self._dir = np.zeros(1, dtype=np.int64)  # no bucket: every search is over the rows past ``_covered``
        self._shift = 0
        self._covered = 0

    def _fresh_dir(self) -> tuple[np.ndarray, int, int]:
        """The directory, built again once the rows added since it was built are 1/16 of all
        (they are searched as one run meanwhile: rows are only appended after it, or it is
        dropped)."""
        n = self.ids.shape[0]
        if n - self._covered > max(self.DIR_MIN_ROWS, n // 16):
            target = max(1, n // self.BUCKET_ROWS)
            self._shift = max(0, int(self.ids[n - 1]).bit_length() - (target.bit_length() - 1))
            self._dir = np.empty((int(self.ids[n - 1]) >> self._shift) + 2, dtype=np.int64)
            _build_dir(self.ids, n, self._shift, self._dir)
            self._covered = n
        return self._dir, self._shift, self._covered

    def __len__(self) -> int:
        return self.ids.shape[0] + self.n_delta

    @property
    def covered(self) -> int:
        """Rows of the arrays the directory's buckets cover (those after: searched as one run)."""
        return self._covered

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + self.locs.nbytes + self.keys.nbytes + self.vals.nbytes + self._dir.nbytes

    def view(self) -> tuple:
        """What :meth:`positions` searches: taken under the tier's lock (the directory may be
        built again here), searched after it is let go."""
        return (self.stamp, self.ids.shape[0]), (self.ids, self.ids.shape[0], *self._fresh_dir())

    @staticmethod
    def positions(view: tuple, ids: np.ndarray) -> tuple:
        """Where each of ``ids`` (int64) lies in the arrays of ``view`` (:meth:`view`), -1 where
        absent: the search of :meth:`add`, done by the one writer without the tier's lock
        (readers only read the arrays; a merge or an append between makes it stale, and
        :meth:`add` then searches again)."""
        stamp, args = view
        at = np.empty(ids.shape[0], dtype=np.int64)
        _positions(*args, np.ascontiguousarray(ids, dtype=np.int64), at)
        return stamp, at

    def add(self, seq: int, ids: np.ndarray, found: tuple | None = None) -> np.ndarray:
        """Segment ``seq`` holds ``ids`` (distinct), row ``i`` at position ``i``; returns the
        location each had before (-1: none).  ``found``: :meth:`positions` of ``ids``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not 0 <= seq < MAX_SEGMENTS or ids.shape[0] > MAX_SEGMENT_ROWS:
            raise ValueError(f"segment {seq} of {ids.shape[0]} rows is out of the index's range")
        return self.set(ids, (np.int64(seq) << np.int64(POS_BITS)) + np.arange(ids.shape[0], dtype=np.int64), found)

    def set(self, ids: np.ndarray, locs: np.ndarray, found: tuple | None = None) -> np.ndarray:
        """``ids[i]`` (distinct) lies at ``locs[i]`` now; returns the location each had before
        (-1: none).  ``found``: :meth:`positions` of ``ids``, used unless stale."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        locs = np.ascontiguousarray(locs, dtype=np.int64)
        old = np.full(ids.shape[0], -1, dtype=np.int64)
        if ids.shape[0] == 0:
            return old
        if ids.min() < 0 or (self.num_rows is not None and ids.max() >= self.num_rows):
            raise ValueError(f"ids outside [0, {self.num_rows}) cannot be indexed")
        n = self.ids.shape[0]
        new_at = None
        if not (n and ids.min() > self.ids[n - 1]):  # (ids above every one held are in none)
            missing = np.empty(ids.shape[0], dtype=np.bool_)
            if found is not None and found[0] == (self.stamp, n):
                absent = _set_at(self.locs, found[1], locs, missing, old)
            else:
                absent = _set_sorted(self.ids, self.locs, n, *self._fresh_dir(), ids, locs, missing, old)
            if absent == 0:
                return old
            new_at = np.flatnonzero(missing)
            ids, locs = ids[new_at], locs[new_at]
        if self.n_delta == 0 and (n == 0 or ids[0] > self.ids[n - 1]) and (ids[1:] > ids[:-1]).all():
            self.ids.resize(n + ids.shape[0], refcheck=False)  # (above every id held, in order: appended)
            self.locs.resize(n + ids.shape[0], refcheck=False)
            self.ids[n:] = ids
            self.locs[n:] = locs
            return old
        if 2 * (self.n_delta + ids.shape[0]) > self.keys.shape[0]:
            # doubling while small; past an eighth of what it holds at the next merge, that size
            # at once: each growth inserts every entry again, with the tier's lock held
            need = self.n_delta + ids.shape[0]
            due = max(self.delta_rows, self.ids.shape[0] // 64) + ids.shape[0]
            old_ids, old_locs = self._delta_items(ordered=False)
            self.keys = np.full(table_size_for(need if 8 * need < due else max(need, due)), EMPTY, dtype=np.int64)
            self.vals = np.zeros(self.keys.shape[0], dtype=np.int64)
            _loc_set(self.keys, self.vals, old_ids, old_locs, np.empty(old_ids.shape[0], dtype=np.int64))
        in_delta = np.empty(ids.shape[0], dtype=np.int64)
        self.n_delta += int(_loc_set(self.keys, self.vals, ids, locs, in_delta))
        if new_at is None:
            old = in_delta
        else:
            old[new_at] = in_delta
        # a merge moves every row: merging at a fixed share of the rows keeps its cost per id
        # added constant as the index grows (the hash then holds up to 1/64 of them: 1 byte a row)
        if self.n_delta >= max(self.delta_rows, self.ids.shape[0] // 64):
            self.merge()
        return old

    def stage(self, seq: int, ids: np.ndarray) -> np.ndarray | None:
        """While a store opens: segment ``seq`` holds ``ids`` (distinct, increasing), row ``i`` at
        position ``i``, and is newer than every segment staged or added before.  The index
        takes the staged segments in at once (:meth:`unstage`) when they hold ``delta_rows``
        or 1/16 of the arrays' rows, and then returns the location each id it replaced had
        (else None); the caller unstages at the end.  No lookup may come between."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not 0 <= seq < MAX_SEGMENTS or ids.shape[0] > MAX_SEGMENT_ROWS:
            raise ValueError(f"segment {seq} of {ids.shape[0]} rows is out of the index's range")
        if ids.shape[0] and (ids.min() < 0 or (self.num_rows is not None and ids.max() >= self.num_rows)):
            raise ValueError(f"ids outside [0, {self.num_rows}) cannot be indexed")
        self._staged.append((seq, ids))
        self._n_staged += ids.shape[0]
        if self._n_staged >= max(self.delta_rows, self.ids.shape[0] // 16):
            return self.unstage()
        return None

    def unstage(self) -> np.ndarray:
        """Take the staged segments in: sorted together (a stable sort of sorted runs), the
        newest copy of each id kept, those held changed in place, the rest merged into the
        arrays from the back.  Returns the locations replaced (copies staged before a newer
        one, and those the arrays held)."""
        self.merge()
        if not self._staged:
            return np.empty(0, dtype=np.int64)
        ids = np.concatenate([x for _, x in self._staged])
        locs = np.concatenate(
            [(np.int64(q) << np.int64(POS_BITS)) + np.arange(x.shape[0], dtype=np.int64) for q, x in self._staged]
        )
        self._staged, self._n_staged = [], 0
        order = stable_argsort(ids)  # (segments oldest first: equal ids stay in that order)
        ids, locs = ids[order], locs[order]
        del order
        last = np.ones(ids.shape[0], dtype=np.bool_)
        last[:-1] = ids[1:] != ids[:-1]
        replaced = [locs[~last]]
        ids, locs = ids[last], locs[last]
        n = self.ids.shape[0]
        old = np.full(ids.shape[0], -1, dtype=np.int64)
        missing = np.empty(ids.shape[0], dtype=np.bool_)
        if n and _set_sorted(self.ids, self.locs, n, *self._fresh_dir(), ids, locs, missing, old) < ids.shape[0]:
            replaced.append(old[~missing])
            ids, locs = ids[missing], locs[missing]
        if ids.shape[0]:
            self.ids.resize(n + ids.shape[0], refcheck=False)
            self.locs.resize(n + ids.shape[0], refcheck=False)
            _merge_back(self.ids, self.locs, n, ids, locs)
            self._drop_dir()
            self.stamp += 1
        return np.concatenate(replaced)

    def _delta_items(self, ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
        ids = np.empty(self.n_delta, dtype=np.int64)
        locs = np.empty(self.n_delta, dtype=np.int64)
        _loc_items(self.keys, self.vals, ids, locs)
        if not ordered:
            return ids, locs
        order = stable_argsort(ids)
        return ids[order], locs[order]

    def merge(self) -> None:
        """Move the hash's entries into the sorted arrays (in place) and empty it."""
        if self.n_delta == 0:
            return
        new_ids, new_locs = self._delta_items()
        n = self.ids.shape[0]
        self.ids.resize(n + new_ids.shape[0], refcheck=False)
        self.locs.resize(n + new_ids.shape[0], refcheck=False)
        _merge_back(self.ids, self.locs, n, new_ids, new_locs)
        self._drop_dir()
        self.stamp += 1
        self._empty_delta()
        self.n_delta = 0

    def _empty_delta(self) -> None:
        self.keys = np.full(8, EMPTY, dtype=np.int64)
        self.vals = np.zeros(8, dtype=np.int64)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The location of each of ``ids`` (int64), -1 where none (fastest with ``ids`` sorted)."""
        out = np.empty(ids.shape[0], dtype=np.int64)
        args = (self.ids, self.locs, self.ids.shape[0], *self._fresh_dir(), self.keys, self.vals, self.n_delta > 0)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        parts = split_parts(ids.shape[0], FIND_SPLIT_FROM)
        if parts > 1:
            _find_split(*args, ids, out, parts)
        else:
            _find(*args, ids, out)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, locations)`` held, in id order (int64 copies)."""
        self.merge()
        return self.ids.astype(np.int64), self.locs.copy()

    def ids_between(self, a: int, b: int) -> np.ndarray:
        """The ids at positions ``a:b`` of the arrays (int64, a copy), once merged."""
        return self.ids[a:b].astype(np.int64)
