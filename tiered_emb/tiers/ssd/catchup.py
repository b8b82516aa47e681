"""A reader's index moved from one checkpoint to a newer one without reading every segment again.

A reader (:mod:`.snapshot`) indexes the segments below its checkpoint's mark.  When it
moves to a newer checkpoint, most of those segments are still there as they were: only
the segments written since, and the runs a compaction rewrote, need reading.  Which ones
are unchanged is told by where they lie: a segment found under the same number at the same
offset of ``data.mdb``, with the same length, in the old snapshot and in the new one is
the same segment, because LMDB does not reuse a page that a live read transaction sees
and the old snapshot stays pinned until the new one is built.  Small segments (inside a
leaf page, no offset of their own) are always read again.

:func:`plan` works out, reading only, what changed for one table: the segments gone or
rewritten, the fresh ones (their ids, oldest first), and whether every id the index
named in a gone segment has a copy at least as new among the fresh ones.  When one has
not (the writer went back to an older checkpoint and wrote other rows under the same
numbers, say), or when the old snapshot cannot be read any more (taking up a map the
writer grew ends every transaction of the process), the plan is ``None`` and the caller
indexes the snapshot from scratch.
:meth:`.SegmentLog.catch_up` applies a plan.  The cost is the fresh segments' ids, plus
one pass over the index when anything was deleted.
"""

from __future__ import annotations

from typing import NamedTuple

import lmdb
import numpy as np

from tiered_emb._order import stable_argsort
from tiered_emb.tiers.ssd import decode
from tiered_emb.tiers.ssd.index import MAX_SEGMENT_ROWS, MAX_SEGMENTS, POS_BITS
from tiered_emb.tiers.ssd.mapped import value_offset


class Fresh(NamedTuple):
    """A segment to index: its number, layout, value (a buffer of the new snapshot) and ids."""

    seq: int
    head: decode.Head
    value: object
    ids: np.ndarray


class Plan(NamedTuple):
    """What moving ``table``'s index to the new snapshot takes: ``gone``, the numbers (int64,
    increasing) of the segments indexed before that are deleted or rewritten; ``fresh``, the
    segments to index, oldest first."""

    table: str
    gone: np.ndarray
    fresh: list[Fresh]


def _places(txn, db, below: int, psize: int) -> dict[int, tuple[int, int]]:
    """Segment number -> (offset in data.mdb, length) of the segments of ``db`` below ``below``."""
    out = {}
    with txn.cursor(db=db) as cur:
        for key, value in cur:
            seq = int.from_bytes(key, "big")
            if seq >= below:
                break
            out[seq] = (value_offset(value, psize), len(value))
    return out


def plan(log, table: str, old_txn, new_txn, old_below: int, new_below: int) -> Plan | None:
    """The plan for ``table`` of ``log`` (a :class:`.SegmentLog` indexed in ``old_txn`` below
    ``old_below``) to index ``new_txn``'s segments below ``new_below``; None when the index
    must be built from scratch."""
    if new_below < old_below:
        return None
    db, path, num_rows = log.lmdb.pending[table], log.lmdb.path, log.table_rows[table]
    try:
        before = _places(old_txn, db, old_below, log.page_size)
    except lmdb.Error:  # (the old snapshot ended: taking up a map the writer grew ends every transaction)
        return None
    fresh, kept = [], set()
    with new_txn.cursor(db=db) as cur:
        for key, value in cur:
            seq = int.from_bytes(key, "big")
            if seq >= new_below:
                break
            if len(key) != 8 or seq >= MAX_SEGMENTS:
                raise decode.damaged(path, table, seq, f"its key {bytes(key).hex()}")
            place = before.get(seq)
            if place is not None and place[0] >= 0 and place == (value_offset(value, log.page_size), len(value)):
                kept.add(seq)
                continue
            h = log.head(table, seq, value)
            if h.n > MAX_SEGMENT_ROWS:
                raise decode.damaged(path, table, seq, f"{h.n:,} rows, more than a segment holds")
            fresh.append(Fresh(seq, h, value, decode.ids_of(path, table, seq, value, h, num_rows).astype(np.int64)))
    gone = np.array(sorted(set(before) - kept), dtype=np.int64)
    if gone.shape[0] and not _covered(log.index[table], gone, fresh):
        return None
    return Plan(table, gone, fresh)


def _covered(index, gone: np.ndarray, fresh: list[Fresh]) -> bool:
    """Whether every id that ``index`` places in a ``gone`` segment has a copy in a ``fresh``
    segment numbered at least as high (its newest copy is then among the fresh ones)."""
    ids, locs = index.items()
    seqs = locs >> POS_BITS
    hit = np.isin(seqs, gone)
    ids, seqs = ids[hit], seqs[hit]
    if ids.shape[0] == 0:
        return True
    if not fresh:
        return False
    all_ids = np.concatenate([f.ids for f in fresh])
    all_seqs = np.concatenate([np.full(f.ids.shape[0], f.seq, dtype=np.int64) for f in fresh])
    order = stable_argsort(all_ids, runs=True)  # (equal ids keep their segments' order: the last is the newest)
    all_ids, all_seqs = all_ids[order], all_seqs[order]
    last = np.ones(all_ids.shape[0], dtype=bool)
    last[:-1] = all_ids[1:] != all_ids[:-1]
    newest_ids, newest_seqs = all_ids[last], all_seqs[last]
    at = np.minimum(np.searchsorted(newest_ids, ids), newest_ids.shape[0] - 1)
    return bool(np.all((newest_ids[at] == ids) & (newest_seqs[at] >= seqs)))


__all__ = ["Fresh", "Plan", "plan"]
