"""Plan: a batch's ids deduplicated once, in first-occurrence order (the first stage of a step).

A flat batch (``lookup``, ``apply_gradients``, ``write``) is deduped by :func:`dedupe`; a
batch of bags (the pooled path of :mod:`tiered_emb.torch`) is checked and planned once by
:func:`plan_bags` for its forward and its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numba
import numpy as np

from tiered_emb._args import int64_of, table_ids
from tiered_emb._jit import PREFETCH_DISTANCE, kernel
from tiered_emb.cache.index import hash_home, index_prefetch
from tiered_emb.errors import ConfigError, IdTypeError


@numba.njit(cache=True, nogil=True)
def dedupe_into(ids, uniq, inverse):
    """Unique ids in first-occurrence order.

    ``ids`` int64 (n,); writes ``uniq`` int64 (>= k,) and ``inverse`` int64 (n,) with
    ``uniq[inverse[i]] == ids[i]``; returns k.  Ids in increasing order (a bulk write's, an
    import's) are copied as they are, with no table.
    """
    n = ids.shape[0]
    rising = n > 1
    for i in range(1, n):
        if ids[i] <= ids[i - 1]:
            rising = False
            break
    if rising:
        for i in range(n):
            uniq[i] = ids[i]
            inverse[i] = i
        return n
    size = 16
    while size < 2 * n:
        size *= 2
    mask = size - 1
    keys = np.full(size, -1, dtype=np.int64)
    vals = np.empty(size, dtype=np.int32)
    k = 0
    for i in range(n):
        if i + 2 * PREFETCH_DISTANCE < n:  # the buckets of an id further on
            index_prefetch(keys, vals, ids[i + 2 * PREFETCH_DISTANCE])
        key = ids[i]
        h = hash_home(key, mask)
        while True:
            kk = keys[h]
            if kk == key:
                inverse[i] = vals[h]
                break
            if kk == -1:
                keys[h] = key
                vals[h] = k
                uniq[k] = key
                inverse[i] = k
                k += 1
                break
            h = (h + 1) & mask
    return k


def dedupe(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(uniq, inverse)`` of int64 ``ids`` (n,), uniq in first-occurrence order.

    Examples
    --------
    >>> u, inv = dedupe(np.array([5, 3, 5, 9]))
    >>> u.tolist(), inv.tolist()
    ([5, 3, 9], [0, 1, 0, 2])
    """
    n = ids.shape[0]
    uniq = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    k = dedupe_into(ids, uniq, inverse)
    return uniq[:k], inverse


@kernel
def _last_occurrence(inverse, last):
    """``last[u]`` = the last batch position of unique ``u`` (a write's winner)."""
    for i in range(inverse.shape[0]):
        last[inverse[i]] = i


@dataclass(frozen=True, eq=False)
class BagPlan:
    """The ids of one batch of bags, planned once for forward and backward; never changed.

    Attributes
    ----------
    ids : int64 (n,)
    offsets : int64 (B + 1,), bag b is ``ids[offsets[b]:offsets[b+1]]``
    weights : float32 (n,) or None, per-sample weights
    mean : bool, divide each bag by its length
    table : the store table (:class:`tiered_emb.step.resolve.Table`) whose id range ``ids``
        were checked against (:func:`checked`), or None: not checked yet
    uids : int64 (k,), unique ids in first-occurrence order (deduped on first use: a
        no-grad forward over a table held whole in HBM never needs them)
    inverse : int64 (n,), ``uids[inverse[i]] == ids[i]``
    """

    ids: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    mean: bool
    table: object = None
    _unique: list = field(default_factory=list, init=False, repr=False, compare=False)  # (its dedupe, once)

    @property
    def num_bags(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def uids(self) -> np.ndarray:
        return self._deduped()[0]

    @property
    def inverse(self) -> np.ndarray:
        return self._deduped()[1]

    def _deduped(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._unique:
            self._unique.append(dedupe(self.ids))
        return self._unique[0]


def checked(t, bags: BagPlan) -> BagPlan:
    """``bags`` with their ids checked against table ``t`` (a
    :class:`~tiered_emb.step.resolve.Table`): the same plan when it was checked for ``t``
    already, else a copy naming ``t``.  IdRangeError / IdTypeError, nothing changed, for an
    id ``t`` cannot hold: the one place the pooled step checks ids."""
    if bags.table is t:
        return bags
    table_ids(t.cfg.name, bags.ids, t.cfg.num_rows)
    bound = replace(bags, table=t)
    if bags._unique:  # (the same ids: their dedupe holds)
        bound._unique.append(bags._unique[0])
    return bound


#: How a pooled lookup read its rows (:attr:`Forward.backend`), chosen once by the lookup:
#: ``pinned`` from slots the prefetch window pinned for the batch; ``host`` from HBM slots
#: resolved for it (host kernels); ``device`` the same by the CUDA kernels; ``device_planned``
#: from a direct tier on the device, its backward grouped there; ``spill`` gathered chunk by
#: chunk (more unique ids than HBM holds: no slots to keep); ``by_id`` a direct tier read by
#: id with no dedupe (no backward follows); ``unread`` nothing read (a backward with no
#: lookup before it: its rows are resolved by the update).
BACKENDS = ("pinned", "host", "device", "device_planned", "spill", "by_id", "unread")


@dataclass(frozen=True, eq=False)
class Forward:
    """What a pooled lookup read, as a value its backward consumes (never changed).

    Attributes
    ----------
    bags : the :class:`BagPlan`, checked for ``table``
    table : the store table read (:class:`tiered_emb.step.resolve.Table`)
    backend : one of :data:`BACKENDS`
    uids, inverse : the batch's unique ids and each position's (the prefetch window's
        dedupe for a ``pinned`` batch, the plan's otherwise)
    slots : int64 (k,) HBM slots of ``uids`` at the lookup, or None (the update resolves)
    ticket : the prefetch ticket that pinned ``slots`` (``pinned``), else None
    grouping : the positions grouped by id on the device (``device_planned``), else None
    """

    bags: BagPlan
    table: object
    backend: str
    uids: np.ndarray | None = None
    inverse: np.ndarray | None = None
    slots: np.ndarray | None = None
    ticket: object = None
    grouping: object = None

    @classmethod
    def unread(cls, bags: BagPlan) -> Forward:
        """The record of checked ``bags`` that no lookup read (their backward resolves its rows)."""
        return cls(bags, bags.table, "unread", bags.uids, bags.inverse)

    @classmethod
    def of(cls, table, bags: BagPlan, backend: str, slots=None, ticket=None, grouping=None, unique=None) -> Forward:
        """A lookup's record of ``table`` (``unique``: ``(uids, inverse)`` deduped elsewhere,
        else the plan's; none for ``by_id``)."""
        uids, inverse = unique if unique is not None else (None, None) if backend == "by_id" else bags._deduped()
        return cls(bags, table, backend, uids, inverse, slots, ticket, grouping)

    # the batch, as the reduction reads it (:func:`tiered_emb.step.reduce.reduce_bag_grads`)
    @property
    def ids(self) -> np.ndarray:
        return self.bags.ids

    @property
    def offsets(self) -> np.ndarray:
        return self.bags.offsets

    @property
    def weights(self) -> np.ndarray | None:
        return self.bags.weights

    @property
    def mean(self) -> bool:
        return self.bags.mean

    @property
    def num_bags(self) -> int:
        return self.bags.num_bags


def plan_bags(ids: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None = None, mean: bool = False) -> BagPlan:
    """Check a batch of bags; its ids are deduped when first needed.

    Parameters
    ----------
    ids : int64 (n,)
    offsets : int64 (B + 1,), non-decreasing, ``offsets[0] == 0``, ``offsets[-1] == n``
    weights : float32 (n,), optional
    mean : bool

    Examples
    --------
    >>> p = plan_bags(np.array([4, 2, 4]), np.array([0, 2, 3]))
    >>> p.uids.tolist(), p.num_bags
    ([4, 2], 2)
    """
    ids = int64_of(ids, "ids")
    offsets = int64_of(offsets, "offsets")
    if ids.ndim != 1:
        raise IdTypeError(f"ids have shape {ids.shape}", "pass 1-D ids (ravel them)")
    if (
        offsets.ndim != 1
        or offsets.shape[0] < 1
        or offsets[0] != 0
        or offsets[-1] != ids.shape[0]
        or (offsets.shape[0] > 1 and bool((np.diff(offsets) < 0).any()))
    ):
        raise IdTypeError(
            f"offsets {offsets[:8].tolist()}... do not describe bags of {ids.shape[0]} ids",
            "give non-decreasing offsets starting at 0 (and ending at len(ids) with include_last_offset)",
        )
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if weights.shape != ids.shape:
            raise ConfigError(
                f"per_sample_weights have shape {weights.shape}, ids {ids.shape}", "give one weight per id"
            )
    return BagPlan(ids, offsets, weights, bool(mean))


def last_occurrence(inverse: np.ndarray, k: int) -> np.ndarray:
    """int64 (k,): the position of the last occurrence of each of the ``k`` unique ids."""
    last = np.empty(k, dtype=np.int64)
    _last_occurrence(inverse, last)
    return last


__all__ = ["BACKENDS", "BagPlan", "Forward", "checked", "dedupe", "last_occurrence", "plan_bags"]
