"""The store's directory on disk: its manifest, its writer lock, fsyncs, and half-made stores.

A store directory holds ``LOCK`` (a writer's exclusive ``flock``), ``lmdb/`` (the rows)
and ``manifest.json`` (format, seed, tables, tiers), written last by ``create()``: a
directory with the lock file and LMDB files but no manifest is what a ``create()`` killed
midway leaves (*half-made*), which the next ``create()`` starts over and ``open()`` names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.errors import (
    ConfigError,
    CorruptStoreError,
    StoreExistsError,
    StoreFormatError,
    StoreFullError,
    StoreLockedError,
    StoreNotFoundError,
)

FORMAT = "tiered_emb/3"
#: The format before: rows of the last checkpoint as one LMDB record per id in ``t:``, the
#: rows written since as segments.  It opens as it is: ``t:`` is read below the segments and
#: never written again; the manifest then says FORMAT.
FORMAT_2 = "tiered_emb/2"
#: Formats no release reads: a store of one is refused with :class:`StoreFormatError`.
REFUSED_FORMATS = ("tiered_emb/1",)


def refuse_existing(path: Path) -> None:
    """StoreExistsError unless ``path`` is free for a new store (absent, or half-made)."""
    if path.exists() and not half_made(path, look_inside=False):
        raise StoreExistsError(
            f"store path {str(path)!r} already exists", "open it with TieredStore.open, or choose a new path"
        )


def make(path: Path) -> int:
    """Make the directory of a new store at ``path`` (checked by :func:`refuse_existing`) and
    take its lock; returns the lock's file descriptor.  A half-made store there (what a
    killed ``create()`` leaves) loses its LMDB files, to start over.
    """
    refuse_existing(path)
    was_half_made = half_made(path, look_inside=False)
    new_dirs = [] if was_half_made else [p for p in (path, *path.parents) if not p.exists()]
    if not was_half_made:
        try:
            path.mkdir(parents=True)
        except FileExistsError as err:
            if path.is_dir():  # another create() made it since refuse_existing(): it won the race
                raise StoreExistsError(
                    f"store path {str(path)!r} was made by another create() meanwhile",
                    "open it with TieredStore.open (once that create() has finished), or choose a new path",
                ) from err
            raise ConfigError(
                f"store path {str(path)!r} cannot be made ({err})",
                "choose a path whose parents are directories (or do not exist yet)",
            ) from err
        except NotADirectoryError as err:  # a file where a parent directory should be
            raise ConfigError(
                f"store path {str(path)!r} cannot be made ({err})",
                "choose a path whose parents are directories (or do not exist yet)",
            ) from err
    lock_fd = lock(path)  # a create still running there holds it: StoreLockedError
    if was_half_made and not half_made(path):  # looked at again, inside, under the lock
        os.close(lock_fd)
        raise StoreExistsError(
            f"store path {str(path)!r} holds an LMDB store without its manifest.json",
            "restore manifest.json from a backup, or choose a new path",
        )
    try:
        for d in reversed(new_dirs):  # each new directory's entry in its parent
            fsync_dir(d.parent)
        if was_half_made:  # a create() killed before its manifest: start it over
            shutil.rmtree(path / "lmdb", ignore_errors=True)
            (path / "manifest.json.tmp").unlink(missing_ok=True)
    except BaseException:
        unmake(path, lock_fd)
        raise
    return lock_fd


def unmake(path: Path, lock_fd: int) -> None:
    """Undo :func:`make` after a failed create: release the lock and remove the directory
    (it did not exist before, or was half-made: a retry finds no half-made store)."""
    os.close(lock_fd)
    shutil.rmtree(path, ignore_errors=True)


def read_manifest(path: Path) -> tuple[dict[str, Any], list[TableConfig], TierConfig, int]:
    """``(manifest, tables, stored tiers, seed)`` of the store at ``path``, checked.

    StoreNotFoundError when there is none (or only a half-made one), CorruptStoreError
    when the manifest is damaged (:func:`check_data_file` checks the LMDB data file).
    """
    manifest_path = path / "manifest.json"
    if half_made(path):
        raise StoreNotFoundError(
            f"{str(path)!r} holds a store whose create() did not finish (no manifest.json, no rows)",
            "call TieredStore.create on it again: it starts a half-made store over",
        )
    if not manifest_path.is_file():
        raise StoreNotFoundError(
            f"no store at {str(path)!r} (no manifest.json)", "check the path, or make one with TieredStore.create"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
        if manifest.get("format") in REFUSED_FORMATS:
            raise StoreFormatError(
                f"{str(path)!r} is a store of format {manifest['format']}, which this version does not read "
                f"(it reads {FORMAT} and {FORMAT_2})",
                "rebuild it from its source (or an export of it, tiered-emb export) with this version",
            )
        if manifest.get("format") not in (FORMAT, FORMAT_2):
            raise ValueError(f"format {manifest.get('format')!r}")
        tables = [TableConfig.from_dict(t) for t in manifest["tables"]]
        stored_tiers = TierConfig(**manifest["tiers"])
        seed = manifest["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ValueError(f"seed {seed!r}")
    except StoreFormatError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CorruptStoreError(
            f"manifest {str(manifest_path)!r} is corrupt ({type(err).__name__}: {err})",
            "restore the store directory from a backup",
        ) from err
    return manifest, tables, stored_tiers, seed


def check_data_file(path: Path) -> None:
    """CorruptStoreError unless the store at ``path`` has its LMDB data file."""
    if not (path / "lmdb" / "data.mdb").is_file():
        raise CorruptStoreError(
            f"store {str(path)!r} has no LMDB data file (lmdb/data.mdb)", "restore the store directory from a backup"
        )


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically and durably (a temporary file, fsynced, renamed over
    the old one, the directory fsynced so that the rename survives a power loss)."""
    tmp = path / "manifest.json.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / "manifest.json")
        fsync_dir(path)  # the rename itself: without this a power loss may undo it
    except OSError as err:  # the rows are committed in LMDB by then; only the manifest is behind
        if err.errno == errno.ENOSPC:
            raise StoreFullError(
                f"the disk under {str(path)!r} is full writing manifest.json ({err})",
                "free disk space; the next checkpoint() or close() writes it again",
            ) from err
        raise CorruptStoreError(
            f"writing {str(tmp)!r} failed ({err})", "check the disk and the store directory's permissions"
        ) from err


def half_made(path: Path, look_inside: bool = True) -> bool:
    """Whether ``path`` is what a :meth:`TieredStore.create` killed before its manifest leaves:
    a directory of nothing but its lock file and LMDB files, no ``manifest.json``, and (with
    ``look_inside``; call it holding the lock) an LMDB environment holding no row and no
    checkpoint past the first.  A finished store that lost its manifest is not one."""
    try:
        top = {p.name for p in path.iterdir()}
        lmdb_files = {p.name for p in (path / "lmdb").iterdir()} if (path / "lmdb").is_dir() else set()
    except OSError:  # absent, not a directory, unreadable
        return False
    if not ("LOCK" in top and top <= {"LOCK", "lmdb", "manifest.json.tmp"} and lmdb_files <= {"data.mdb", "lock.mdb"}):
        return False
    return not look_inside or "data.mdb" not in lmdb_files or _holds_nothing(path / "lmdb")


def _holds_nothing(lmdb_dir: Path) -> bool:
    """True when the LMDB environment at ``lmdb_dir`` has no row in any table and no meta
    record past epoch 0; False when it has, or cannot be read (then nothing is replaced)."""
    import lmdb

    from tiered_emb.tiers.ssd.snapshots import unseal

    try:
        env = lmdb.open(str(lmdb_dir), readonly=True, lock=False, max_dbs=4096, subdir=True)
    except lmdb.Error:
        return False
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                if name == b"meta":
                    meta = txn.get(b"meta", db=db)
                    if meta is not None and json.loads(unseal(meta, "meta", lmdb_dir)).get("epoch", 0) != 0:
                        return False
                elif txn.stat(db)["entries"]:
                    return False
        return True
    except (lmdb.Error, ValueError, AttributeError, CorruptStoreError):
        return False
    finally:
        env.close()


def fsync_dir(path: Path) -> None:
    """fsync a directory: makes the renames and creations of entries in it durable (POSIX
    leaves them in the page cache until then, so a power loss could bring back the old
    ``manifest.json`` beside a newer checkpoint).

    Best effort where it cannot be done: a directory one may write but not list (mode
    0333) cannot be opened to fsync, and some filesystems refuse fsync on a directory
    (EINVAL); those are skipped, as databases do.  Other errors (EIO) are a
    :class:`CorruptStoreError`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM):
            return
        raise CorruptStoreError(
            f"directory {str(path)!r} cannot be opened to fsync it ({err})", "check the disk and the directory"
        ) from err
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise CorruptStoreError(f"fsync of directory {str(path)!r} failed ({err})", "check the disk") from err
    finally:
        os.close(fd)


def lock(path: Path) -> int:
    """Take the store's writer lock (an exclusive ``flock`` on ``LOCK``); StoreLockedError if held."""
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        os.close(fd)
        raise StoreLockedError(
            f"store {str(path)!r} is held by another writer", "close the other TieredStore (or process) using it first"
        ) from err
    return fd
