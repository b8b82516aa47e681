"""LFU, the simulator's twin of the store's LFU (:mod:`tiered_emb.cache.policies.lfu`).

Twin: the same decisions, request by request, as the store's kernel run with policy
``"lfu"`` (:func:`tiered_emb.cache.slots.simulate`): the victim has the lowest use count
since admission, then the oldest last use, then the lowest slot.
``tests/cache/test_policy_contract.py`` checks it.  The store keeps a heap because
batches pin slots out of it; here buckets of equal count make each request O(1).

>>> import numpy as np
>>> lfu_hits(np.array([1, 1, 2, 3, 1, 2]), 2, np.zeros(0, np.uint8))
2
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._jit import kernel, prefetch_hint
from tiered_emb.sim.policies.base import (
    NIL,
    PREFETCH_STATE_MIN,
    flag_hit,
    ix_del,
    ix_find,
    ix_put,
    prefetch_ahead,
)
from tiered_emb.sim.policies.buffers import kernel_state


@numba.njit(inline="always")
def _bucket_unlink_item(bk, item, b, s):
    a, c = item[s, 2], item[s, 1]
    if a == NIL:
        bk[b, 2] = c
    else:
        item[a, 1] = c
    if c == NIL:
        bk[b, 1] = a
    else:
        item[c, 2] = a


@numba.njit(inline="always")
def _bucket_append_item(bk, item, b, s):
    t = bk[b, 1]
    item[s, 2] = t
    item[s, 1] = NIL
    if t == NIL:
        bk[b, 2] = s
    else:
        item[t, 1] = s
    bk[b, 1] = s
    item[s, 0] = b


@kernel
def _lfu_twin_simulate(trace, capacity, ix, slot_ids, item, bk, bfree, hit_flags):
    """LFU in O(1) per request: buckets of equal use count, in increasing count order.

    A slot's row of ``item`` int32 (capacity, 4) is its bucket and its list links (newer,
    older); a bucket's row of ``bk`` (capacity + 1, 8), int32 for traces under 2**31
    requests, else int64, is its count, its items' newest and oldest slot, and the buckets
    above and below (one row per slot and per bucket: one cache line each, not one per
    field).  Free buckets are on the stack ``bfree``.  Each bucket lists its slots in
    order of last use, so the victim, the oldest slot of the lowest bucket,
    is the store's (lowest count, then least recently used; last uses are unique, so the
    slot tie-break never applies).  Counts restart at 1 on admission, as in the store and
    in libCacheSim.  Twin of the store's LFU: the contract test compares it with
    :func:`tiered_emb.cache.slots.simulate` with ``"lfu"``, request by request.
    """
    hits = 0
    used = 0
    lowest = NIL
    n_bfree = bfree.shape[0]
    deep = capacity > PREFETCH_STATE_MIN
    for i in range(trace.shape[0]):
        t = prefetch_ahead(ix, trace, i, deep)
        if t >= 0:
            prefetch_hint(item, (t, 0))
        key = trace[i]
        s = ix_find(ix, key)
        if s >= 0:
            hits += 1
            flag_hit(hit_flags, i)
            b = item[s, 0]
            up = bk[b, 3]
            if up == NIL or bk[up, 0] != bk[b, 0] + 1:
                if bk[b, 2] == s and bk[b, 1] == s:
                    bk[b, 0] += 1  # alone in its bucket: the bucket moves up
                    continue
                n_bfree -= 1
                nb = bfree[n_bfree]
                bk[nb, 0] = bk[b, 0] + 1
                bk[nb, 1] = NIL
                bk[nb, 2] = NIL
                bk[nb, 4] = b
                bk[nb, 3] = up
                if up != NIL:
                    bk[up, 4] = nb
                bk[b, 3] = nb
                up = nb
            _bucket_unlink_item(bk, item, b, s)
            _bucket_append_item(bk, item, up, s)
            if bk[b, 2] == NIL:
                d = bk[b, 4]
                bk[up, 4] = d
                if d == NIL:
                    lowest = up
                else:
                    bk[d, 3] = up
                bfree[n_bfree] = b
                n_bfree += 1
            continue
        if used < capacity:
            s = used
            used += 1
        else:
            b = lowest
            s = bk[b, 2]
            _bucket_unlink_item(bk, item, b, s)
            if bk[b, 2] == NIL:
                lowest = bk[b, 3]
                if lowest != NIL:
                    bk[lowest, 4] = NIL
                bfree[n_bfree] = b
                n_bfree += 1
            ix_del(ix, slot_ids[s])
        slot_ids[s] = key
        ix_put(ix, key, s)
        if lowest == NIL or bk[lowest, 0] != 1:
            n_bfree -= 1
            nb = bfree[n_bfree]
            bk[nb, 0] = 1
            bk[nb, 1] = NIL
            bk[nb, 2] = NIL
            bk[nb, 4] = NIL
            bk[nb, 3] = lowest
            if lowest != NIL:
                bk[lowest, 4] = nb
            lowest = nb
        _bucket_append_item(bk, item, lowest, s)
    return hits


def lfu_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    """Hits of the twin of the store's LFU.

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    with kernel_state(trace, capacity, index, max_id) as (ix, idt):
        nb = capacity + 1
        bk = np.full((nb, 8), NIL, np.int32 if trace.shape[0] < 2**31 else np.int64)
        bk[:, 0] = 0
        return _lfu_twin_simulate(
            trace,
            capacity,
            ix,
            np.empty(capacity, idt),
            np.full((capacity, 4), NIL, np.int32),
            bk,
            np.arange(nb - 1, -1, -1, dtype=np.int32),
            hit_flags,
        )
