"""The arrays a simulator run works in: scratch kept between runs, and each kernel's index.

>>> import numpy as np
>>> with scratch("example", 4, np.int32) as a:
...     a.shape
(4,)
>>> release_scratch()
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

from tiered_emb.cache.index import new_index
from tiered_emb.sim.policies.base import dense_ok, id_range

#: Largest scratch array (bytes) a thread keeps for its next run; larger ones are freed.
SCRATCH_KEEP_BYTES = 1 << 28


class _Kept(threading.local):
    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}


_KEPT = _Kept()


@contextmanager
def scratch(role: str, n: int, dtype):
    """An uninitialised ``dtype`` array of ``n`` for one run, given back when the run ends:
    the previous run's of this thread and ``role`` when it is large enough.

    Why: the arrays over the id space (the dense index, Belady's next uses and last
    positions: 40-120 MiB at 10M ids and 20M requests) are the same size run after run, and
    a fresh one is paid for again at its first touch, one page fault per page, the more so
    once another process has freed memory.  A sweep over policies and sizes faults them
    in once (docs/policies.md gives the measured effect).

    An array taken is not in the pool until given back, so two users of one role at once
    each get their own.  Arrays above :data:`SCRATCH_KEEP_BYTES` are not kept.
    """
    dtype = np.dtype(dtype)
    held = _KEPT.arrays.pop(role, None)
    if held is None or held.dtype != dtype or held.shape[0] < n:
        del held  # the old one is freed before the new one is made
        held = np.empty(max(n, 1), dtype=dtype)
    try:
        yield held[:n]
    finally:
        if held.nbytes <= SCRATCH_KEEP_BYTES:
            _KEPT.arrays[role] = held


def release_scratch() -> None:
    """Free the scratch arrays this thread keeps between runs (see :func:`scratch`)."""
    _KEPT.arrays.clear()


def scratch_roles() -> list[str]:
    """The roles whose arrays this thread keeps for its next run, sorted (see :func:`scratch`)."""
    return sorted(_KEPT.arrays)


# --------------------------------------------------------------------------- a kernel's index
@contextmanager
def kernel_state(trace, capacity, index, max_id, entries=None):
    """``(index, id dtype)`` for a kernel run of ``entries`` ids (default ``capacity``), for
    the run's duration (a dense index is a :func:`scratch` array).

    ``index`` is "auto" (dense when :func:`dense_ok`), "dense" or "hash"; ``max_id`` is
    the trace's largest id when the caller knows it.  Ids are kept as int32 beside a dense
    index (they fit), as int64 beside the hash table.
    """
    entries = capacity if entries is None else entries
    if index != "hash" and max_id is None:
        max_id = id_range(trace)[1]
    if index == "hash" or not (index == "dense" or dense_ok(max_id, trace.shape[0])):
        yield new_index(entries), np.int64  # the store's hash table (keys, vals)
        return
    with scratch("index", max(max_id + 1, 1), np.int32) as ix:
        ix.fill(-1)
        yield ix, np.int32
