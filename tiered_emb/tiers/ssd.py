"""The SSD tier: every row ever written, in one LMDB environment per store.

Two named databases per table:

- ``t:<table>``: rows as of the last checkpoint;
- ``p:<table>``: rows written back since (dirty evictions and :meth:`flush`).

A read looks in ``p:`` first, then ``t:``.  :meth:`checkpoint` moves ``p:`` into ``t:``
and writes the store's meta record in *one* write transaction, so LMDB's atomic commit
makes the checkpoint a single durable point: reopening drops ``p:`` and finds exactly
the last checkpoint (or keeps it, with ``restore="latest"``).

Keys are the id as 8 big-endian bytes (LMDB's byte order is then id order); a value is
one tag byte (0 raw, 1 zstd) and the record's float32 bytes: weights, then optimizer
state.  The map doubles by itself when full; a full disk raises
:class:`~tiered_emb.errors.StoreFullError` after the transaction is rolled back.
"""
from __future__ import annotations

import errno
import json
from pathlib import Path

import lmdb
import numpy as np
import zstandard

from ..errors import CorruptStoreError, StoreFullError, StoreLockedError

_RAW = 0
_ZSTD = 1
_META_DB = b"meta"


class SsdTier:
    def __init__(self, path: Path, table_widths: dict[str, int], compression: int | None,
                 map_size_bytes: int, writeback_rows: int = 1 << 16):
        self.path = Path(path)
        # Write-backs of evicted rows wait here (table -> {id: encoded record}, the newest
        # copy of those rows) and go to the since-checkpoint databases in one transaction
        # once ``writeback_rows`` are waiting: one commit (and fsync) per many steps
        # instead of one per table per step.
        self.writeback_rows = int(writeback_rows)
        self._wb: dict[str, dict[int, bytes]] = {n: {} for n in sorted(table_widths)}
        self.widths = dict(table_widths)
        self.compression = compression
        self._zc = zstandard.ZstdCompressor(level=compression) if compression else None
        self._zd = zstandard.ZstdDecompressor()
        try:
            self.env = lmdb.open(str(self.path), map_size=map_size_bytes, max_dbs=2 * len(self.widths) + 2,
                                 subdir=True, readahead=False, meminit=False, max_readers=64)
            self._meta = self.env.open_db(_META_DB)
            self._main = {n: self.env.open_db(b"t:" + n.encode()) for n in sorted(self.widths)}
            self._pending = {n: self.env.open_db(b"p:" + n.encode()) for n in sorted(self.widths)}
        except lmdb.LockError as err:
            raise StoreLockedError(f"LMDB environment {self.path} is locked", "close the other writer first") from err
        except (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.BadValsizeError,
                lmdb.PageNotFoundError) as err:
            raise CorruptStoreError(f"LMDB environment {self.path} is corrupt or not an LMDB file ({err})",
                                    "restore the store directory from a backup") from err
        except lmdb.Error as err:
            raise CorruptStoreError(f"LMDB environment {self.path} cannot be opened ({err})",
                                    "check the store directory and its permissions") from err
        self._n_pending = {n: self._entries(self._pending[n]) for n in self.widths}

    # ----------------------------------------------------------------- encoding
    def _encode(self, row: np.ndarray) -> bytes:
        raw = row.tobytes()
        if self._zc is None:
            return bytes((_RAW,)) + raw
        return bytes((_ZSTD,)) + self._zc.compress(raw)

    def _encode_many(self, rows: np.ndarray) -> list[bytes]:
        """:meth:`_encode` of each row of ``rows`` (k, W) float32; uncompressed ones built as one array."""
        if self._zc is not None:
            return [self._encode(r) for r in rows]
        k = rows.shape[0]
        size = 1 + rows.shape[1] * 4
        payload = np.empty((k, size), dtype=np.uint8)
        payload[:, 0] = _RAW
        payload[:, 1:] = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(k, -1)
        b = payload.tobytes()
        return [b[i * size:(i + 1) * size] for i in range(k)]

    def _decode(self, value, out_row: np.ndarray) -> None:
        tag = value[0]
        body = bytes(value[1:])
        if tag == _ZSTD:
            body = self._zd.decompress(body)
        elif tag != _RAW:
            raise CorruptStoreError(f"an LMDB record of {self.path} has unknown tag {tag}", "restore from a backup")
        if len(body) != out_row.nbytes:
            raise CorruptStoreError(f"an LMDB record of {self.path} has {len(body)} bytes, expected {out_row.nbytes}",
                                    "restore from a backup")
        out_row[:] = np.frombuffer(body, dtype=np.float32)

    @staticmethod
    def _key(i: int) -> bytes:
        return int(i).to_bytes(8, "big")

    # ----------------------------------------------------------------- reads
    def read(self, table: str, ids: np.ndarray, out_rows: np.ndarray) -> np.ndarray:
        """Read the records of ``ids`` (int64 (k,), distinct) into ``out_rows`` (k, W); returns the found mask (bool (k,)).

        Newest copy first: the write-back buffer, then ``p:``, then ``t:``.  Each
        database is read with one ``getmulti`` over the keys in order (the B-tree walk
        runs in C) and uncompressed records are decoded as one array.
        """
        found = np.zeros(ids.shape[0], dtype=bool)
        if ids.shape[0] == 0:
            return found
        wb = self._wb[table]
        if wb:
            for i, row_id in enumerate(ids.tolist()):
                v = wb.get(row_id)
                if v is not None:
                    self._decode(v, out_rows[i])
                    found[i] = True
        dbs = ([self._pending[table]] if self._n_pending[table] > 0 else []) + [self._main[table]]
        try:
            with self.env.begin(buffers=True) as txn:
                for db in dbs:
                    todo = np.flatnonzero(~found)
                    if todo.shape[0] == 0:
                        break
                    todo = todo[np.argsort(ids[todo], kind="stable")]  # key order: one sequential walk
                    keys = ids[todo].astype(">i8").tobytes()
                    with txn.cursor(db=db) as cur:
                        got = cur.getmulti([keys[8 * j:8 * j + 8] for j in range(todo.shape[0])])
                    if got:
                        self._decode_many(got, ids, todo, out_rows, found)
        except lmdb.Error as err:
            raise CorruptStoreError(f"reading table {table!r} from {self.path} failed ({err})",
                                    "restore the store directory from a backup") from err
        return found

    def _decode_many(self, got, ids, todo, out_rows, found) -> None:
        """Decode ``got`` ((key, value) pairs of ``getmulti`` over ``ids[todo]``, in key order) into ``out_rows``."""
        got_ids = np.frombuffer(b"".join(k for k, _ in got), dtype=">i8").astype(np.int64)
        at = todo[np.searchsorted(ids[todo], got_ids)]  # todo is sorted by id
        width = out_rows.shape[1]
        values = [v for _, v in got]
        if all(len(v) == 1 + 4 * width for v in values):  # every record raw-sized: decode as one array
            raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), 1 + 4 * width)
            if (raw[:, 0] == _RAW).all():
                out_rows[at] = np.ascontiguousarray(raw[:, 1:]).view(np.float32)
                found[at] = True
                return
        for j, v in enumerate(values):
            self._decode(v, out_rows[at[j]])
        found[at] = True

    # ----------------------------------------------------------------- writes
    def _write(self, fn) -> None:
        """Run ``fn(txn)`` in one write transaction; grow the map and retry when full."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as err:
                if isinstance(err, lmdb.DiskError) or getattr(err, "errno", None) == errno.ENOSPC or "No space" in str(err):
                    raise StoreFullError(f"the disk under {self.path} is full ({err}); the write was rolled back",
                                         "free disk space or move the store, then call flush()/checkpoint() again") from err
                raise CorruptStoreError(f"writing to {self.path} failed ({err}); the write was rolled back",
                                        "check the disk and the store directory") from err

    def _put_rows(self, txn, db, ids: np.ndarray, rows: np.ndarray) -> None:
        order = np.argsort(ids, kind="stable")  # key order; a repeated id's last row wins
        keys = ids[order].astype(">i8").tobytes()
        values = self._encode_many(rows[order])
        with txn.cursor(db=db) as cur:
            cur.putmulti([(keys[8 * j:8 * j + 8], v) for j, v in enumerate(values)])

    def write_pending(self, batches: dict[str, tuple[np.ndarray, np.ndarray]], durable: bool = True) -> int:
        """Write ``{table: (ids, rows)}`` into the since-checkpoint databases; returns rows written.

        ``durable=False`` (write-backs of evicted rows): the rows wait in memory with the
        others until ``writeback_rows`` are waiting, then all go out in one transaction;
        reads see them at once.  ``durable=True`` writes them, and every waiting row, now.
        """
        batches = {t: b for t, b in sorted(batches.items()) if b[0].shape[0]}
        n = sum(b[0].shape[0] for b in batches.values())
        if not durable:
            for t, (ids, rows) in batches.items():
                self._wb[t].update(zip(ids.tolist(), self._encode_many(rows)))
            if sum(len(wb) for wb in self._wb.values()) >= self.writeback_rows:
                self.write_pending({}, durable=True)
            return n
        waiting = {t: wb for t, wb in self._wb.items() if wb}
        if not batches and not waiting:
            return 0

        def fn(txn):
            for t, wb in waiting.items():  # older than ``batches``: written first
                self._put_encoded(txn, self._pending[t], wb)
            for t, (ids, rows) in batches.items():
                self._put_rows(txn, self._pending[t], ids, rows)

        self._write(fn)
        for t in set(batches) | set(waiting):
            self._wb[t] = {}
            self._n_pending[t] = self._entries(self._pending[t])
        return n

    def _put_encoded(self, txn, db, records: dict[int, bytes]) -> None:
        with txn.cursor(db=db) as cur:
            cur.putmulti([(self._key(i), records[i]) for i in sorted(records)])

    def checkpoint(self, batches: dict[str, tuple[np.ndarray, np.ndarray]], meta: dict, extra: bytes | None) -> int:
        """Make ``batches`` and everything pending the new checkpoint, with ``meta``, atomically."""
        batches = {t: b for t, b in sorted(batches.items()) if b[0].shape[0]}

        def fn(txn):
            for t in sorted(self.widths):
                if self._n_pending[t]:
                    with txn.cursor(db=self._pending[t]) as cur:
                        pairs = [(bytes(k), bytes(v)) for k, v in cur]
                    with txn.cursor(db=self._main[t]) as cur:
                        cur.putmulti(pairs)
                    txn.drop(self._pending[t], delete=False)
                if self._wb[t]:
                    self._put_encoded(txn, self._main[t], self._wb[t])
                if t in batches:
                    self._put_rows(txn, self._main[t], *batches[t])
            txn.put(b"meta", json.dumps(meta, sort_keys=True).encode(), db=self._meta)
            if extra is not None:
                txn.put(b"extra", bytes(extra), db=self._meta)

        self._write(fn)
        for t in self.widths:
            self._n_pending[t] = 0
            self._wb[t] = {}
        self.env.sync(True)
        return sum(b[0].shape[0] for b in batches.values())

    def discard_pending(self) -> None:
        """Drop what was written since the last checkpoint (reopen at the checkpoint)."""
        def fn(txn):
            for t in sorted(self.widths):
                txn.drop(self._pending[t], delete=False)
        self._write(fn)
        self._n_pending = {t: 0 for t in self.widths}

    def promote_pending(self) -> None:
        """Keep what was written since the last checkpoint (reopen at the latest flush)."""
        self.checkpoint({}, self.read_meta(), None)

    def read_meta(self) -> dict:
        with self.env.begin() as txn:
            v = txn.get(b"meta", db=self._meta)
        if v is None:
            raise CorruptStoreError(f"the LMDB environment {self.path} has no meta record",
                                    "the store was never checkpointed; recreate it or restore a backup")
        try:
            return json.loads(bytes(v))
        except ValueError as err:
            raise CorruptStoreError(f"the meta record of {self.path} is not JSON", "restore from a backup") from err

    def read_extra(self) -> bytes | None:
        with self.env.begin() as txn:
            v = txn.get(b"extra", db=self._meta)
        return None if v is None else bytes(v)

    # ----------------------------------------------------------------- introspection
    def _entries(self, db) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(db)["entries"])

    def table_stats(self, table: str) -> dict:
        with self.env.begin() as txn:
            out = {}
            for label, db in (("rows", self._main[table]), ("pending_rows", self._pending[table])):
                st = txn.stat(db)
                out[label] = int(st["entries"])
                out[label.replace("rows", "bytes")] = int(st["psize"] * (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]))
        out["writeback_rows"] = len(self._wb[table])  # waiting in memory for the next write
        return out

    def file_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def close(self) -> None:
        self.env.close()
