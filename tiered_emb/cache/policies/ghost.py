"""Ghosts: ids a tier evicted lately, without their rows (S3-FIFO's ghost queue, ARC's B1 and B2).

A ghost is a node of a fixed pool in the policy state: its id (``GIDS``), its list
(``GWHERE``: 0 for the list of triple ``G0``, 1 for ``G1``) and that list's links
(``GNEWER``, ``GOLDER``); free nodes are a stack (``GFREE``, ``P[GFREE_N]`` of them).  An
id -> node hash over ``P`` (:mod:`tiered_emb.cache.index`: linear probing, backward-shift
deletion) answers whether an id being admitted is a ghost, in one probe.

An id is never a ghost and resident in the same tier: its policy's admit forgets the
ghost before the id takes a slot, and only a resident id is made a ghost.
"""

from __future__ import annotations

import numba

from tiered_emb._jit import kernel
from tiered_emb.cache.index import index_del, index_find, index_put
from tiered_emb.cache.policies._lists import list_push, list_unlink
from tiered_emb.cache.policies._state import (
    G0,
    G1,
    GFREE,
    GFREE_N,
    GIDS,
    GKEYS,
    GNEWER,
    GOLDER,
    GTABLE,
    GVALS,
    GWHERE,
    NIL,
)


@numba.njit(inline="never")
def _table(P):
    """The ghost hash's keys and values: views of ``P``."""
    k, v, n = P[GKEYS], P[GVALS], P[GTABLE]
    return P[k : k + n], P[v : v + n]


@kernel
def ghost_find(P, key):
    """The ghost node of ``key``, or -1."""
    keys, vals = _table(P)
    return index_find(keys, vals, key)


@numba.njit(inline="never")
def ghost_list(P, node):
    """The header triple of the list ``node`` is on."""
    return G0 if P[P[GWHERE] + node] == 0 else G1


@kernel
def ghost_forget(P, node):
    """Take ghost ``node`` off its list and out of the hash; the node is free again."""
    list_unlink(P, P[GNEWER], P[GOLDER], ghost_list(P, node), node)
    keys, vals = _table(P)
    index_del(keys, vals, P[P[GIDS] + node])
    P[P[GFREE] + P[GFREE_N]] = node
    P[GFREE_N] += 1


@numba.njit(inline="never")
def ghost_forget_oldest(P, h):
    """Forget the oldest ghost of the list of triple ``h`` (it must have one)."""
    ghost_forget(P, P[h + 1])


@kernel
def ghost_add(P, h, key):
    """``key`` becomes the newest ghost of the list of triple ``h`` (``key`` is no ghost).

    When no node is free, the oldest ghost of ``G0`` (else of ``G1``) is forgotten first:
    a pool sized as the policy's rules need never runs out on a trace alone, but rows
    taken out of a tier (exclusive caching) leave room for more residents beside the
    ghosts."""
    if P[GFREE_N] == 0:
        ghost_forget_oldest(P, G0 if P[G0 + 1] != NIL else G1)
    P[GFREE_N] -= 1
    node = P[P[GFREE] + P[GFREE_N]]
    P[P[GIDS] + node] = key
    P[P[GWHERE] + node] = 0 if h == G0 else 1
    list_push(P, P[GNEWER], P[GOLDER], h, node)
    keys, vals = _table(P)
    index_put(keys, vals, key, node)
