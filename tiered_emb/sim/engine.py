"""Run one policy over one trace: the simulator's policy registry.

A policy is data, as in :mod:`tiered_emb.cache.policies`: :data:`SIM_POLICIES` maps a name to
its kernel driver and to libCacheSim's name for the same algorithm.  The names are the
CLI's.  ``lru``, ``lfu``, ``fifo``, ``clock`` and ``sieve`` name the simulator's *twins* of
the store's policies of those names (:mod:`tiered_emb.sim.policies`): other kernels that
make the same decisions as the store's, which ``SimPolicy.twin`` names and
``tests/cache/test_policy_contract.py`` checks request by request; ``<name>-store`` runs
the store's own kernel (:func:`tiered_emb.cache.slots.simulate`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tiered_emb._args import as_ids, check_nonneg, int_arg
from tiered_emb.cache.slots import simulate as _store_simulate
from tiered_emb.errors import ConfigError
from tiered_emb.sim import policies as _p


@dataclass(frozen=True)
class SimPolicy:
    summary: str
    run: Callable  # (trace, capacity, hit_flags, index=, max_id=) -> hits
    libcachesim: str | None  # class name in the libcachesim package, or None
    offline: bool = False  # needs the future (next-use array)
    twin: str | None = None  # the store policy (a key of cache.policies.POLICIES) it decides as


def _store(name):
    def run(trace, capacity, hit_flags, index="auto", max_id=None):
        if hit_flags.shape[0]:
            raise ConfigError(f"policy {name + '-store'!r} does not record hit flags", f"use {name!r}")
        return _store_simulate(trace, capacity, name)

    return run


SIM_POLICIES: dict[str, SimPolicy] = {
    "lru": SimPolicy("least recently used (twin of the store's LRU)", _p.lru_hits, "LRU", twin="lru"),
    "lfu": SimPolicy(
        "fewest uses since admission, then least recent (twin of the store's LFU)", _p.lfu_hits, "LFU", twin="lfu"
    ),
    "fifo": SimPolicy("first in, first out (twin of the store's FIFO)", _p.fifo_hits, "FIFO", twin="fifo"),
    "clock": SimPolicy(
        "FIFO with a reference bit, second chance (twin of the store's CLOCK)", _p.clock_hits, "Clock", twin="clock"
    ),
    "sieve": SimPolicy(
        "SIEVE: visited bit, hand from old to new, no reordering (twin of the store's SIEVE)",
        _p.sieve_hits,
        "Sieve",
        twin="sieve",
    ),
    "s3fifo": SimPolicy(
        "S3-FIFO: small + main FIFO + ghost ids (twin of the store's S3-FIFO)", _p.s3fifo_hits, "S3FIFO", twin="s3fifo"
    ),
    "arc": SimPolicy(
        "ARC: adaptive split of recency and frequency lists with ghosts (twin of the store's ARC)",
        _p.arc_hits,
        "ARC",
        twin="arc",
    ),
    "belady": SimPolicy(
        "Belady's MIN (offline optimum): evict the farthest next use", _p.belady_hits, "Belady", offline=True
    ),
    "lru-store": SimPolicy("the store's LRU kernel itself (slower; a cross-check)", _store("lru"), "LRU", twin="lru"),
    "lfu-store": SimPolicy("the store's LFU kernel itself (slower; a cross-check)", _store("lfu"), "LFU", twin="lfu"),
    **{
        f"{name}-store": SimPolicy(f"the store's {lcs} kernel itself (a cross-check)", _store(name), lcs, twin=name)
        for name, lcs in (
            ("fifo", "FIFO"),
            ("clock", "Clock"),
            ("sieve", "Sieve"),
            ("s3fifo", "S3FIFO"),
            ("arc", "ARC"),
        )
    },
}


def check_policy(name: str) -> SimPolicy:
    """The :class:`SimPolicy` called ``name``, or a :class:`ConfigError` listing the names."""
    try:
        return SIM_POLICIES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown policy {name!r}", f"choose from {', '.join(SIM_POLICIES)}") from None


def simulate(
    trace: np.ndarray,
    capacity: int,
    policy: str = "lru",
    *,
    hit_flags: bool = False,
    next_use: np.ndarray | None = None,
    index: str = "auto",
):
    """Hits of ``policy`` with a cache of ``capacity`` objects on ``trace``.

    Parameters
    ----------
    trace : integer array (n,), one id per request, ids >= 0 (:class:`IdTypeError` for
        floats or another shape, :class:`IdRangeError` for negative ids or ids beyond int64)
    capacity : int, cache size in objects (>= 1); any size above ``n`` gives the hits of
        ``n`` (nothing is ever evicted) and only that much memory is allocated
    policy : str, a key of :data:`SIM_POLICIES`
    hit_flags : bool, also return uint8 (n,) with 1 at each hit
    next_use : integer array (n,), optional, Belady only: must equal :func:`next_use_of`
        of ``trace`` (a :class:`ConfigError` otherwise); checking that costs the pass it
        would save, so it is a cross-check only (:func:`opt_curve` shares one pass
        between sizes)
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
    capacity = int_arg("capacity", capacity, hint="give a cache size of at least 1 object (an int)")
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1 object, got {capacity}", "give a positive cache size")
    trace = as_ids(trace)
    if index not in ("auto", "dense", "hash"):
        raise ConfigError(f"unknown index {index!r}", "choose from auto, dense, hash")
    lo, hi = _p.id_range(trace)
    check_nonneg(lo)
    if index == "dense" and hi >= 2**31 - 1:
        raise ConfigError(f"a dense index cannot hold id {hi}", "use index='hash' or 'auto'")
    n = trace.shape[0]
    if next_use is not None:
        if not spec.offline:
            raise ConfigError(f"policy {policy!r} does not use next_use", "pass next_use only with 'belady'")
        next_use = _checked_next_use(trace, next_use, hi)
    # A cache of n objects never evicts on n requests (no policy evicts before it is full),
    # so every larger cache gives the same hits: run that one, not an allocation of
    # ``capacity`` slots (which may not fit in memory).
    run_cap = min(capacity, max(n, 1))
    flags = np.zeros(n if hit_flags else 0, dtype=np.uint8)
    if spec.offline:
        hits = spec.run(trace, run_cap, flags, next_use, index=index, max_id=hi)
    else:
        hits = spec.run(trace, run_cap, flags, index=index, max_id=hi)
    return (int(hits), flags) if hit_flags else int(hits)


def _checked_next_use(trace: np.ndarray, next_use, max_id: int) -> np.ndarray:
    """``next_use`` if it is exactly :func:`next_use_of` of ``trace``, else a :class:`ConfigError`.

    Why exactly: Belady's kernel trusts it to keep its heap and its stack of never-again
    slots in bounds; a next_use that skips a request of an id (each entry still later, on
    the same id) can push a slot on that stack twice and write past it.  Telling such an
    array from the real one takes the next-use pass itself, so that is the check.
    """
    n = trace.shape[0]
    nu = np.asarray(next_use)
    if nu.ndim != 1 or nu.shape[0] != n or (n and nu.dtype.kind not in "iu"):
        raise ConfigError(
            f"next_use has dtype {nu.dtype} and shape {nu.shape}, the trace {n} requests",
            "pass next_use_of(trace) (integers, one per request) or leave next_use out",
        )
    expect = _p.next_use_of(trace, np.int32 if n < 2**31 else np.int64, max_id)
    if not np.array_equal(nu, expect):
        i = int(np.flatnonzero(nu != expect)[0])
        raise ConfigError(
            f"next_use[{i}] is {int(nu[i])}, but the next request of id {int(trace[i])} after "
            f"position {i} is at {int(expect[i])} ({n} if none)",
            "pass next_use_of(trace) of this very trace, or leave next_use out",
        )
    return expect
