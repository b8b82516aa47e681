"""The ids ever written to the SSD tier, a bit each, per table with ``num_rows``.

Built from the keys of ``t:`` when the store opens (and from the segments of ``p:`` when
it keeps them), set by every write before its rows become visible: a read looks (in the
write-back buffers, the staged reads and LMDB) only for ids whose bit is set.  Most rows
a young store brings up were never written (they are initialised), and looking for them
costs as much as finding one.
"""

from __future__ import annotations

import itertools

import numba
import numpy as np

from tiered_emb._jit import kernel
from tiered_emb.errors import CorruptStoreError
from tiered_emb.tiers.ssd.lmdb_env import LmdbEnv


@kernel
def _set_bits(bits, ids):
    """Set the bit of each of ``ids`` (int64, each < 8 * len(bits)) in ``bits`` (uint8)."""
    for i in range(ids.shape[0]):
        x = ids[i]
        bits[x >> 3] |= np.uint8(1 << (x & 7))


@numba.njit(cache=True, nogil=True)
def _with_bit(bits, ids, at):
    """The entries of ``at`` (int64) whose id ``ids[at[j]]`` has its bit set, in order."""
    out = np.empty(at.shape[0], dtype=np.int64)
    m = 0
    for j in range(at.shape[0]):
        x = ids[at[j]]
        if bits[x >> 3] & (1 << (x & 7)):
            out[m] = at[j]
            m += 1
    return out[:m]


class WrittenIds:
    """Per table, a bitmap (uint8 (ceil(num_rows / 8),)) of the ids written here, or None
    (a table without ``num_rows``: every id is looked for).  Bits are only ever set, before
    the rows enter the write-back buffer or an LMDB transaction, so a clear bit means the
    id is held nowhere here."""

    def __init__(self, lmdb_env: LmdbEnv):
        self._lmdb = lmdb_env
        self._bits: dict[str, np.ndarray | None] = {}

    def load(self, table: str, num_rows: int | None) -> None:
        """Build the bitmap of ``table`` from the keys of its ``t:`` (None without ``num_rows``)."""
        self._bits[table] = None if num_rows is None else self._bits_from_keys(table, int(num_rows))

    def _bits_from_keys(self, table: str, num_rows: int) -> np.ndarray:
        """The bitmap of the ids stored in ``t:`` of ``table`` (one walk over the keys, a
        million at a time); the segment log adds ``p:``'s when it loads them."""
        bits = np.zeros((num_rows + 7) // 8, dtype=np.uint8)
        with self._lmdb.reading() as txn:
            for db in (self._lmdb.main[table],):
                with txn.cursor(db=db) as cur:
                    keys = cur.iternext(keys=True, values=False)
                    while True:
                        ids = np.frombuffer(b"".join(itertools.islice(keys, 1 << 20)), dtype=">i8").astype(np.int64)
                        if ids.shape[0] == 0:
                            break
                        if ids.min() < 0 or ids.max() >= num_rows:
                            raise CorruptStoreError(
                                f"table {table!r} in {self._lmdb.path} holds ids outside [0, {num_rows})",
                                "open it with the num_rows it was created with",
                            )
                        _set_bits(bits, ids)
        return bits

    def set(self, table: str, ids: np.ndarray) -> None:
        """Set the written bits of ``ids`` (under the tier's lock: setting a bit rewrites its
        whole byte, so two threads setting bits of one byte at once could lose one)."""
        bits = self._bits[table]
        if bits is not None:
            _set_bits(bits, np.ascontiguousarray(ids, dtype=np.int64))

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bits.values() if b is not None)

    def maybe_stored(self, table: str, ids: np.ndarray, at: np.ndarray) -> np.ndarray:
        """The entries of ``at`` whose id may be held here (all of them without a bitmap)."""
        bits = self._bits[table]
        return at if bits is None or at.shape[0] == 0 else _with_bit(bits, ids, at)
