"""What every tier does with one table's rows: :class:`Tier`.

The step moves rows through each tier's own operations (HBM's decisions and fills, DDR's
take and admit, the SSD tier's reads and write-backs: :mod:`tiered_emb.step.resolve`).
Beneath them every tier is a store of records (float32 (k, width): weights, then
optimizer state) keyed by id, and that much is one protocol, which
:class:`~tiered_emb.tiers.HbmTier`, :class:`~tiered_emb.tiers.DirectHbmTier`,
:class:`~tiered_emb.tiers.DdrTier` (and their shares of a pool) and a table of the SSD
tier (:meth:`~tiered_emb.tiers.SsdTier.table`) keep, and one contract suite checks
(``tests/tiers/test_tier_contract.py``): a row put is read back bitwise, the newest put
wins, an id never put is absent, the rows held never exceed ``capacity_rows``, no row is
lost or stale (held with its newest record, or pushed out carrying it), and the same puts
give the same tier.

>>> import numpy as np
>>> from tiered_emb.tiers import DdrTier
>>> tier = DdrTier(2, 3, "lru")
>>> isinstance(tier, Tier)
True
>>> out_ids, _ = tier.put(np.array([4, 5, 6]), np.ones((3, 3), np.float32))
>>> out_ids.tolist(), tier.read(np.array([4, 6]))[1].tolist()
([4], [False, True])
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from tiered_emb.errors import RowShapeError


@runtime_checkable
class Tier(Protocol):
    """A tier's rows of one table.

    ``capacity_rows``: the most rows it holds (None: every row ever written, the SSD tier);
    ``width``: the floats of a record.
    """

    @property
    def capacity_rows(self) -> int | None: ...

    @property
    def width(self) -> int: ...

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, found)`` for ``ids`` (int64 (k,)): a copy of each record held (float32
        (k, width), zeros where not found) and the found mask (bool (k,)).  Changes no
        cache state: a read is not a use."""
        ...

    def put(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hold ``rows`` (float32 (k, width)) of ``ids`` (int64 (k,), distinct) as written
        (dirty: they reach the tier below when pushed out).  Returns ``(ids, rows)`` of the
        dirty rows pushed out to make room (copies, in the order pushed; a clean row pushed
        out is dropped, the tier below has it), empty for a tier without a capacity."""
        ...


def put_arrays(ids: np.ndarray, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` as int64 and ``rows`` as float32, both C order, for a :meth:`Tier.put` of
    records ``width`` floats wide; rows of another shape are a :class:`RowShapeError`."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.shape != (ids.shape[0], width):
        raise RowShapeError(
            f"a put of {ids.shape[0]} ids got rows of shape {rows.shape}",
            f"give float32 records of shape ({ids.shape[0]}, {width}): weights, then optimizer state",
        )
    return ids, rows
