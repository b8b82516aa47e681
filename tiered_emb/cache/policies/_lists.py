"""Doubly linked lists inside the policy state ``P``: the insertion-order policies' queues
and the ghost lists.

A list is a header triple ``P[h]`` (newest), ``P[h + 1]`` (oldest), ``P[h + 2]`` (length),
and two link regions at offsets ``newer`` and ``older`` (``P[newer + node]`` is the node
after ``node`` towards the newest end, ``NIL`` at the end).  A node is on at most one list
of the same links at a time.
"""

from __future__ import annotations

import numba

from tiered_emb.cache.policies._state import NIL


@numba.njit(inline="never")
def list_unlink(P, newer, older, h, node):
    """Take ``node`` out of the list of triple ``h``."""
    a = P[older + node]
    b = P[newer + node]
    if a == NIL:
        P[h + 1] = b
    else:
        P[newer + a] = b
    if b == NIL:
        P[h] = a
    else:
        P[older + b] = a
    P[h + 2] -= 1


@numba.njit(inline="never")
def list_push(P, newer, older, h, node):
    """Append ``node`` at the newest end of the list of triple ``h``."""
    n = P[h]
    P[older + node] = n
    P[newer + node] = NIL
    if n == NIL:
        P[h + 1] = node
    else:
        P[newer + n] = node
    P[h] = node
    P[h + 2] += 1
