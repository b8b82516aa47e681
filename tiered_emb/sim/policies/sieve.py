"""SIEVE: an insertion-order list and one visited bit (libCacheSim ``Sieve``).

The hand walks from the oldest towards the newest, clearing bits, evicts the first
unvisited object and stays where it was.  The twin of the store's SIEVE
(:mod:`tiered_emb.cache.policies.queue`).

>>> import numpy as np
>>> sieve_hits(np.array([1, 2, 3, 1, 4, 5, 1]), 3, np.zeros(0, np.uint8))
2
"""

from __future__ import annotations

import numpy as np

from tiered_emb._jit import kernel
from tiered_emb.sim.policies.base import NIL, flag_hit, ix_del, ix_put, list_push, list_unlink, lookup
from tiered_emb.sim.policies.buffers import kernel_state


@kernel
def _sieve_simulate(trace, capacity, ix, slot_ids, newer, older, visited, hit_flags):
    """SIEVE over a list of slots: ``newer`` / ``older`` (int32 (capacity,)) links.

    New objects go to the newest end; the hand walks from the oldest end towards the
    newest, wrapping to the oldest, and is left at the object newer than the victim.
    """
    hits = 0
    used = 0
    newest = NIL
    oldest = NIL
    hand = NIL
    for i in range(trace.shape[0]):
        key, s = lookup(ix, trace, i)
        if s >= 0:
            visited[s] = 1
            hits += 1
            flag_hit(hit_flags, i)
            continue
        if used < capacity:
            s = used
            used += 1
        else:
            v = hand if hand != NIL else oldest
            while visited[v]:
                visited[v] = 0
                v = newer[v]
                if v == NIL:
                    v = oldest
            hand = newer[v]
            newest, oldest = list_unlink(newer, older, newest, oldest, v)
            ix_del(ix, slot_ids[v])
            s = v
        slot_ids[s] = key
        visited[s] = 0
        newest, oldest = list_push(newer, older, newest, oldest, s)
        ix_put(ix, key, s)
    return hits


def sieve_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    """Hits of SIEVE.

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    with kernel_state(trace, capacity, index, max_id) as (ix, idt):
        return _sieve_simulate(
            trace,
            capacity,
            ix,
            np.empty(capacity, idt),
            np.full(capacity, NIL, np.int32),
            np.full(capacity, NIL, np.int32),
            np.zeros(capacity, np.uint8),
            hit_flags,
        )
