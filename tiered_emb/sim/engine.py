"""Run one policy over one trace: the simulator's policy registry.

A policy is data, as in :mod:`tiered_emb.policies`: :data:`SIM_POLICIES` maps a name to
its kernel driver and to libCacheSim's name for the same algorithm.  ``lru`` and ``lfu``
are the store's policies: their simulator kernels make the store's decisions (the tests
compare them with :func:`tiered_emb.tiers.cache._simulate_requests` request by request)
and ``lru-store`` / ``lfu-store`` run the store's own kernel, for cross-checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ConfigError
from ..tiers.cache import simulate as _store_simulate
from . import policies as _p


@dataclass(frozen=True)
class SimPolicy:
    summary: str
    run: Callable            # (trace, capacity, hit_flags, index=, max_id=) -> hits
    libcachesim: str | None  # class name in the libcachesim package, or None
    offline: bool = False    # needs the future (next-use array)


def _store(name):
    def run(trace, capacity, hit_flags, index="auto", max_id=None):
        if hit_flags.shape[0]:
            raise ConfigError(f"policy {name + '-store'!r} does not record hit flags", f"use {name!r}")
        return _store_simulate(trace, capacity, name)
    return run


SIM_POLICIES: dict[str, SimPolicy] = {
    "lru": SimPolicy("least recently used (the store's LRU)", _p.lru_hits, "LRU"),
    "lfu": SimPolicy("fewest uses since admission, then least recent (the store's LFU)", _p.lfu_hits, "LFU"),
    "fifo": SimPolicy("first in, first out", _p.fifo_hits, "FIFO"),
    "clock": SimPolicy("FIFO with a reference bit (second chance)", _p.clock_hits, "Clock"),
    "sieve": SimPolicy("SIEVE: visited bit, hand from old to new, no reordering", _p.sieve_hits, "Sieve"),
    "s3fifo": SimPolicy("S3-FIFO: small + main FIFO + ghost ids", _p.s3fifo_hits, "S3FIFO"),
    "arc": SimPolicy("ARC: adaptive split of recency and frequency lists with ghosts", _p.arc_hits, "ARC"),
    "belady": SimPolicy("Belady's MIN (offline optimum): evict the farthest next use", _p.belady_hits,
                        "Belady", offline=True),
    "lru-store": SimPolicy("the store's LRU kernel itself (slower; a cross-check)", _store("lru"), "LRU"),
    "lfu-store": SimPolicy("the store's LFU kernel itself (slower; a cross-check)", _store("lfu"), "LFU"),
}


def check_policy(name: str) -> SimPolicy:
    """The :class:`SimPolicy` called ``name``, or a :class:`ConfigError` listing the names."""
    try:
        return SIM_POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}", f"choose from {', '.join(SIM_POLICIES)}") from None


def simulate(trace: np.ndarray, capacity: int, policy: str = "lru", *, hit_flags: bool = False,
             next_use: np.ndarray | None = None, index: str = "auto"):
    """Hits of ``policy`` with a cache of ``capacity`` objects on ``trace``.

    Parameters
    ----------
    trace : int64 array (n,), one id per request
    capacity : int, cache size in objects (>= 1)
    policy : str, a key of :data:`SIM_POLICIES`
    hit_flags : bool, also return uint8 (n,) with 1 at each hit
    next_use : int64 array (n,), optional, :func:`next_use_of` of ``trace`` (Belady
        computes it otherwise; pass it to share it between sizes)
    index : str, the kernels' id -> slot index: "auto" (a dense array over the id space
        when the ids are bounded, see :func:`tiered_emb.sim.policies.dense_ok`, else the
        store's hash table), "dense" or "hash"; the hits are the same, only speed differs

    Returns
    -------
    int, or ``(int, uint8 array (n,))`` with ``hit_flags``

    Examples
    --------
    >>> simulate(np.array([1, 2, 1, 3, 1, 2]), 2, "lru")
    2
    >>> simulate(np.array([1, 2, 3, 1, 2, 3]), 2, "belady")
    2
    """
    spec = check_policy(policy)
    capacity = int(capacity)
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 object, got {capacity}", "give a positive cache size")
    trace = np.ascontiguousarray(trace, dtype=np.int64)
    if index not in ("auto", "dense", "hash"):
        raise ConfigError(f"unknown index {index!r}", "choose from auto, dense, hash")
    lo, hi = _p.id_range(trace)
    if lo < 0:
        raise ConfigError(f"ids must be >= 0, got {lo}", "offset the ids of the trace")
    if index == "dense" and hi >= 2**31 - 1:
        raise ConfigError(f"a dense index cannot hold id {hi}", "use index='hash' or 'auto'")
    flags = np.zeros(trace.shape[0] if hit_flags else 0, dtype=np.uint8)
    if spec.offline:
        hits = spec.run(trace, capacity, flags, next_use, index=index, max_id=hi)
    else:
        hits = spec.run(trace, capacity, flags, index=index, max_id=hi)
    return (int(hits), flags) if hit_flags else int(hits)
