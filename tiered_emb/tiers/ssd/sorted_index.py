"""The kernels of :class:`.index.SegmentIndex`: its sorted arrays of ids and locations, their
directory over the ids' top bits, the hash of ids added since the last merge, and the
merges (whole, or a slice at a time with lookups between), and the merge of segments'
sorted ids that builds the arrays when a store opens.  See :mod:`.index` for the
layout; these are Numba functions over its arrays, with no state of their own.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from tiered_emb._jit import kernel, prefetch_hint
from tiered_emb.cache.index import EMPTY, hash_home, index_find, index_prefetch


class Sorted(NamedTuple):
    """The sorted arrays as a search sees them (``SegmentIndex._view``; :meth:`.index.SegmentIndex.view`
    hands one out with its stamp)."""

    ids: np.ndarray  # the ids, increasing
    n: int  # the rows searched (``ids[:n]``)
    dir_: np.ndarray  # int64: the first position of each bucket of ids (``id >> shift``)
    shift: int
    covered: int  # the rows the buckets cover (the rows after them: searched as one run)


class Hash(NamedTuple):
    """A hash of ids to locations (:mod:`tiered_emb.cache.index`'s layout)."""

    keys: np.ndarray
    vals: np.ndarray


#: A query this many ids ahead has its directory entry, and its bucket of ids, fetched
#: while the current one is searched: each is a cache miss on a large index.
AHEAD = 8


@kernel
def loc_set(keys, vals, ids, locs, old):
    """``ids[i] -> locs[i]`` for each i in order, replacing a held entry (its location into
    ``old[i]``, else -1); returns the entries added."""
    mask = keys.shape[0] - 1
    added = 0
    m = ids.shape[0]
    for i in range(m):
        if i + AHEAD < m:  # (a hint: the bucket of the id further on, a cache miss on a large hash)
            index_prefetch(keys, vals, ids[i + AHEAD])
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


@kernel
def loc_items(keys, vals, out_ids, out_locs):
    """The entries into ``out_ids``/``out_locs``, as many as they hold; returns how many."""
    m = 0
    for j in range(keys.shape[0]):
        if keys[j] != EMPTY and m < out_ids.shape[0]:
            out_ids[m] = keys[j]
            out_locs[m] = vals[j]
            m += 1
    return m


# a batch of finds is cut into slices of at least this many ids for Numba's threads: each
# slice's work well above the cost of waking the pool
FIND_SPLIT_FROM = 4096


def build_dir(arr_ids: np.ndarray, n: int, shift: int, dir_: np.ndarray) -> None:
    """``dir_[b]`` = the first position whose id ``>> shift`` is at least ``b`` (``n`` past
    the last), for every ``b`` below ``len(dir_)``."""
    cur = np.zeros(1, dtype=np.int64)
    build_dir_part(arr_ids, 0, n, shift, dir_, cur)
    dir_[cur[0] :] = n


@numba.njit(inline="never")
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


@numba.njit(inline="never")
def _search(arr_ids, lo, hi, q):
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(arr_ids[mid]) < q:
            lo = mid + 1
        else:
            hi = mid
    return lo


@kernel
def positions_of(view, ids, at):
    """``at[i]`` = the position of ``ids[i]`` in ``arr_ids[:n]``, -1 where absent; returns
    how many are absent.  Queries ``AHEAD`` on have their directory entry and bucket
    fetched early (hints: nothing depends on them)."""
    arr_ids, n, dir_, shift, covered = view
    absent = 0
    m = ids.shape[0]
    nb = dir_.shape[0] - 1
    for i in range(m):
        if i + 2 * AHEAD < m:
            b = ids[i + 2 * AHEAD] >> shift
            if 0 <= b < nb:
                prefetch_hint(dir_, b)
        if i + AHEAD < m and ids[i + AHEAD] >= 0:
            lo, hi = _range(dir_, shift, covered, n, ids[i + AHEAD])
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


@kernel
def find_rows(view, arr_locs, delta, has_delta, ids, out):
    """Location of each of ``ids`` (-1 where none): the sorted arrays (``view``, their
    locations ``arr_locs``), then the hash of ids added since (``delta``, when
    ``has_delta``).  The location or hash bucket ``AHEAD`` on is fetched early (a hint, as
    in :func:`positions_of`)."""
    keys, vals = delta
    positions_of(view, ids, out)
    m = ids.shape[0]
    for i in range(m):
        if i + AHEAD < m:
            if out[i + AHEAD] >= 0:
                prefetch_hint(arr_locs, out[i + AHEAD])
            elif has_delta and ids[i + AHEAD] >= 0:
                index_prefetch(keys, vals, ids[i + AHEAD])
        if out[i] >= 0:
            out[i] = arr_locs[out[i]]
        elif has_delta:
            out[i] = index_find(keys, vals, ids[i])


@kernel(parallel=True)
def find_split(view, arr_locs, delta, has_delta, ids, out, parts):
    """:func:`find_rows` over ``parts`` consecutive slices of ``ids`` at once, on Numba's threads
    (the index is only read; each slice writes its own part of ``out``)."""
    m = ids.shape[0]
    for c in numba.prange(parts):
        lo = m * c // parts
        hi = m * (c + 1) // parts
        find_rows(view, arr_locs, delta, has_delta, ids[lo:hi], out[lo:hi])


@kernel
def set_at(arr_locs, at, locs, missing, old):
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
def set_sorted(view, arr_locs, ids, locs, missing, old):
    """Change the location of each of ``ids`` held in the arrays (the one it had into
    ``old[i]``); ``missing[i]`` = the others.  Returns how many are missing."""
    at = np.empty(ids.shape[0], dtype=np.int64)
    positions_of(view, ids, at)
    return set_at(arr_locs, at, locs, missing, old)


def merge_back(arr_ids: np.ndarray, arr_locs: np.ndarray, n: int, new_ids: np.ndarray, new_locs: np.ndarray) -> None:
    """Merge ``new_ids`` (sorted, none in ``arr_ids[:n]``) into the arrays, whose length is
    ``n + len(new_ids)``, from the back, in place."""
    m = new_ids.shape[0]
    merge_back_part(arr_ids, arr_locs, new_ids, new_locs, np.array([n - 1, m - 1, n + m - 1], dtype=np.int64), n + m)


@kernel
def merge_back_part(arr_ids, arr_locs, new_ids, new_locs, cur, rows):
    """:func:`merge_back` for at most ``rows`` moves, from ``cur`` = ``[i, j, w]`` (the last
    old row not moved, the last new one not placed, the position written next), kept up:
    the largest rows move first, so the rows ``[0, i]`` are as they were and ``[w + 1, ...)``
    are merged."""
    i, j, w = cur[0], cur[1], cur[2]
    end = max(w - rows, -1)
    while j >= 0 and w > end:
        if i >= 0 and arr_ids[i] > new_ids[j]:
            arr_ids[w] = arr_ids[i]
            arr_locs[w] = arr_locs[i]
            i -= 1
        else:
            arr_ids[w] = new_ids[j]
            arr_locs[w] = new_locs[j]
            j -= 1
        w -= 1
    cur[0], cur[1], cur[2] = i, j, w


@kernel
def build_dir_part(arr_ids, a, b, shift, dir_, cur):
    """:func:`build_dir` over positions ``a:b`` (called in order, from 0), ``cur[0]`` the next
    bucket; the caller fills the buckets past the last row."""
    nb = dir_.shape[0]
    bucket = cur[0]
    for i in range(a, b):
        hb = np.int64(arr_ids[i]) >> shift
        while bucket <= hb and bucket < nb:
            dir_[bucket] = i
            bucket += 1
    cur[0] = bucket


@kernel
def find_merging(view, arr_locs, n_old, front, back, delta, later, has_later, ids, out):
    """:func:`find_rows` while a merge is under way: the ``later`` hash first (changes since
    it began); new ids are all in the ``delta`` hash still; an old id at most
    ``arr_ids[front]`` lies in the unmoved rows ``[0, front]`` (the old directory's, over
    ``n_old`` rows), a larger one in the merged rows ``[back, view.n)`` (searched whole)."""
    arr_ids, size, dir_, shift, covered = view
    keys, vals = delta
    later_keys, later_vals = later
    for i in range(ids.shape[0]):
        q = ids[i]
        out[i] = -1
        if q < 0:
            continue
        if has_later:
            loc = index_find(later_keys, later_vals, q)
            if loc >= 0:
                out[i] = loc
                continue
        loc = index_find(keys, vals, q)
        if loc >= 0:
            out[i] = loc
            continue
        if front >= 0 and q <= np.int64(arr_ids[front]):
            lo, hi = _range(dir_, shift, covered, n_old, q)
            hi = min(hi, front + 1)
            lo = min(lo, hi)
        else:
            lo, hi = back, size
        p = _search(arr_ids, lo, hi, q)
        if p < hi and np.int64(arr_ids[p]) == q:
            out[i] = arr_locs[p]


#: A bucket of :func:`merge_runs` larger than this is sorted by a merge sort, not by insertion.
_INSERTION_MAX = 32


@numba.njit(cache=True, nogil=True)
def merge_runs(cat, starts, bases, lo, shift, out_ids, out_locs, counts):
    """Sort the runs ``cat[starts[j]:starts[j + 1]]`` (each increasing; ids >= ``lo``) together
    by id, equal ids in run order, into ``out_ids`` and the location of each
    (``bases[j]`` + its place in run ``j``) into ``out_locs``; keep the last copy of each id
    (the newest run's) at the front and return how many.  A counting sort into the
    ``counts.shape[0] - 1`` buckets of ``(id - lo) >> shift``, runs taken in order (so that
    it is stable), then each bucket sorted by id (stable: insertion, or merge sort where
    large).  Reads and writes each copy a few times, where a sort of the whole would move
    it log(runs) times."""
    nb = counts.shape[0] - 1
    counts[:] = 0
    for i in range(cat.shape[0]):
        counts[((cat[i] - lo) >> shift) + 1] += 1
    for b in range(nb):
        counts[b + 1] += counts[b]
    for j in range(starts.shape[0] - 1):
        base = bases[j] - starts[j]
        for i in range(starts[j], starts[j + 1]):
            b = (cat[i] - lo) >> shift
            p = counts[b]
            counts[b] = p + 1
            out_ids[p] = cat[i]
            out_locs[p] = base + i
    start = 0
    kept = 0
    for b in range(nb):
        end = counts[b]  # (bucket b now ends here and starts where b - 1 ended)
        if end - start > _INSERTION_MAX:
            order = np.argsort(out_ids[start:end], kind="mergesort")
            ids = out_ids[start:end][order]
            locs = out_locs[start:end][order]
            out_ids[start:end] = ids
            out_locs[start:end] = locs
        else:
            for i in range(start + 1, end):
                x, y = out_ids[i], out_locs[i]
                j = i - 1
                while j >= start and out_ids[j] > x:
                    out_ids[j + 1], out_locs[j + 1] = out_ids[j], out_locs[j]
                    j -= 1
                out_ids[j + 1], out_locs[j + 1] = x, y
        for i in range(start, end):
            if i + 1 < end and out_ids[i + 1] == out_ids[i]:
                continue  # (an older copy: the next one is newer)
            out_ids[kept], out_locs[kept] = out_ids[i], out_locs[i]
            kept += 1
        start = end
    return kept
