"""``tiered-emb delete``: delete rows of a store, durably, and with ``--purge`` take their bytes
out of its files.

A delete sets a tombstone for each row (:meth:`tiered_emb.TieredStore.delete`) and
checkpoints.  ``--purge`` then rewrites every segment of the table that holds a stale copy
(compaction of every run, however few stale rows it has: :meth:`.SsdTier.purge`) and
rewrites ``data.mdb`` without the pages LMDB freed (its compacting copy, ``mdb_copy -c``),
so that the deleted rows' bytes are in no file of the store, unless a kept checkpoint
(``TierConfig.keep_checkpoints``) still reads them: its rows are kept whole.  The ids are
read from a ``.npy`` file a slice at a time (memory: the store's budget and one slice).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lmdb
import numpy as np

from tiered_emb import _directory
from tiered_emb._options import add_command
from tiered_emb.apps.portable import read_npy_header
from tiered_emb.errors import ConfigError, IdTypeError, StoreLockedError
from tiered_emb.sim.bench import emit_json
from tiered_emb.store import TieredStore

#: Ids deleted per call of ``store.delete`` (the slice of the ``.npy`` read at a time).
DELETE_SLICE = 1 << 20
#: The directory a purge writes its copy of ``data.mdb`` in, inside the store's ``lmdb/``.
VACUUM_DIR = "vacuum.tmp"


class IdsFile:
    """The ids of a 1-D integer ``.npy`` file, read a slice at a time (no map of it stays)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                _, shape, _, dtype = read_npy_header(f)
                self.offset = f.tell()
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"IDS {str(path)!r} cannot be read as a .npy file ({err})", "save the ids with numpy.save"
            ) from err
        if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
            raise IdTypeError(f"IDS {str(path)!r} holds {dtype} of shape {shape}", "save a 1-D array of integer ids")
        self.shape, self.dtype = shape, dtype

    def slices(self, rows: int):
        """The ids, ``rows`` at a time."""
        for a in range(0, self.shape[0], rows):
            n = min(rows, self.shape[0] - a)
            yield np.fromfile(self.path, dtype=self.dtype, count=n, offset=self.offset + a * self.dtype.itemsize)


def delete_rows(path: str | os.PathLike[str], table: str, ids: IdsFile, purge: bool = False) -> dict:
    """Delete the ids of ``ids`` from ``table`` in the store at ``path`` and checkpoint; with
    ``purge`` also rewrite what holds their old bytes (see the module docstring).  Returns a report."""
    path = Path(path)
    store = TieredStore.open(path)
    try:
        store.engine.check_ids(table, np.empty(0, np.int64))  # (an unknown table before any slice is read)
        for part in ids.slices(DELETE_SLICE):
            store.delete(table, part)
        epoch = store.checkpoint()
        if purge:
            with store.engine.lock:
                store.engine.ssd.purge([table])
    except BaseException:
        store.close(checkpoint=False)
        raise
    store.close()
    report = {"table": table, "ids": int(ids.shape[0]), "checkpoint": epoch, "purged": purge}
    if purge:
        report["file_bytes_before"], report["file_bytes_after"] = vacuum(path)
    return report


def vacuum(path: Path) -> tuple[int, int]:
    """Rewrite the ``data.mdb`` of the closed store at ``path`` without LMDB's free pages:
    its compacting copy, synced, renamed over it.  Holds the store's writer lock; refuses
    while a reader has the store open (its snapshot may read the freed pages).  Returns
    the file's bytes before and after."""
    lock_fd = _directory.lock(path)
    try:
        lmdb_dir = path / "lmdb"
        tmp = lmdb_dir / VACUUM_DIR
        if tmp.exists():  # (what a killed purge left: made by this command)
            shutil.rmtree(tmp)
        env = lmdb.open(str(lmdb_dir), readonly=True, max_dbs=0)
        try:
            if _other_readers(env):
                raise StoreLockedError(
                    f"{path} has readers open (TieredStore.open(..., mode='r'))",
                    "close them, then run the purge again (the rows are deleted already)",
                )
            tmp.mkdir()
            env.copy(str(tmp), compact=True)
        finally:
            env.close()
        before = (lmdb_dir / "data.mdb").stat().st_size
        fd = os.open(tmp / "data.mdb", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp / "data.mdb", lmdb_dir / "data.mdb")
        _directory.fsync_dir(lmdb_dir)
        tmp.rmdir()
        return before, (lmdb_dir / "data.mdb").stat().st_size
    finally:
        os.close(lock_fd)


def _other_readers(env) -> bool:
    """Whether LMDB's reader table lists a process other than this one."""
    for line in env.readers().splitlines():
        words = line.split()
        if words and words[0].isdigit() and int(words[0]) != os.getpid():
            return True
    return False


def add_parser(sub) -> None:
    p = add_command(sub, "delete", "delete rows of a store (durably; --purge: their bytes out of its files)")
    p.add_argument("path", help="the store")
    p.add_argument("table", help="the table")
    p.add_argument("ids", help="a .npy file of the ids to delete (1-D, integers)")
    p.add_argument(
        "--purge",
        action="store_true",
        help="then rewrite the segments holding old copies and data.mdb without its free pages "
        "(a kept earlier checkpoint keeps its rows; refused while readers are open)",
    )
    p.set_defaults(func=_run)


def _run(args) -> int:
    report = delete_rows(args.path, args.table, IdsFile(Path(args.ids)), args.purge)
    if emit_json(args.json, report):
        return 0
    if not args.quiet:
        purged = (
            f"; purged: data.mdb {report['file_bytes_before']:,} -> {report['file_bytes_after']:,} bytes"
            if args.purge
            else ""
        )
        print(f"deleted {report['ids']:,} ids of table {args.table!r} (checkpoint {report['checkpoint']}){purged}")
    return 0


__all__ = ["IdsFile", "delete_rows", "vacuum"]
