"""Expiry: rows no update touched for more than ``ttl_steps`` steps are deleted (``TableConfig.ttl_steps``).

A production table's old ids stop coming; their rows would stay forever.  With
``ttl_steps`` each row's record holds one more word, the step of its last update (the
store's step counter, :meth:`tiered_emb.TieredStore.advance_step`; a uint32 in the
record's last word), and the store keeps a *touch log*: the ids each step's updates
touched.  When the counter reaches ``s``, the rows of the log of step ``s - ttl_steps - 1``
whose last update is still that step are deleted as :meth:`~tiered_emb.TieredStore.delete`
does.  So a row updated at step ``u`` reads as trained up to step ``u + ttl_steps`` and
as its initial value from step ``u + ttl_steps + 1`` on, unless updated again: which rows
expire, and when, depends on the batches and the counter only (not on the tiers, the
threads or prefetch).  The work of a step is the ids of one step's log; memory, the
logs of the steps since the last checkpoint (written with each checkpoint, in its
transaction, or earlier in a transaction of their own past an eighth of the budget).
A read touches nothing: a row only looked up expires as one never used.
"""

from __future__ import annotations

import numpy as np

from tiered_emb.config import TableConfig

#: The touch logs held in memory are written once they pass ``budget_bytes // HELD_SHARE``.
HELD_SHARE = 8


class Expiry:
    """One table's touch log in memory (the steps not yet written) and where its rows keep their last update."""

    def __init__(self, cfg: TableConfig):
        self.ttl = int(cfg.ttl_steps)
        #: the word of a record that holds the step of the row's last update
        self.col = cfg.record_width - 1
        self.held: dict[int, list[np.ndarray]] = {}
        self.held_bytes = 0

    def touch(self, records, slots, uids: np.ndarray, step: int, xp) -> None:
        """Mark the records at ``slots`` (of ``uids``) as updated at ``step``, and log them."""
        records.view(xp.uint32)[slots, self.col] = xp.uint32(step)
        self.log(uids, step)

    def log(self, uids: np.ndarray, step: int) -> None:
        ids = np.array(uids, dtype=np.int64, copy=True)
        self.held.setdefault(step, []).append(ids)
        self.held_bytes += ids.nbytes

    def stamp(self, records: np.ndarray, step: int) -> None:
        """Set the last update of host ``records`` (k, record_width) to ``step``."""
        records.view(np.uint32)[:, self.col] = np.uint32(step)

    def last_update(self, records: np.ndarray) -> np.ndarray:
        """The step of each record's last update, int64 (k,): its last word, in a record as
        the tiers hold it or read back as float32 values."""
        return records.view(np.uint32)[:, -1].astype(np.int64)

    def take_held(self) -> dict[int, np.ndarray]:
        """The logs held in memory, each step's ids distinct and sorted, now handed to be written."""
        out = {step: np.unique(np.concatenate(parts)) for step, parts in sorted(self.held.items())}
        self.held, self.held_bytes = {}, 0
        return out

    def held_log(self, step: int) -> np.ndarray:
        """The ids of ``step``'s log held in memory (may be empty)."""
        parts = self.held.get(step)
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)


def expiry_of(cfg: TableConfig) -> Expiry | None:
    """The touch log of ``cfg``'s table, or None when its rows never expire."""
    return Expiry(cfg) if cfg.ttl_steps is not None else None


__all__ = ["HELD_SHARE", "Expiry", "expiry_of"]
