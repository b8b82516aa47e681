"""The id -> slot index of a cache tier, in Numba.

An open-addressing hash table with linear probing and backward-shift deletion (no
tombstones, so probe lengths stay short under constant churn).  Its size is the next
power of two at or above twice the tier's capacity: memory scales with the tier, not
with the id space.  State is two preallocated arrays changed in place:

- ``keys``: int64 (table_size,), ``EMPTY`` (-1) where free; ids are >= 0.
- ``vals``: int32 (table_size,), the slot of ``keys[i]``.

A tier shared by several tables (:mod:`tiered_emb.tiers.pool`) keys its index by
``(table, id)``: ``keys`` hold ids, and the slot's owner (``owner[vals[i]]``, an int32
array of the tier's) tells the tables apart; the home bucket mixes the table in, so the
same id of many tables does not make one long run.  The ``*_of`` functions take that
``owner`` and a table number; with an empty ``owner`` they are the plain ones.  A tier
of one table passes a uint8 ``owner`` (:data:`NO_OWNER`): Numba then compiles the kernels
without the owner's checks at all (:func:`is_shared`).
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt
from numba import types
from numba.extending import overload

from tiered_emb._backend import host_full
from tiered_emb._jit import kernel, prefetch_hint

# Kernel arguments: annotations for the reader and for mypy; Numba compiles from the runtime types.
Keys = npt.NDArray[np.int64]
Vals = npt.NDArray[np.int32]
Owners = npt.NDArray[np.uint8]  # (NO_OWNER's type: a tier of one table)

EMPTY = -1
#: Ids this far ahead have their bucket fetched by :func:`index_find_many`.
_AHEAD = 16


def table_size_for(capacity_rows: int) -> int:
    """Hash table size for a tier of ``capacity_rows``: a power of two >= 2 * capacity."""
    return 1 << max(3, int(2 * max(capacity_rows, 1) - 1).bit_length())


def new_index(capacity_rows: int) -> tuple[Keys, Vals]:
    """Empty ``(keys, vals)`` for a tier of ``capacity_rows``."""
    size = table_size_for(capacity_rows)
    return host_full(size, np.int64, EMPTY), host_full(size, np.int32, 0)


@numba.njit(inline="never")
def hash_home(key: int | np.int64, mask: int) -> np.int64:
    """Home bucket of ``key``: the splitmix64 finaliser, masked."""
    z = np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.int64(z & np.uint64(mask))


@numba.njit(inline="never")
def index_prefetch(keys: Keys, vals: Vals, key: int | np.int64) -> None:
    """Fetch the home bucket of ``key`` (keys and values) into the caches: a hint for a
    lookup or insert of ``key`` a few ids later; nothing changes."""
    home = hash_home(key, keys.shape[0] - 1)
    # (mypy reads Numba's intrinsic as its typing function, which takes a context first)
    prefetch_hint(keys, home)  # type: ignore[call-arg]
    prefetch_hint(vals, home)


#: The ``owner`` of a tier of one table: its type tells the kernels there is none.
NO_OWNER = np.empty(0, dtype=np.uint8)


def is_shared(owner: np.ndarray) -> bool:
    """Whether ``owner`` is a shared tier's (int32, not empty)."""
    return owner.dtype == np.int32 and owner.shape[0] > 0


@overload(is_shared, inline="always")
def _is_shared_typed(owner):  # type: ignore[no-untyped-def]  # (Numba compares its signature with the lambdas')
    if owner.dtype == types.int32:
        return lambda owner: owner.shape[0] > 0
    return lambda owner: False  # (a constant: the owner's branches compile away)


#: What a table number is multiplied by before it is mixed into an id's home bucket.
_TABLE_MIX = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(inline="never")
def home_of(key: int | np.int64, tab: int | np.int32, mask: int) -> np.int64:
    """Home bucket of ``(tab, key)``; table 0's is :func:`hash_home`'s."""
    if tab == 0:
        return hash_home(key, mask)
    return hash_home(np.int64(np.uint64(key) ^ (np.uint64(tab) * _TABLE_MIX)), mask)


@numba.njit(inline="never")
def index_prefetch_of(keys: Keys, vals: Vals, owner: Vals, key: int | np.int64, tab: int | np.int32) -> None:
    """:func:`index_prefetch` for ``(tab, key)``."""
    mask = keys.shape[0] - 1
    # (one expression, no early return: the loops it is inlined into stay one block)
    home = home_of(key, tab, mask) if is_shared(owner) else hash_home(key, mask)
    prefetch_hint(keys, home)  # type: ignore[call-arg]
    prefetch_hint(vals, home)


@kernel
def index_find_of(keys: Keys, vals: Vals, owner: Vals | Owners, key: int | np.int64, tab: int | np.int32) -> np.int64:
    """Slot of ``key`` of table ``tab``, or -1 (``owner`` empty: of the one table).

    One exit and no call to the plain function, as every ``*_of`` function: each such
    call or return in a probe loop is a block Numba's reference counts could not be
    pruned from (docs/benchmarks.md, "Kernel choices")."""
    shared = is_shared(owner)
    mask = keys.shape[0] - 1
    i = home_of(key, tab, mask) if shared else hash_home(key, mask)
    found = np.int64(-1)
    while True:
        k = keys[i]
        if k == EMPTY:
            break
        if k == key and (not shared or owner[vals[i]] == tab):
            found = np.int64(vals[i])
            break
        i = (i + 1) & mask
    return found


@kernel
def index_put_of(
    keys: Keys, vals: Vals, owner: Vals | Owners, key: int | np.int64, tab: int | np.int32, slot: int | np.int32
) -> None:
    """Insert ``(tab, key) -> slot`` (absent; the caller sets ``owner[slot] = tab``)."""
    mask = keys.shape[0] - 1
    i = home_of(key, tab, mask) if is_shared(owner) else hash_home(key, mask)
    while keys[i] != EMPTY:
        i = (i + 1) & mask
    keys[i] = key
    vals[i] = slot


@kernel
def index_del_of(keys: Keys, vals: Vals, owner: Vals | Owners, key: int | np.int64, tab: int | np.int32) -> None:
    """Remove ``(tab, key)`` (present; ``owner`` of its slot still ``tab``; ``owner`` empty:
    ``key`` of the one table) and shift later entries of its run back into the gap."""
    shared = is_shared(owner)
    mask = keys.shape[0] - 1
    i = home_of(key, tab, mask) if shared else hash_home(key, mask)
    while keys[i] != key or (shared and owner[vals[i]] != tab):
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        kj = keys[j]
        if kj == EMPTY:
            break
        home = home_of(kj, owner[vals[j]], mask) if shared else hash_home(kj, mask)
        # kj may move into the gap at i only if its home is not cyclically in (i, j].
        if i <= j:
            stays = i < home <= j
        else:
            stays = home > i or home <= j
        if not stays:
            keys[i] = kj
            vals[i] = vals[j]
            i = j
    keys[i] = EMPTY


@kernel
def index_find_many_of(keys: Keys, vals: Vals, owner: Vals, ids: Keys, tab: int, out: Keys, lo: int, hi: int) -> None:
    """:func:`index_find_many` for the ids of table ``tab``."""
    n = ids.shape[0] if hi < 0 else hi
    for i in range(lo, n):
        if i + _AHEAD < n:
            index_prefetch_of(keys, vals, owner, ids[i + _AHEAD], tab)
        out[i] = index_find_of(keys, vals, owner, ids[i], tab)


@kernel(parallel=True)
def index_find_split_of(keys: Keys, vals: Vals, owner: Vals, ids: Keys, tab: int, out: Keys, parts: int) -> None:
    """:func:`index_find_many_of` cut into ``parts`` slices on Numba's threads."""
    n = ids.shape[0]
    for p in numba.prange(parts):
        index_find_many_of(keys, vals, owner, ids, tab, out, n * p // parts, n * (p + 1) // parts)


@kernel
def index_find(keys: Keys, vals: Vals, key: int | np.int64) -> np.int64:
    """Slot of ``key``, or -1."""
    return index_find_of(keys, vals, NO_OWNER, key, 0)


@kernel
def index_put(keys: Keys, vals: Vals, key: int | np.int64, slot: int | np.int32) -> None:
    """Insert ``key -> slot`` (``key`` must be absent; the table is never full)."""
    index_put_of(keys, vals, NO_OWNER, key, 0, slot)


@kernel
def index_del(keys: Keys, vals: Vals, key: int | np.int64) -> None:
    """Remove ``key`` (present) and shift later entries of its run back into the gap."""
    index_del_of(keys, vals, NO_OWNER, key, 0)


@kernel
def index_find_many(keys: Keys, vals: Vals, ids: Keys, out: Keys, lo: int = 0, hi: int = -1) -> None:
    """``out[i] = slot of ids[i]`` or -1, for int64 ``ids`` (n,) into int64 ``out`` (n,)
    (``ids[lo:hi]`` only where given).

    The bucket of the id ``_AHEAD`` on is fetched while this one is looked up (a hint: a
    large tier's table misses the caches at nearly every id)."""
    n = ids.shape[0] if hi < 0 else hi
    for i in range(lo, n):
        if i + _AHEAD < n:
            index_prefetch(keys, vals, ids[i + _AHEAD])
        out[i] = index_find(keys, vals, ids[i])


@kernel(parallel=True)
def index_find_split(keys: Keys, vals: Vals, ids: Keys, out: Keys, parts: int) -> None:
    """:func:`index_find_many` cut into ``parts`` slices on Numba's threads (the index is only read)."""
    n = ids.shape[0]
    for p in numba.prange(parts):
        index_find_many(keys, vals, ids, out, n * p // parts, n * (p + 1) // parts)
