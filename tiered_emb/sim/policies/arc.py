"""ARC: T1/T2/B1/B2 with a float target ``p``, as libCacheSim's ``ARC.c``.

Twin of the store's ARC (:mod:`tiered_emb.cache.policies.arc`).

>>> import numpy as np
>>> arc_hits(np.array([1, 2, 1, 3, 1, 2]), 2, np.zeros(0, np.uint8))
2
"""

from __future__ import annotations

import numpy as np

from tiered_emb._jit import kernel, prefetch_hint
from tiered_emb.sim.policies.base import (
    NIL,
    PREFETCH_STATE_MIN,
    flag_hit,
    ix_del,
    ix_find,
    ix_prefetch,
    ix_put,
    list_pop,
    list_push,
    list_unlink,
    prefetch_ahead,
)
from tiered_emb.sim.policies.buffers import kernel_state

#: The list a node is on (``where``): residents in T1 (seen once) or T2 (seen again),
#: ghost ids in B1 or B2.
T1 = 0
T2 = 1
B1 = 2
B2 = 3


@kernel
def _arc_simulate(trace, capacity, ix, node_ids, where, newer, older, free, hit_flags):
    """ARC over ``2 * capacity + 1`` nodes, each in one of T1, T2, B1, B2 (``where`` int8).

    ``newer`` / ``older`` int32 (nodes,) link each list; its newest node, oldest node and
    length are locals (``h1``, ``o1``, ``n1`` for T1, and so on), which the compiler keeps
    in registers.  ``free`` int32 (nodes,) is a stack of unused nodes, all on it at the
    start.  The target size ``p`` of T1 is a float, adapted by ``max(|B2| / |B1|, 1)`` on
    a B1 hit (and the converse on a B2 hit), as in libCacheSim (and the ARC paper's
    reference code).
    """
    hits = 0
    p = 0.0
    n_free = free.shape[0]
    h1 = o1 = h2 = o2 = hb1 = ob1 = hb2 = ob2 = NIL
    n1 = n2 = nb1 = nb2 = 0
    deep = where.shape[0] > PREFETCH_STATE_MIN
    for i in range(trace.shape[0]):
        t = prefetch_ahead(ix, trace, i, deep)
        if t >= 0:
            prefetch_hint(where, t)
            prefetch_hint(newer, t)
            prefetch_hint(older, t)
        if deep:
            # the oldest nodes of T1 and B1 leave next (demoted, forgotten): their
            # successors' links and ids, and the index entry of B1's oldest id
            if o1 != NIL:
                t = newer[o1]
                if t != NIL:
                    prefetch_hint(newer, t)
                    prefetch_hint(older, t)
                    prefetch_hint(where, t)
            if ob1 != NIL:
                ix_prefetch(ix, node_ids[ob1])
                t = newer[ob1]
                if t != NIL:
                    prefetch_hint(newer, t)
                    prefetch_hint(older, t)
                    prefetch_hint(node_ids, t)
        key = trace[i]
        node = ix_find(ix, key)
        ghost_hit = False
        in_b2 = False
        if node >= 0:
            lst = where[node]
            if lst == T1 or lst == T2:
                hits += 1
                flag_hit(hit_flags, i)
                if lst == T1:
                    h1, o1 = list_unlink(newer, older, h1, o1, node)
                    n1 -= 1
                    n2 += 1
                    where[node] = T2
                elif node == h2:
                    continue
                else:
                    h2, o2 = list_unlink(newer, older, h2, o2, node)
                h2, o2 = list_push(newer, older, h2, o2, node)
                continue
            ghost_hit = True
            if lst == B1:
                p = min(p + max(nb2 / nb1, 1.0), float(capacity))
                hb1, ob1 = list_unlink(newer, older, hb1, ob1, node)
                nb1 -= 1
            else:
                in_b2 = True
                p = max(p - max(nb1 / nb2, 1.0), 0.0)
                hb2, ob2 = list_unlink(newer, older, hb2, ob2, node)
                nb2 -= 1
            ix_del(ix, key)
            free[n_free] = node
            n_free += 1
        while n1 + n2 + 1 > capacity:
            # forget one node (B1's, T1's or B2's oldest) where the rules say so ...
            drop = NIL
            demote = True
            if not ghost_hit:
                if n1 + nb1 + 1 > capacity:
                    if nb1 > 0:
                        drop = B1
                    else:
                        drop = T1
                        demote = False
                elif n1 + n2 + nb1 + nb2 >= 2 * capacity and nb2 > 0:
                    drop = B2
            if drop != NIL:
                if drop == B1:
                    g, hb1, ob1 = list_pop(newer, older, hb1, ob1)
                    nb1 -= 1
                elif drop == T1:
                    g, h1, o1 = list_pop(newer, older, h1, o1)
                    n1 -= 1
                else:
                    g, hb2, ob2 = list_pop(newer, older, hb2, ob2)
                    nb2 -= 1
                ix_del(ix, node_ids[g])
                free[n_free] = g
                n_free += 1
            # ... then REPLACE of the ARC paper: demote T1's oldest to B1 or T2's to B2
            if demote:
                if (n1 > 0 and (n1 > p or (n1 == p and in_b2))) or n2 == 0:
                    v, h1, o1 = list_pop(newer, older, h1, o1)
                    n1 -= 1
                    hb1, ob1 = list_push(newer, older, hb1, ob1, v)
                    nb1 += 1
                    where[v] = B1
                else:
                    v, h2, o2 = list_pop(newer, older, h2, o2)
                    n2 -= 1
                    hb2, ob2 = list_push(newer, older, hb2, ob2, v)
                    nb2 += 1
                    where[v] = B2
        n_free -= 1
        node = free[n_free]
        node_ids[node] = key
        ix_put(ix, key, node)
        if ghost_hit:
            h2, o2 = list_push(newer, older, h2, o2, node)
            n2 += 1
            where[node] = T2
        else:
            h1, o1 = list_push(newer, older, h1, o1, node)
            n1 += 1
            where[node] = T1
    return hits


def arc_hits(trace, capacity, hit_flags, index="auto", max_id=None):
    """Hits of ARC (``2 * capacity + 1`` nodes: residents and ghosts).

    ``trace``: int64 (n,), ids >= 0; ``capacity``: objects, >= 1; ``hit_flags``: uint8,
    empty or (n,) zeros, receives 1 at each hit; ``index``: "auto", "dense" or "hash"
    (:func:`~tiered_emb.sim.policies.buffers.kernel_state`); ``max_id``: the trace's
    largest id when the caller knows it.  :func:`tiered_emb.sim.simulate` checks all of
    these; this is its fast path.
    """
    nodes = 2 * capacity + 1
    with kernel_state(trace, capacity, index, max_id, nodes) as (ix, idt):
        return _arc_simulate(
            trace,
            capacity,
            ix,
            np.empty(nodes, idt),
            np.zeros(nodes, np.int8),
            np.full(nodes, NIL, np.int32),
            np.full(nodes, NIL, np.int32),
            np.arange(nodes - 1, -1, -1, dtype=np.int32),
            hit_flags,
        )
