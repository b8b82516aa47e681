"""The SSD tier's LMDB environment: opening it, its databases, map growth, typed errors.

One environment per store, with a ``meta`` database (the checkpoint's meta record and a
trainer's extra bytes) and two per table: ``t:<table>`` (rows as of the last checkpoint)
and ``p:<table>`` (segments written since).  The map doubles by itself when full: LMDB
allows a resize only with no transaction open in this process, so every read transaction
goes through :attr:`LmdbEnv.gate`.  Every LMDB error is raised as one of the typed errors
of :mod:`tiered_emb.errors`, with the lmdb error as its cause.
"""

from __future__ import annotations

import errno
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import lmdb

from tiered_emb.errors import (
    ConfigError,
    CorruptStoreError,
    StoreFullError,
    StoreLockedError,
)
from tiered_emb.tiers.ssd.writer_main import disk_full

META_DB = b"meta"
#: Bytes of LMDB's lock file given their disk blocks before LMDB maps it: a header and 64
#: bytes a reader slot, for far more readers than a store opens.
LOCK_FILE_BYTES = 64 << 10
#: Read transactions open at once, all processes together (the writer's threads and every
#: reader's snapshot and reads): the slots of LMDB's reader table.
MAX_READERS = 126


class TxnGate:
    """Readers of any thread against one exclusive holder: read transactions against a map
    resize (LMDB allows one only with no transaction open), reads of segments against the
    change that deletes some."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False

    def reading(self) -> TxnGate:
        """A reader's hold, for a ``with`` block (the gate itself: a read takes no state of
        its own, and every SSD read of a step passes here)."""
        return self

    def __enter__(self) -> None:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._readers -= 1
            if not self._readers:  # (the one waiting on readers: :meth:`exclusive`)
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._resizing or self._readers:
                self._cond.wait()
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class LmdbEnv:
    """The environment at ``path`` for ``tables`` (names), opened with ``map_size_bytes``.

    ``existing``: the store exists, and LMDB must hold a ``t:`` database for exactly
    ``tables``.  Attributes: :attr:`env` (the ``lmdb.Environment``), :attr:`gate`,
    :attr:`meta`, :attr:`main` / :attr:`pending` (table -> its ``t:`` / ``p:`` database), and
    :attr:`records` (table -> whether its ``t:`` holds rows).
    """

    def __init__(
        self, path: Path, tables: list[str], map_size_bytes: int, existing: bool = False, readonly: bool = False
    ):
        self.path = Path(path)
        self.max_dbs, self.max_readers = 2 * len(tables) + 2, MAX_READERS
        self.gate = TxnGate()
        self.readonly = readonly
        self._pinned = None  # a reader's read transaction: its snapshot (:meth:`pin`)
        self._pin_lock = threading.RLock()
        #: maps taken up (:meth:`begin_read`): each ended every transaction of the process
        self.map_resizes = 0
        if not readonly:
            reserve_lock_file(self.path)
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=map_size_bytes,
                max_dbs=self.max_dbs,
                subdir=True,
                readahead=False,
                meminit=False,
                # each commit syncs its pages; its meta page waits for the next commit or
                # sync (a checkpoint ends with one): atomic always, one sync a commit, not two
                metasync=False,
                max_readers=self.max_readers,
                readonly=readonly,
            )
            self._check_length()
            if existing:
                try:
                    self._check_tables(tables)
                except BaseException:
                    self.env.close()
                    raise
            create = not readonly
            self.meta = self.env.open_db(META_DB, create=create)
            self.main = {n: self.env.open_db(b"t:" + n.encode(), create=create) for n in sorted(tables)}
            self.pending = {n: self.env.open_db(b"p:" + n.encode(), create=create) for n in sorted(tables)}
            # whether ``t:`` holds rows (a store of the format before segments; never written since)
            with self.env.begin() as txn:
                self.records = {n: txn.stat(self.main[n])["entries"] > 0 for n in sorted(tables)}
        except lmdb.LockError as err:
            raise StoreLockedError(f"LMDB environment {self.path} is locked", "close the other writer first") from err
        except OverflowError as err:
            raise ConfigError(
                f"map_size_bytes={map_size_bytes} is more than LMDB can map ({err})",
                "use a smaller TierConfig.map_size_bytes (the map grows by itself when full)",
            ) from err
        except (
            lmdb.InvalidError,
            lmdb.CorruptedError,
            lmdb.VersionMismatchError,
            lmdb.BadValsizeError,
            lmdb.PageNotFoundError,
        ) as err:
            raise CorruptStoreError(
                f"LMDB environment {self.path} is corrupt or not an LMDB file ({err})",
                "restore the store directory from a backup",
            ) from err
        except lmdb.Error as err:
            if "already open in this process" in str(err):
                raise ConfigError(
                    f"the LMDB environment {self.path} is open in this process already (a store's "
                    f"writer or reader): LMDB opens a file once a process",
                    "read beside a writer from another process; in the writer's own process use its "
                    "lookup / peek (one reader a process)",
                ) from err
            if disk_full(err, self.path):
                raise StoreFullError(
                    f"the disk under {self.path} is full: its LMDB environment cannot be opened ({err})",
                    "free disk space or choose a path on another disk",
                ) from err
            raise CorruptStoreError(
                f"LMDB environment {self.path} cannot be opened ({err})",
                "check the store directory and its permissions",
            ) from err

    def _check_tables(self, tables: list[str]) -> None:
        """Raise CorruptStoreError unless LMDB holds a ``t:`` database for exactly the tables
        given (an existing store's manifest), before any is opened (opening one creates it):
        a table renamed in the manifest would otherwise answer with fresh rows while its own
        stayed out of reach."""
        with self.corrupt_on_error("listing the tables of"), self.env.begin() as txn:
            held = sorted(bytes(k)[2:].decode("utf-8", "replace") for k, _ in txn.cursor() if bytes(k)[:2] == b"t:")
        listed = sorted(tables)
        if held != listed:
            raise CorruptStoreError(
                f"the manifest lists tables {listed} but LMDB in {self.path} holds {held}",
                "restore manifest.json (or the store directory) from a backup",
            )

    def _check_length(self) -> None:
        """Raise CorruptStoreError when ``data.mdb`` is shorter than its last committed page:
        LMDB maps the file, and a page past its end would kill the process (SIGBUS) on first read."""
        need = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        have = (self.path / "data.mdb").stat().st_size
        if have < need:
            self.env.close()
            raise CorruptStoreError(
                f"LMDB file {self.path / 'data.mdb'} is truncated ({have} bytes, its pages reach {need})",
                "restore the store directory from a backup",
            )

    @contextmanager
    def corrupt_on_error(self, doing: str):
        """An LMDB error (a damaged page: wrong type, bad transaction) as :class:`CorruptStoreError`."""
        try:
            yield
        except lmdb.Error as err:
            raise CorruptStoreError(
                f"{doing} {self.path} failed ({type(err).__name__}: {err})", "restore the store directory from a backup"
            ) from err

    @contextmanager
    def reading(self, buffers: bool = False):
        """A read transaction, held against a map resize (``buffers``: values read in place);
        while :meth:`pin` holds one, that one (values always read in place)."""
        if self._pinned is not None:
            with self._pin_lock:
                yield self._pinned
            return
        with self.gate.reading(), self.env.begin(buffers=buffers) as txn:
            yield txn

    def begin_read(self, buffers: bool = True):
        """A read transaction of this environment's own (a map the writer grew is taken up)."""
        while True:
            try:
                return self.env.begin(buffers=buffers)
            except lmdb.MapResizedError:  # the writer grew the map: take its size
                self.env.set_mapsize(0)
                self.map_resizes += 1
            except lmdb.ReadersFullError as err:
                raise CorruptStoreError(
                    f"LMDB's reader table of {self.path} is full ({err})",
                    "close readers that are not needed, or end stuck ones (docs/durability.md)",
                ) from err

    def pin(self, txn=None):
        """Make ``txn`` (a new read transaction by default) the one every read uses: a reader's
        snapshot, whose pages stay as they are whatever the writer does.  Returns the one
        pinned before (still open: the caller ends it, or pins it back)."""
        with self._pin_lock:
            old, self._pinned = self._pinned, txn if txn is not None else self.begin_read()
            return old

    def unpin(self) -> None:
        with self._pin_lock:
            if self._pinned is not None:
                self._pinned.abort()
                self._pinned = None

    def clear_dead_readers(self) -> int:
        """Free the reader slots of processes that died in a read transaction (they would keep
        the pages of their snapshot from reuse); returns how many."""
        return int(self.env.reader_check())

    def write(self, fn, buffers: bool = False) -> None:
        """Run ``fn(txn)`` in one write transaction; grow the map and retry when full.
        ``buffers``: values read in place (each valid until the transaction's next write)."""
        while True:
            try:
                with self.env.begin(write=True, buffers=buffers) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self.grow_map()
            except lmdb.Error as err:
                if disk_full(err, self.path):
                    raise StoreFullError(
                        f"the disk under {self.path} is full ({err}); the write was rolled back",
                        "free disk space or move the store, then call flush()/checkpoint() again",
                    ) from err
                raise CorruptStoreError(
                    f"writing to {self.path} failed ({err}); the write was rolled back",
                    "check the disk and the store directory",
                ) from err

    def close(self) -> None:
        self.unpin()
        self.env.close()

    def grow_map(self) -> None:
        """Double the map, once no read transaction is open."""
        with self.gate.exclusive():
            self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def entries(self, db) -> int:
        """Records (or segments) in ``db``."""
        with self.reading() as txn:
            return int(txn.stat(db)["entries"])

    def db_stats(self, table: str) -> dict:
        """``rows`` / ``bytes`` of ``t:<table>`` and ``pending_rows`` / ``pending_bytes`` of
        its ``p:`` (its entries, and the bytes of its pages)."""
        with self.reading() as txn:
            out = {}
            for label, db in (("rows", self.main[table]), ("pending_rows", self.pending[table])):
                st = txn.stat(db)
                out[label] = int(st["entries"])
                out[label.replace("rows", "bytes")] = int(
                    st["psize"] * (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"])
                )
        return out


def reserve_lock_file(path: Path) -> None:
    """Give LMDB's lock file (``path/lock.mdb``) its disk blocks before LMDB maps it.

    LMDB sizes the lock file with ftruncate, a sparse file, and writes it through a memory
    map: on a full disk the first write to a page with no block kills the process with
    SIGBUS instead of failing.  Allocated here, the blocks are there, or the lack of them
    is a :class:`StoreFullError`.  A filesystem without ``posix_fallocate`` is left to LMDB.
    """
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size < LOCK_FILE_BYTES:
            os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise StoreFullError(
                f"the disk under {path} is full: LMDB's lock file cannot be made ({err})",
                "free disk space or choose a path on another disk",
            ) from err
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise CorruptStoreError(f"LMDB's lock file in {path} cannot be made ({err})", "check the disk") from err
    finally:
        os.close(fd)
