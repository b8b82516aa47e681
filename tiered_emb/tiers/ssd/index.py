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
copy of the index.  The writer merges a slice of rows at a time and builds the directory
again the same way (:meth:`SegmentIndex.merge_slices`), letting the tier's lock go
between slices: lookups between them search the unmoved rows with the old directory,
the merged ones whole, and the hash, which keeps every new id to the end.  Changes that
come meanwhile (the next write-back, indexed while this one's merge goes on) go to a
second, *later* hash, searched before everything else; when the merge ends, those of its
ids the arrays hold are changed there and the rest become the hash.  Ids appended above
every one held are searched as one run past the directory until they are 1/16 of the
rows.  An id already in the arrays is changed there.  A store that opens builds the
arrays from its segments' ids instead (:meth:`SegmentIndex.load_runs`), a range of ids at
a time, each range's copies merged (a counting sort on the ids' top bits) and appended.
Entries are only added or moved, until :meth:`SegmentIndex.clear`.  The kernels are in
:mod:`.sorted_index`.
"""

from __future__ import annotations

import numpy as np

from tiered_emb._jit import split_parts
from tiered_emb._order import stable_argsort
from tiered_emb.cache.index import EMPTY, table_size_for
from tiered_emb.tiers.ssd.sorted_index import (
    FIND_SPLIT_FROM,
    Hash,
    Sorted,
    build_dir,
    build_dir_part,
    find_merging,
    find_rows,
    find_split,
    loc_items,
    loc_set,
    merge_back,
    merge_back_part,
    merge_runs,
    positions_of,
    set_at,
    set_sorted,
)

#: Positions within a segment take 20 bits (a segment holds at most 2**20 rows), numbers the
#: other 43 (:data:`MAX_SEGMENTS`: at 1,000 segments a second, 278 years).
POS_BITS = 20
POS_MASK = (1 << POS_BITS) - 1
MAX_SEGMENT_ROWS = 1 << POS_BITS
MAX_SEGMENTS = 1 << (63 - POS_BITS)


#: A store that opens cuts the ids into ranges at every this many ids of each segment
#: (:meth:`SegmentIndex.load_runs`): a range holds at most this many copies a segment more
#: than asked.
LOAD_STRIDE = 64

#: Rows a merge in slices (:meth:`SegmentIndex.merge_slices`) moves, or covers with its
#: directory, between two of its steps: a few milliseconds each.
MERGE_SLICE_ROWS = 1 << 21


def hash_items(keys: np.ndarray, vals: np.ndarray, n: int, ordered: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The entries of the hash ``keys``/``vals`` holding ``n``, ``(ids, locations)`` (in id
    order unless not ``ordered``); fewer where it changed while read (a copy known stale)."""
    ids = np.empty(n, dtype=np.int64)
    locs = np.empty(n, dtype=np.int64)
    n = loc_items(keys, vals, ids, locs)
    ids, locs = ids[:n], locs[:n]
    if not ordered:
        return ids, locs
    order = stable_argsort(ids)
    return ids[order], locs[order]


_NONE = np.empty(0, dtype=np.int64)


def new_hash(capacity: int, ids: np.ndarray, locs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A hash ``(keys, vals)`` for ``capacity`` entries holding ``ids`` (distinct) -> ``locs``."""
    keys = np.full(table_size_for(capacity), EMPTY, dtype=np.int64)
    vals = np.zeros(keys.shape[0], dtype=np.int64)
    loc_set(keys, vals, ids, locs, np.empty(ids.shape[0], dtype=np.int64))
    return keys, vals


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
        # a merge in slices under way: its generator, and (new ids, their locations, cursor
        # [front, next new, next written], rows before it) for :meth:`find`
        self._slices = None
        self._merging: tuple | None = None
        #: counts the changes of the hash of new ids (a copy of its entries taken before one is stale)
        self.delta_version = 0
        self.clear()

    def clear(self) -> None:
        self._finish()
        self.stamp += 1  # (positions found before are stale)
        self.ids = np.empty(0, dtype=self.id_dtype)  # sorted; the arrays own their memory (resized in place)
        self.locs = np.empty(0, dtype=np.int64)
        self._empty_delta()
        self._empty_later()
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
            self._dir, self._shift = self._new_dir(n, int(self.ids[n - 1]))
            build_dir(self.ids, n, self._shift, self._dir)
            self._covered = n
        return self._dir, self._shift, self._covered

    def _new_dir(self, n: int, top: int) -> tuple[np.ndarray, int]:
        """A directory for ``n`` rows (n > 0) whose largest id is ``top``, to fill: its array and shift."""
        target = max(1, n // self.BUCKET_ROWS)
        shift = max(0, top.bit_length() - (target.bit_length() - 1))
        return np.empty((top >> shift) + 2, dtype=np.int64), shift

    def __len__(self) -> int:
        if self._merging is not None:  # (the new ids are in the hashes until the end)
            return self._merging[3] + self.n_delta + self.n_later_new
        return self.ids.shape[0] + self.n_delta

    @property
    def covered(self) -> int:
        """Rows of the arrays the directory's buckets cover (those after: searched as one run)."""
        return self._covered

    @property
    def nbytes(self) -> int:
        moving = 0 if self._merging is None or self._merging[0] is None else self._merging[0].nbytes * 2
        later = self.later_keys.nbytes + self.later_vals.nbytes
        return (
            self.ids.nbytes + self.locs.nbytes + self.keys.nbytes + self.vals.nbytes + self._dir.nbytes + moving + later
        )

    def view(self) -> tuple:
        """What :meth:`positions` searches: taken under the tier's lock (the directory may be
        built again here), searched after it is let go."""
        self._finish()
        return (self.stamp, self.ids.shape[0]), self._view()

    def _view(self) -> Sorted:
        """The arrays as a search sees them, the directory built again where due."""
        return Sorted(self.ids, self.ids.shape[0], *self._fresh_dir())

    @staticmethod
    def positions(view: tuple, ids: np.ndarray) -> tuple:
        """Where each of ``ids`` (int64) lies in the arrays of ``view`` (:meth:`view`), -1 where
        absent: the search of :meth:`add`, done by the one writer without the tier's lock
        (readers only read the arrays; a merge or an append between makes it stale, and
        :meth:`add` then searches again)."""
        stamp, arrays = view
        at = np.empty(ids.shape[0], dtype=np.int64)
        positions_of(arrays, np.ascontiguousarray(ids, dtype=np.int64), at)
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
        if self._merging is not None:
            return self._set_later(ids, locs)
        n = self.ids.shape[0]
        new_at = None
        if not (n and ids.min() > self.ids[n - 1]):  # (ids above every one held are in none)
            missing = np.empty(ids.shape[0], dtype=np.bool_)
            if found is not None and found[0] == (self.stamp, n):
                absent = set_at(self.locs, found[1], locs, missing, old)
            else:
                absent = set_sorted(self._view(), self.locs, ids, locs, missing, old)
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
        grown = self.grown(ids.shape[0])
        if grown is not None:
            self.keys, self.vals = grown
        in_delta = np.empty(ids.shape[0], dtype=np.int64)
        self.n_delta += int(loc_set(self.keys, self.vals, ids, locs, in_delta))
        self.delta_version += 1
        if new_at is None:
            old = in_delta
        else:
            old[new_at] = in_delta
        # a merge moves every row: merging at a fixed share of the rows keeps its cost per id
        # added constant as the index grows (the hash then holds up to 1/64 of them: 1 byte a
        # row); the writer merges in slices when it is due (:meth:`merge_slices`), this at twice
        if self.n_delta >= 2 * self._merge_at():
            self.merge()
        return old

    def _set_later(self, ids: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """:meth:`set` while a merge in slices is under way: into the later hash."""
        old = self.find(ids)
        need = self.n_later + ids.shape[0]
        if 2 * need > self.later_keys.shape[0]:
            held = hash_items(self.later_keys, self.later_vals, self.n_later, ordered=False)
            self.later_keys, self.later_vals = new_hash(need, *held)
        self.n_later += int(
            loc_set(self.later_keys, self.later_vals, ids, locs, np.empty(ids.shape[0], dtype=np.int64))
        )
        self.n_later_new += int(np.count_nonzero(old < 0))
        return old

    def grown(self, extra: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The hash of new ids grown to take ``extra`` more (``(keys, vals)`` with every entry
        in), or None where it has room: the one writer may build it with the tier's lock let
        go (readers only read the hash) and put it in place under the lock.  Doubling while
        small; past an eighth of what it holds at the next merge, that size at once (each
        growth inserts every entry again)."""
        need = self.n_delta + extra
        if 2 * need <= self.keys.shape[0] or self._merging is not None:
            return None
        due = max(self.delta_rows, self.ids.shape[0] // 64) + extra
        return new_hash(need if 8 * need < due else max(need, due), *self._delta_items(ordered=False))

    def reserve(self, grown: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Put :meth:`grown` in place (under the tier's lock; nothing changed the hash since)."""
        if grown is not None and grown[0].shape[0] > self.keys.shape[0] and self._merging is None:
            self.keys, self.vals = grown
            self.delta_version += 1

    def _merge_at(self) -> int:
        return max(self.delta_rows, self.ids.shape[0] // 64)

    @property
    def merge_due(self) -> bool:
        """Whether the hash of new ids holds enough to merge (:meth:`merge_slices`)."""
        return self._merging is None and self.n_delta >= self._merge_at()

    def load_runs(self, runs: list[tuple[int, np.ndarray]], cut_rows: int) -> np.ndarray:
        """While a store opens, into an empty index: ``runs`` of ``(segment, ids)`` (ids
        distinct and increasing, row ``i`` at position ``i``), oldest first, the newest copy
        of each id kept.  A range of ids at a time: its part of every run (two binary
        searches a run) sorted together (:func:`.sorted_index.merge_runs`, a counting sort
        by the ids' top bits), each id's newest copy appended to the arrays, so that no row
        already in them moves.  The ranges are
        cut at every :data:`LOAD_STRIDE`-th id of the runs, sorted, so that each holds about
        ``cut_rows`` copies (memory: the index, one range at up to ~33 bytes a copy, and the
        cuts' samples, 1/8 byte a row).  Returns
        the rows the index names in each segment (indexed by its number)."""
        if len(self) or self._merging is not None:
            raise ValueError("load_runs fills an empty index")
        runs = [(q, np.ascontiguousarray(ids, dtype=np.int64)) for q, ids in runs if ids.shape[0]]
        for q, ids in runs:
            if not 0 <= q < MAX_SEGMENTS or ids.shape[0] > MAX_SEGMENT_ROWS:
                raise ValueError(f"segment {q} of {ids.shape[0]} rows is out of the index's range")
            if ids[0] < 0 or (self.num_rows is not None and ids[-1] >= self.num_rows):
                raise ValueError(f"ids outside [0, {self.num_rows}) cannot be indexed")
        live = np.zeros(max((q for q, _ in runs), default=-1) + 1, dtype=np.int64)
        if not runs:
            return live
        every = max(1, cut_rows // LOAD_STRIDE)
        cuts = np.unique(np.sort(np.concatenate([ids[::LOAD_STRIDE] for _, ids in runs]))[every::every]).tolist()
        for lo, hi in zip([None, *cuts], [*cuts, None], strict=True):
            parts, bases = [], []
            for q, ids in runs:
                a = 0 if lo is None else int(np.searchsorted(ids, lo))
                b = ids.shape[0] if hi is None else int(np.searchsorted(ids, hi))
                if a < b:
                    parts.append(ids[a:b])
                    bases.append((q << POS_BITS) + a)
            if not parts:
                continue
            starts = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([p.shape[0] for p in parts], out=starts[1:])
            cat = np.concatenate(parts)
            del parts
            low = int(cat.min()) if lo is None else int(lo)
            span = (int(cat.max()) if hi is None else int(hi) - 1) - low + 1
            # buckets of 2**shift ids, about 8 copies each on average
            shift = max(0, span.bit_length() - max(1, cat.shape[0] // 8).bit_length())
            ids, at = np.empty_like(cat), np.empty_like(cat)
            counts = np.empty(((span - 1) >> shift) + 2, dtype=np.int64)
            m = merge_runs(cat, starts, np.array(bases, dtype=np.int64), low, shift, ids, at, counts)
            del cat, counts
            n = self.ids.shape[0]
            self.ids.resize(n + m, refcheck=False)
            self.locs.resize(n + m, refcheck=False)
            self.ids[n:] = ids[:m]
            self.locs[n:] = at[:m]
            live += np.bincount(at[:m] >> POS_BITS, minlength=live.shape[0])
        self._drop_dir()
        self.stamp += 1
        return live

    def delta_held(self) -> tuple:
        """The hash of new ids as it is now, for :meth:`delta_items` (taken under the tier's lock)."""
        return self.keys, self.vals, self.n_delta, self.delta_version

    def delta_items(self, held: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The hash's entries, ``(ids, locations)`` in id order: of :meth:`delta_held` ``held``,
        which a writer may read with the lock let go (its :attr:`delta_version` says whether
        they are still the hash's entries)."""
        return self._delta_items(held=held)

    def _delta_items(self, ordered: bool = True, held: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        keys, vals, n, _ = held if held is not None else self.delta_held()
        return hash_items(keys, vals, n, ordered)

    def begin_merge(self) -> tuple:
        """Begin a merge of the hash of new ids (under the tier's lock): the hash is frozen
        from here (changes go to the later hash) and nothing moves yet; returns its
        :meth:`delta_held`, for the writer to sort with the lock let go and give to
        :meth:`merge_slices`."""
        self._finish()
        self._fresh_dir()  # (the unmoved rows are searched with it meanwhile)
        n = self.ids.shape[0]
        self._merging = (None, None, np.array([n - 1, -1, n - 1], dtype=np.int64), n)
        return self.delta_held()

    def merge_slices(self, rows: int = MERGE_SLICE_ROWS, items: tuple | None = None):
        """Move the hash's entries into the sorted arrays, in place, ``rows`` moves a step,
        then build the directory ``rows`` at a time, and empty the hash: a generator, each
        step run with the tier's lock held, which the caller may let go between them
        (:meth:`begin_merge` first, else here).  :meth:`find` answers between steps (the
        hash holds every new id to the end), and :meth:`set` takes changes into the later
        hash; every other change of the index, and :meth:`view`, first runs the rest.
        ``items``: ``(ids, locations, version)``, the hash's entries in id order
        (:meth:`delta_items`) at :attr:`delta_version` ``version`` (used unless the hash
        changed since)."""
        if self._slices is not None:
            self._finish()
        if self._merging is None:
            self.begin_merge()
        self._slices = self._merge_steps(rows, items)
        return self._slices

    def _finish(self) -> None:
        """Run the rest of a merge under way (or begun)."""
        if self._merging is not None and self._slices is None:
            self._slices = self._merge_steps(MERGE_SLICE_ROWS, None)
        if self._slices is not None:
            for _ in self._slices:
                pass

    def _merge_steps(self, rows: int, items: tuple | None):
        n = self._merging[3]
        try:  # (every allocation before a row moves: one that fails leaves the index as it was)
            if items is not None and items[2] == self.delta_version:
                new_ids, new_locs = items[0], items[1]
            else:
                new_ids, new_locs = self.delta_items()
            m = new_ids.shape[0]
            if m:
                dir_, shift = self._new_dir(n + m, max(int(new_ids[-1]), int(self.ids[n - 1]) if n else 0))
                self.ids.resize(n + m, refcheck=False)
                self.locs.resize(n + m, refcheck=False)
        except BaseException:
            self._abandon(n)
            raise
        if m:
            cur = np.array([n - 1, m - 1, n + m - 1], dtype=np.int64)
            self._merging = (new_ids, new_locs, cur, n)
            while cur[1] >= 0:
                merge_back_part(self.ids, self.locs, new_ids, new_locs, cur, rows)
                yield
            at = np.zeros(1, dtype=np.int64)
            for a in range(0, n + m, rows):
                build_dir_part(self.ids, a, min(n + m, a + rows), shift, dir_, at)
                yield
            dir_[at[0] :] = n + m
            self._dir, self._shift, self._covered = dir_, shift, n + m
            self.stamp += 1
        self._merging = self._slices = None
        self._empty_delta()
        self._take_later()

    def _abandon(self, n: int) -> None:
        """A merge whose allocations failed before any row moved: the arrays back to their
        ``n`` rows (shrinking cannot fail), no merge under way, and the changes the later
        hash took meanwhile made as any change is."""
        for arr in (self.ids, self.locs):
            if arr.shape[0] != n:
                arr.resize(n, refcheck=False)
        self._merging = self._slices = None
        ids, locs = self._later_items()
        if ids.shape[0]:
            self.set(ids, locs)

    def _take_later(self) -> None:
        """At the end of a merge: the later hash's ids that the arrays hold changed there, the
        others made the hash of new ids."""
        if self.n_later == 0:
            return
        ids, locs = self._later_items()
        missing = np.empty(ids.shape[0], dtype=np.bool_)
        old = np.empty(ids.shape[0], dtype=np.int64)
        if set_sorted(self._view(), self.locs, ids, locs, missing, old):
            ids, locs = ids[missing], locs[missing]
            self.keys, self.vals = new_hash(ids.shape[0], ids, locs)
            self.n_delta = ids.shape[0]

    def _later_items(self) -> tuple[np.ndarray, np.ndarray]:
        """The later hash's entries in id order, the later hash emptied."""
        ids, locs = hash_items(self.later_keys, self.later_vals, self.n_later)
        self._empty_later()
        return ids, locs

    def _empty_later(self) -> None:
        self.later_keys, self.later_vals = new_hash(0, _NONE, _NONE)
        self.n_later = 0  # entries of the later hash
        self.n_later_new = 0  # of them, ids the index held nowhere else when they came

    def merge(self) -> None:
        """Move the hash's entries into the sorted arrays (in place) and empty it."""
        self._finish()
        if self.n_delta == 0:
            return
        new_ids, new_locs = self._delta_items()
        n = self.ids.shape[0]
        self.ids.resize(n + new_ids.shape[0], refcheck=False)
        self.locs.resize(n + new_ids.shape[0], refcheck=False)
        merge_back(self.ids, self.locs, n, new_ids, new_locs)
        self._drop_dir()
        self.stamp += 1
        self._empty_delta()

    def _empty_delta(self) -> None:
        self.keys, self.vals = new_hash(0, _NONE, _NONE)
        self.n_delta = 0
        self.delta_version += 1

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The location of each of ``ids`` (int64), -1 where none (fastest with ``ids`` sorted)."""
        out = np.empty(ids.shape[0], dtype=np.int64)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if self._merging is not None:
            _, _, cur, n_old = self._merging
            front, back = int(cur[0]), int(cur[2]) + 1
            view = Sorted(self.ids, self.ids.shape[0], self._dir, self._shift, self._covered)
            delta, later = Hash(self.keys, self.vals), Hash(self.later_keys, self.later_vals)
            find_merging(view, self.locs, n_old, front, back, delta, later, self.n_later > 0, ids, out)
            return out
        view, delta = self._view(), Hash(self.keys, self.vals)
        parts = split_parts(ids.shape[0], FIND_SPLIT_FROM)
        if parts > 1:
            find_split(view, self.locs, delta, self.n_delta > 0, ids, out, parts)
        else:
            find_rows(view, self.locs, delta, self.n_delta > 0, ids, out)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, locations)`` held, in id order (int64 copies)."""
        self.merge()  # (also the rest of one under way)
        return self.ids.astype(np.int64), self.locs.copy()

    def ids_between(self, a: int, b: int) -> np.ndarray:
        """The ids at positions ``a:b`` of the arrays (int64, a copy), once merged."""
        self._finish()
        return self.ids[a:b].astype(np.int64)
