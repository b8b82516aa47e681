"""Rows gathered straight from ``data.mdb``, through a read-only map of the file.

LMDB keeps a value larger than about half a page on *overflow pages* of its own: one
contiguous run of the file, that stays where it is until the value is deleted (a
copy-on-write of the B-tree copies the leaf that points to it, never the value).  A
segment of ``p:`` is such a value, so once committed its rows lie at a fixed offset of
the file; :func:`value_offset` finds it (the page number LMDB writes at the head of the
run), and :func:`gather` copies rows from a map of the file by offset, in a Numba loop,
with no transaction, no ``get`` and no Python object per row.  This is the same work as a
``numpy.memmap`` fancy index.

The map is this process's own ``mmap`` of ``data.mdb`` (not LMDB's): it spans the
environment's map size (past the end of the file; only committed pages are read) and
is made again only when the map grows.  A segment's pages are freed only when a
compaction deletes it; such a deletion and the index change that follows it happen
under :class:`~tiered_emb.tiers.ssd.lmdb_env.TxnGate` held exclusively
(:mod:`.compaction`), and every gather holds it shared, so no gather reads a page that a
later write may have reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from pathlib import Path

import numba
import numpy as np

from tiered_emb._jit import ROW_PREFETCH_DISTANCE, kernel, prefetch_hint
from tiered_emb.tiers.ssd.codec import SUM_MUL_HI, SUM_MUL_ID, SUM_SEED, sum_weights
from tiered_emb.tiers.ssd.index import POS_BITS, POS_MASK

#: LMDB 0.9's page header: page number (8 bytes), 2 bytes of padding, flags (2 bytes), 4 more.
PAGE_HEADER = 16
P_OVERFLOW = 0x04

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value


def value_offset(value, psize: int) -> int:
    """The offset in ``data.mdb`` of ``value`` (a py-lmdb buffer of a read transaction), or
    -1 when it does not lie on overflow pages of its own (a small value, inside a leaf)."""
    arr = np.frombuffer(value, dtype=np.uint8)
    addr = arr.ctypes.data
    if arr.shape[0] < PAGE_HEADER or (addr - PAGE_HEADER) % psize:
        return -1
    head = ctypes.string_at(addr - PAGE_HEADER, PAGE_HEADER)
    if not int.from_bytes(head[10:12], "little") & P_OVERFLOW:
        return -1
    return int.from_bytes(head[:8], "little") * psize + PAGE_HEADER


class MappedFile:
    """A read-only, shared map of ``path`` (``data.mdb``) spanning at least ``length``
    bytes: :attr:`floats` views it as float32 (row offsets are multiples of 4)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._addr: int | None = None
        self._length = 0
        self._old: list[tuple[int, int]] = []  # earlier maps: a gather begun before may still read one
        self.floats = np.empty(0, dtype=np.float32)

    def cover(self, length: int) -> np.ndarray:
        """:attr:`floats`, mapped again first when it is shorter than ``length`` bytes."""
        floats = self.floats
        if 4 * floats.shape[0] >= length:
            return floats
        with self._lock:
            if 4 * self.floats.shape[0] < length:
                self._map(max(length, 2 * self._length))
            return self.floats

    def _map(self, length: int) -> None:
        length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.open(self.path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {self.path} failed")
        # Rows are read at random: a fault reads its page alone, as LMDB's own map does
        # (readahead=False).  Without it a fault reads the device's readahead around it (8 MiB
        # on some disks), and where page cache is short (a container's memory limit) the
        # reads evict pages still in use, each faulted in again: measured, the step of a
        # 1e9-id table slowed 25x under such a limit as the file outgrew it.
        _libc.madvise(addr, length, mmap.MADV_RANDOM)
        if self._addr is not None:
            self._old.append((self._addr, self._length))
        self._addr, self._length = addr, length
        self.floats = np.ctypeslib.as_array((ctypes.c_float * (length // 4)).from_address(addr))

    def close(self) -> None:
        """Unmap (no gather may run meanwhile or after)."""
        with self._lock:
            self.floats = np.empty(0, dtype=np.float32)
            for addr, length in [*self._old, (self._addr, self._length)]:
                if addr is not None:
                    _libc.munmap(addr, length)
            self._old, self._addr, self._length = [], None, 0


@numba.njit(cache=True, nogil=True, inline="always")
def row_sum(words, start, width, row_id, weights):
    """The checksum of the ``width`` words of ``words`` from ``start`` under ``row_id``
    (``weights``: :func:`.codec.sum_weights`): the twin of :func:`.codec.row_sums`."""
    mask = np.uint64(0xFFFFFFFF)
    h = ((np.uint64(row_id) & mask) ^ np.uint64(SUM_SEED)) * np.uint64(SUM_MUL_ID) & mask
    h = ((h ^ (np.uint64(row_id) >> np.uint64(32))) * np.uint64(SUM_MUL_HI)) & mask
    # (the terms are independent: a loop the compiler runs in SIMD lanes, of 32 bits each:
    # every step is mod 2**32, and 64-bit lanes would take twice the time)
    acc = np.uint32(0)
    mul = np.uint32(SUM_MUL_ID)
    for k in range(width):
        term = np.uint32(words[start + k] * weights[k])
        term = np.uint32(term ^ (term >> np.uint32(16)))
        term = np.uint32(term * mul)
        acc = np.uint32(acc + np.uint32(term ^ (term >> np.uint32(13))))
    return (h + np.uint64(acc)) & mask


@kernel
def span(base, nrows, summed, locs, width, slow):
    """Which rows of ``locs`` (segment << POS_BITS | position) lie in segments whose place in
    the file is known (``base[seq] >= 0``): ``slow[j]`` 1 where not.  Returns ``(how many
    are not, the end in floats of the furthest segment of those that are)``: one pass over
    the locations."""
    n_slow = 0
    end = 0
    for j in range(locs.shape[0]):
        seq = locs[j] >> POS_BITS
        if seq >= base.shape[0] or base[seq] < 0:
            slow[j] = 1
            n_slow += 1
            continue
        slow[j] = 0
        e = base[seq] + nrows[seq] * (width + summed[seq])
        if e > end:
            end = e
    return n_slow, end


@kernel
def gather(floats, base, nrows, summed, locs, ids, width, out_rows, at, weights, check=True):
    """``out_rows[at[j]] = `` the row of ``ids[j]`` at ``locs[j]`` (segment << POS_BITS |
    position), for segments whose ``base[seq]`` (float offset of their first row) is known,
    checked against the checksum after it where ``summed[seq]`` (unless not ``check``;
    ``weights``: :func:`.codec.sum_weights` of ``width``).  The rows a few entries
    ahead are prefetched: each is a cache miss of its own, as in a memmap gather.

    Returns -1, or ``2 * j`` for the first ``j`` whose position is past its segment's rows
    (a damaged index), ``2 * j + 1`` for the first whose row fails its checksum.
    """
    words = floats.view(np.uint32)
    out_words = out_rows.view(np.uint32)
    n = locs.shape[0]
    for j in range(n):
        if j + ROW_PREFETCH_DISTANCE < n:
            ahead = locs[j + ROW_PREFETCH_DISTANCE]
            seq_a = ahead >> POS_BITS
            if (ahead & POS_MASK) < nrows[seq_a]:
                first = base[seq_a] + (ahead & POS_MASK) * (width + summed[seq_a])
                for c in range(0, width + 1, 16):
                    prefetch_hint(floats, first + c)
        seq = locs[j] >> POS_BITS
        pos = locs[j] & POS_MASK
        if pos >= nrows[seq]:
            return 2 * j
        start = base[seq] + pos * (width + summed[seq])
        dst = at[j]
        for k in range(width):  # (a loop: a slice assignment compiles its shape error)
            out_rows[dst, k] = floats[start + k]
        # (summed from the copy: a row in cache, contiguous, while the next rows' loads run)
        if check and summed[seq] and row_sum(out_words[at[j]], 0, width, ids[j], weights) != words[start + width]:
            return 2 * j + 1
    return -1


@numba.njit(parallel=True, cache=True, nogil=True)
def gather_split(floats, base, nrows, summed, locs, ids, width, out_rows, at, weights, check, parts):
    """:func:`gather` over ``parts`` consecutive slices of the rows at once, on Numba's threads
    (each row's copy and check is its own).  Returns what :func:`gather` would: the code of the
    first row in order that fails (a later slice may have copied rows past it meanwhile; the
    caller raises either way), else -1."""
    n = locs.shape[0]
    codes = np.full(parts, -1, dtype=np.int64)
    for c in numba.prange(parts):
        lo = n * c // parts
        hi = n * (c + 1) // parts
        code = gather(floats, base, nrows, summed, locs[lo:hi], ids[lo:hi], width, out_rows, at[lo:hi], weights, check)
        if code >= 0:
            codes[c] = code + 2 * lo
    for c in range(parts):
        if codes[c] >= 0:
            return codes[c]
    return -1


@kernel(parallel=True)
def _pack_rows(ids, words, records, weights):
    n, width = words.shape
    for i in numba.prange(n):
        dst = records[i]
        for k in range(width):
            dst[k] = words[i, k]
        dst[width] = np.uint32(row_sum(dst, 0, width, ids[i], weights))


@numba.njit(parallel=True, cache=True, nogil=True)  # (Numba's lowering of the reduction allocates)
def _take_checked(records, src_at, ids, out, dst_at, width, weights):
    n = src_at.shape[0]
    checked = records.shape[1] > width
    first = n
    for i in numba.prange(n):
        s = src_at[i]
        src = records[s]
        dst = out[dst_at[i]]
        for k in range(width):
            dst[k] = src[k]
        if checked and np.uint32(row_sum(dst, 0, width, ids[s], weights)) != src[width]:
            first = min(first, i)
    return first if first < n else -1


def take_checked(records: np.ndarray, src_at: np.ndarray, ids: np.ndarray, out: np.ndarray, dst_at: np.ndarray) -> int:
    """``out[dst_at[i]] = records[src_at[i], :W]`` (uint32; W: ``out``'s width) for every ``i``,
    each row checked against its checksum under ``ids[src_at[i]]`` where ``records`` carries
    one (a word past W; a version 1 segment does not), rows side by side on Numba's threads.
    Returns the first ``i`` whose row fails its check, or -1 (every row is copied either way)."""
    width = out.shape[1]
    return int(_take_checked(records, src_at, ids, out, dst_at, width, sum_weights(width)))


def pack_rows(ids: np.ndarray, words: np.ndarray, records: np.ndarray) -> None:
    """``records[:, :W] = words`` and ``records[:, W]`` = each row's checksum under its id
    (:func:`.codec.row_sums`, by its twin :func:`row_sum`), rows side by side on Numba's
    threads: ``encode_segment``'s ``pack``, one pass over the rows instead of NumPy's five."""
    _pack_rows(ids, words, records, sum_weights(words.shape[1]))


__all__ = ["MappedFile", "gather", "gather_split", "pack_rows", "row_sum", "take_checked", "value_offset"]
