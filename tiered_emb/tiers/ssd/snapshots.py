"""The records of LMDB's ``meta`` database: the last checkpoint and those kept before it.

Each checkpoint is numbered by its epoch (0 for the empty store ``create()`` makes, then
1, 2, ...).  Its own transaction puts ``meta`` (the meta record, JSON) and ``mark`` (the
number of the first segment after it), and beside them ``snap:<epoch>`` (its mark and
meta record) and, when the trainer passed bytes, ``snapx:<epoch>`` (a checkpoint's
``extra`` is that of the newest ``snapx`` at or before it); it deletes the records of
the oldest beyond the number kept (``TierConfig.keep_checkpoints``).  Every record is
*sealed*: ``b"TSM1"``, the CRC-32 of the payload, the payload, so that damage is an
error, never a wrong mark (a mark one too low would make an open delete the checkpoint's
own rows).  Records of stores written before seals are read as they are.

The rows of a kept checkpoint are the newest copy of each id in the segments below its
mark: :mod:`.compaction` never merges segments across a kept mark, and keeps the copy a
kept checkpoint reads.  Going back to a kept checkpoint (:func:`back_to`) also puts
``going_back``, removed once the segments after it are deleted: an open that finds it
finishes the deletions whatever restore point it was asked for.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from tiered_emb.errors import CorruptStoreError, SnapshotNotFoundError

SNAP = b"snap:"
SNAPX = b"snapx:"
SNAPA = b"snapa:"
TOUCH = b"touch:"
SEAL = b"TSM1"
GOING_BACK = b"going_back"


def _key(prefix: bytes, epoch: int) -> bytes:
    return prefix + int(epoch).to_bytes(8, "big")


def seal(payload: bytes) -> bytes:
    """``payload`` as stored: the seal's magic, its CRC-32, then the payload."""
    return SEAL + zlib.crc32(payload).to_bytes(4, "little") + payload


def unseal(value, what: str, path: Path | None) -> bytes:
    """The payload of a stored record (a record written before seals: as it is)."""
    value = bytes(value)
    if not value.startswith(SEAL):
        return value
    payload = value[8:]
    if len(value) < 8 or zlib.crc32(payload) != int.from_bytes(value[4:8], "little"):
        raise CorruptStoreError(
            f"the {what} record in {path} is damaged (its CRC-32 does not match)",
            "restore the store directory from a backup (tiered-emb verify PATH lists the damage)",
        )
    return payload


def _get(txn, db, key: bytes, path: Path | None) -> bytes | None:
    value = txn.get(key, db=db)
    return None if value is None else unseal(value, key.decode("ascii", "replace"), path)


def _json(payload: bytes, what: str, path: Path | None):
    try:
        return json.loads(payload)
    except ValueError as err:
        raise CorruptStoreError(f"the {what} record of {path} is not JSON", "restore from a backup") from err


def read_meta(txn, db, path: Path | None) -> dict | None:
    """The last checkpoint's meta record (None: never checkpointed)."""
    payload = _get(txn, db, b"meta", path)
    return None if payload is None else dict(_json(payload, "meta", path))


def read_mark(txn, db, path: Path | None) -> int:
    """The last checkpoint's mark (0 in a store of the format before marks)."""
    payload = _get(txn, db, b"mark", path)
    if payload is not None and len(payload) != 8:
        raise CorruptStoreError(f"the checkpoint mark of {path} is damaged", "restore from a backup")
    return 0 if payload is None else int.from_bytes(payload, "big")


def put(txn, db, meta: dict, mark: int, extra: bytes | None, keep: int, blobs: dict | None = None) -> None:
    """Record checkpoint ``meta["epoch"]`` (``mark``; ``extra`` when not None; ``blobs``, name
    -> bytes, as ``snapa:<epoch><name>``: a checkpoint's blob of a name is the newest at or
    before it) in ``txn`` as the last, and drop the oldest beyond ``keep``."""
    epoch = int(meta["epoch"])
    body = json.dumps(meta, sort_keys=True).encode()
    txn.put(b"meta", seal(body), db=db)
    txn.put(b"mark", seal(int(mark).to_bytes(8, "big")), db=db)
    txn.put(_key(SNAP, epoch), seal(json.dumps({"mark": int(mark), "meta": meta}, sort_keys=True).encode()), db=db)
    if extra is not None:
        txn.put(_key(SNAPX, epoch), seal(bytes(extra)), db=db)
        txn.delete(b"extra", db=db)  # (the bytes of a store written before numbered checkpoints)
    for name, blob in sorted((blobs or {}).items()):
        txn.put(_key(SNAPA, epoch) + name.encode(), seal(bytes(blob)), db=db)
    kept = listed(txn, db, None)
    for old, _, _ in kept[:-keep]:
        txn.delete(_key(SNAP, old), db=db)
    oldest = kept[-keep:][0][0]
    for (e, name), key in _blobs(txn, db).items():  # (each name's blob of the oldest kept stays)
        if e < (_blob_epoch(txn, db, oldest, name) or 0):
            txn.delete(key, db=db)
    base = _extra_epoch(txn, db, oldest)
    for e in _epochs(txn, db, SNAPX):  # (the oldest kept checkpoint's extra stays)
        if base is not None and e < base:
            txn.delete(_key(SNAPX, e), db=db)


def _keys(txn, db, prefix: bytes) -> list[bytes]:
    """The keys of ``db`` that begin with ``prefix``, in order."""
    out = []
    with txn.cursor(db=db) as cur:
        if cur.set_range(prefix):
            for key in cur.iternext(keys=True, values=False):
                key = bytes(key)
                if not key.startswith(prefix):
                    break
                out.append(key)
    return out


def _epochs(txn, db, prefix: bytes) -> list[int]:
    return [int.from_bytes(key[len(prefix) :], "big") for key in _keys(txn, db, prefix)]


def _blobs(txn, db) -> dict[tuple[int, str], bytes]:
    """``(epoch, name) -> key`` of every ``snapa`` record."""
    at = len(SNAPA)
    return {(int.from_bytes(key[at : at + 8], "big"), key[at + 8 :].decode()): key for key in _keys(txn, db, SNAPA)}


def _blob_epoch(txn, db, epoch: int, name: str) -> int | None:
    """The epoch of the newest ``snapa`` of ``name`` at or before ``epoch`` (None: none)."""
    before = [e for e, n in _blobs(txn, db) if n == name and e <= epoch]
    return max(before) if before else None


def read_blob(txn, db, epoch: int, name: str, path: Path | None) -> bytes | None:
    """The blob ``name`` of checkpoint ``epoch``: the newest saved at or before it (None: none)."""
    at = _blob_epoch(txn, db, epoch, name)
    return None if at is None else _get(txn, db, _key(SNAPA, at) + name.encode(), path)


def _touch_key(table: str, step: int) -> bytes:
    return TOUCH + int(step).to_bytes(8, "big") + table.encode()


def put_logs(txn, db, logs: dict, path: Path | None) -> None:
    """Add ``logs`` ({(table, step): distinct int64 ids}) to the touch logs (a step's ids
    joined with those it already holds)."""
    for (table, step), ids in sorted(logs.items()):
        key = _touch_key(table, step)
        old = _get(txn, db, key, path)
        if old is not None:
            ids = np.union1d(np.frombuffer(old, dtype=np.int64), ids)
        txn.put(key, seal(np.ascontiguousarray(ids, dtype=np.int64).tobytes()), db=db)


def read_log(txn, db, table: str, step: int, path: Path | None) -> np.ndarray:
    """The ids of ``table``'s touch log of ``step`` (empty: none)."""
    data = _get(txn, db, _touch_key(table, step), path)
    return np.empty(0, np.int64) if data is None else np.frombuffer(data, dtype=np.int64).copy()


def drop_logs(txn, db, before: dict | None = None, from_step: int | None = None) -> None:
    """Delete the touch logs of each table's steps below ``before[table]``, and of every step at
    or after ``from_step``."""
    at = len(TOUCH)
    for key in _keys(txn, db, TOUCH):
        step, table = int.from_bytes(key[at : at + 8], "big"), key[at + 8 :].decode()
        if (from_step is not None and step >= from_step) or (before and step < before.get(table, -1)):
            txn.delete(key, db=db)


def _extra_epoch(txn, db, epoch: int) -> int | None:
    """The epoch of the newest ``snapx`` at or before ``epoch`` (None: none)."""
    before = [e for e in _epochs(txn, db, SNAPX) if e <= epoch]
    return before[-1] if before else None


def listed(txn, db, path: Path | None) -> list[tuple[int, int, dict]]:
    """``(epoch, mark, meta)`` of every kept checkpoint, oldest first (a store written before
    numbered checkpoints: its one checkpoint, from ``meta`` and ``mark``)."""
    out = []
    for epoch in _epochs(txn, db, SNAP):
        rec = _json(_get(txn, db, _key(SNAP, epoch), path) or b"", f"checkpoint {epoch}", path)
        try:
            out.append((epoch, int(rec["mark"]), dict(rec["meta"])))
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptStoreError(f"the record of checkpoint {epoch} in {path} is damaged", "restore") from err
    if not out:
        meta = read_meta(txn, db, path)
        if meta is not None:
            out.append((int(meta.get("epoch", 0)), read_mark(txn, db, path), meta))
    return out


def find(txn, db, epoch: int, path: Path, kept: list | None = None) -> tuple[int, dict, bytes | None]:
    """``(mark, meta, extra)`` of kept checkpoint ``epoch`` (``kept``: :func:`listed`, when
    known); SnapshotNotFoundError otherwise."""
    kept = listed(txn, db, path) if kept is None else kept
    for e, mark, meta in kept:
        if e == epoch:
            at = _extra_epoch(txn, db, e)
            extra = _get(txn, db, _key(SNAPX, at), path) if at is not None else _get(txn, db, b"extra", path)
            return mark, meta, extra
    raise SnapshotNotFoundError(
        f"{path} keeps no checkpoint {epoch!r} (it keeps {[e for e, _, _ in kept]})",
        "open one of those, or the last (snapshot=None); TierConfig.keep_checkpoints sets how many are kept",
    )


def back_to(txn, db, epoch: int, path: Path) -> int:
    """Make kept checkpoint ``epoch`` the last in ``txn`` (its meta and mark; the records of
    later ones dropped; ``going_back`` put); returns its mark.  The segments at or above
    the mark are then the caller's to delete (:func:`gone_back` once they are)."""
    mark, meta, _ = find(txn, db, epoch, path)
    for later, _, _ in listed(txn, db, path):
        if later > epoch:
            txn.delete(_key(SNAP, later), db=db)
    for later in _epochs(txn, db, SNAPX):
        if later > epoch:
            txn.delete(_key(SNAPX, later), db=db)
    for (later, _), key in _blobs(txn, db).items():
        if later > epoch:
            txn.delete(key, db=db)
    txn.put(b"meta", seal(json.dumps(meta, sort_keys=True).encode()), db=db)
    txn.put(b"mark", seal(int(mark).to_bytes(8, "big")), db=db)
    txn.put(GOING_BACK, seal(int(mark).to_bytes(8, "big")), db=db)
    return mark


def going_back(txn, db) -> bool:
    """Whether a going back to a checkpoint has not finished deleting what came after it."""
    return txn.get(GOING_BACK, db=db) is not None


def gone_back(txn, db) -> None:
    txn.delete(GOING_BACK, db=db)


def problems(txn, db, path: Path) -> list[str]:
    """What is wrong with the records of the ``meta`` database (an empty list: nothing)."""
    out = []
    with txn.cursor(db=db) as cur:
        for key, value in cur:
            try:
                unseal(value, bytes(key).decode("ascii", "replace"), path)
            except CorruptStoreError as err:
                out.append(err.args[0])
    if out:
        return out
    try:
        kept = listed(txn, db, path)
        mark = read_mark(txn, db, path)
        meta = read_meta(txn, db, path)
    except CorruptStoreError as err:
        return [err.args[0]]
    if kept and (kept[-1][1] != mark or (meta is not None and kept[-1][2] != meta)):
        out.append(f"the last checkpoint's mark or meta record in {path} disagrees with checkpoint {kept[-1][0]}'s")
    marks = [m for _, m, _ in kept]
    if marks != sorted(marks):
        out.append(f"the marks of the checkpoints kept in {path} do not rise with their numbers: {marks}")
    return out


__all__ = [
    "back_to",
    "drop_logs",
    "find",
    "going_back",
    "gone_back",
    "listed",
    "problems",
    "put",
    "put_logs",
    "read_blob",
    "read_log",
    "read_mark",
    "read_meta",
    "seal",
    "unseal",
]
