"""LRU, the simulator's twin of the store's LRU (:mod:`tiered_emb.cache.policies.lru`).

Twin: the same decisions, request by request, as the store's kernel run with policy
``"lru"`` (:func:`tiered_emb.cache.slots.simulate`); ``tests/cache/test_policy_contract.py``
checks it.  The store keeps a generation ring because its slots are pinned and released
by batches; here a request is its own batch, so a plain doubly linked list, its ends in
registers, makes the same choices faster.

>>> import numpy as np
>>> lru_hits(np.array([1, 2, 1, 3, 2]), 2, np.zeros(0, np.uint8))
1
"""

from __future__ import annotations

import numpy as np

from tiered_emb._jit import kernel
from tiered_emb.sim.policies.base import NIL, flag_hit, ix_del, ix_put, list_pop, list_push, list_unlink, lookup
from tiered_emb.sim.policies.buffers import kernel_state


@kernel
def _lru_twin_simulate(trace, capacity, ix, slot_ids, newer, older, hit_flags):
    """LRU over a list of slots (``newer`` / ``older`` int32 (capacity,)).

    Twin of the store's LRU: the same decisions as :func:`tiered_emb.cache.slots.simulate`
    with ``"lru"`` (the contract test compares them request by request), with the list
    ends held in locals, which the compiler keeps in registers.
    """
    hits = 0
    used = 0
    newest = NIL
    oldest = NIL
    for i in range(trace.shape[0]):
        key, s = lookup(ix, trace, i)
        if s >= 0:
            hits += 1
            flag_hit(hit_flags, i)
            if s == newest:
                continue
            newest, oldest = list_unlink(newer, older, newest, oldest, s)
        elif used < capacity:
            s = used
            used += 1
            slot_ids[s] = key
            ix_put(ix, key, s)
        else:
            s, newest, oldest = list_pop(newer, older, newest, oldest)
            ix_del(ix, slot_ids[s])
            slot_ids[s] = key
            ix_put(ix, key, s)
        newest, oldest = list_push(newer, older, newest, oldest, s)
    return hits


def lru_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    """Hits of the twin of the store's LRU.

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    with kernel_state(trace, capacity, index, max_id) as (ix, idt):
        return _lru_twin_simulate(
            trace,
            capacity,
            ix,
            np.empty(capacity, idt),
            np.full(capacity, NIL, np.int32),
            np.full(capacity, NIL, np.int32),
            hit_flags,
        )
