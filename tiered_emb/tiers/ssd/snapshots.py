"""The checkpoints a store keeps (``TierConfig.keep_checkpoints``), in LMDB's ``meta`` database.

Each checkpoint is numbered by its epoch (1, 2, ...).  Its own transaction puts, beside
the latest checkpoint's ``meta`` / ``mark`` / ``extra``, the record ``snap:<epoch>`` (its
mark and meta record, JSON) and ``snapx:<epoch>`` (the trainer's bytes as of it), and
deletes the records of the oldest beyond the number kept.  The rows of a kept checkpoint
are the newest copy of each id in the segments below its mark: compaction keeps them so
(:mod:`.compaction` never merges segments across a kept mark, and keeps the copy a kept
checkpoint reads).  Stores written before numbered checkpoints hold no ``snap:`` record:
their one checkpoint is listed from ``meta`` and ``mark``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiered_emb.errors import CorruptStoreError, SnapshotNotFoundError

SNAP = b"snap:"
SNAPX = b"snapx:"


def _key(prefix: bytes, epoch: int) -> bytes:
    return prefix + int(epoch).to_bytes(8, "big")


def put(txn, db, meta: dict, mark: int, extra: bytes | None, keep: int) -> None:
    """Record checkpoint ``meta["epoch"]`` (``mark``; ``extra``, or the last checkpoint's when
    None) in ``txn``, and drop the oldest beyond ``keep``."""
    epoch = int(meta["epoch"])
    txn.put(_key(SNAP, epoch), json.dumps({"mark": int(mark), "meta": meta}, sort_keys=True).encode(), db=db)
    extra = extra if extra is not None else txn.get(b"extra", db=db)
    if extra is not None:
        txn.put(_key(SNAPX, epoch), bytes(extra), db=db)
    for old, _, _ in listed(txn, db)[:-keep]:
        txn.delete(_key(SNAP, old), db=db)
        txn.delete(_key(SNAPX, old), db=db)


def listed(txn, db, path: Path | None = None) -> list[tuple[int, int, dict]]:
    """``(epoch, mark, meta)`` of every kept checkpoint, oldest first (a store written before
    numbered checkpoints: its one checkpoint, from ``meta`` and ``mark``)."""
    out = []
    with txn.cursor(db=db) as cur:
        if cur.set_range(SNAP):
            for key, value in cur:
                key = bytes(key)
                if not key.startswith(SNAP):
                    break
                try:
                    rec = json.loads(bytes(value))
                    out.append((int.from_bytes(key[len(SNAP) :], "big"), int(rec["mark"]), dict(rec["meta"])))
                except (ValueError, KeyError, TypeError) as err:
                    raise CorruptStoreError(
                        f"the record of checkpoint {key[len(SNAP) :].hex()} in {path} is damaged ({err})",
                        "restore the store directory from a backup",
                    ) from err
    if not out:
        meta, mark = txn.get(b"meta", db=db), txn.get(b"mark", db=db)
        if meta is not None:
            latest = json.loads(bytes(meta))
            out.append((int(latest.get("epoch", 0)), 0 if mark is None else int.from_bytes(mark, "big"), latest))
    return out


def find(txn, db, epoch: int, path: Path) -> tuple[int, dict, bytes | None]:
    """``(mark, meta, extra)`` of kept checkpoint ``epoch``; SnapshotNotFoundError otherwise."""
    kept = listed(txn, db, path)
    for e, mark, meta in kept:
        if e == epoch:
            extra = txn.get(_key(SNAPX, e), db=db)
            if extra is None and e == kept[-1][0]:
                extra = txn.get(b"extra", db=db)
            return mark, meta, None if extra is None else bytes(extra)
    raise SnapshotNotFoundError(
        f"{path} keeps no checkpoint {epoch!r} (it keeps {[e for e, _, _ in kept]})",
        "open one of those, or the last (snapshot=None); TierConfig.keep_checkpoints sets how many are kept",
    )


def back_to(txn, db, epoch: int, path: Path) -> int:
    """Make kept checkpoint ``epoch`` the latest in ``txn`` (its meta, mark and extra; the
    records of later ones dropped); returns its mark.  The segments at or above the mark
    are then the caller's to delete, as after any reopening at the checkpoint."""
    mark, meta, extra = find(txn, db, epoch, path)
    for later, _, _ in listed(txn, db, path):
        if later > epoch:
            txn.delete(_key(SNAP, later), db=db)
            txn.delete(_key(SNAPX, later), db=db)
    txn.put(b"meta", json.dumps(meta, sort_keys=True).encode(), db=db)
    txn.put(b"mark", int(mark).to_bytes(8, "big"), db=db)
    if extra is None:
        txn.delete(b"extra", db=db)
    else:
        txn.put(b"extra", extra, db=db)
    return mark


__all__ = ["back_to", "find", "listed", "put"]
