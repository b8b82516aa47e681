"""The simulator's eviction policies: one kernel per policy over preallocated arrays.

Every kernel has the same shape: it runs a request trace (int64 ``(n,)``) through a cache
of ``capacity`` objects of unit size, admitting every missed id (demand paging, as
libCacheSim does), and returns the hit count.  ``hit_flags`` is either an empty uint8
array or a uint8 ``(n,)`` array that receives 1 at each hit (the tests compare it
request by request with :mod:`tiered_emb.testing.sim_reference`).

One module a policy, each with its driver ``<name>_hits``:

- :mod:`.lru`, :mod:`.lfu`, :mod:`.fifo`, :mod:`.clock`, :mod:`.sieve`, :mod:`.s3fifo`,
  :mod:`.arc`: twins of the store's policies (:mod:`tiered_emb.cache.policies`): the same
  decisions as the store's kernel (:func:`tiered_emb.cache.slots.simulate`), by simpler
  structures a request at a time;
- every one after libCacheSim's definitions so that hit ratios compare request for request
  (``docs/policies.md`` gives the few places where they do not, and why);
- :mod:`.belady`: the offline optimum, and :func:`next_use_of`, the future it reads;
- :mod:`.base`: the id -> slot index (dense array or the store's hash table), list links,
  prefetch distances; :mod:`.buffers`: scratch arrays kept between runs, a run's index.

Which store policy a kernel twins is data: ``SimPolicy.twin`` in :data:`tiered_emb.sim.SIM_POLICIES`.

>>> import numpy as np
>>> lru_hits(np.array([1, 2, 1, 3, 1, 2]), 2, np.zeros(0, np.uint8))
2
"""

from tiered_emb.sim.policies.arc import B1, B2, T1, T2, arc_hits
from tiered_emb.sim.policies.base import (
    DENSE_IDS_PER_REQUEST,
    DENSE_MAX_IDS,
    NIL,
    PREFETCH_AHEAD,
    PREFETCH_STATE_AHEAD,
    PREFETCH_STATE_MIN,
    dense_ok,
    id_range,
)
from tiered_emb.sim.policies.belady import belady_hits, next_use_of
from tiered_emb.sim.policies.buffers import SCRATCH_KEEP_BYTES, release_scratch, scratch, scratch_roles
from tiered_emb.sim.policies.clock import clock_hits
from tiered_emb.sim.policies.fifo import fifo_hits
from tiered_emb.sim.policies.lfu import lfu_hits
from tiered_emb.sim.policies.lru import lru_hits
from tiered_emb.sim.policies.s3fifo import s3fifo_hits, s3fifo_sizes
from tiered_emb.sim.policies.sieve import sieve_hits

__all__ = [
    "B1",
    "B2",
    "DENSE_IDS_PER_REQUEST",
    "DENSE_MAX_IDS",
    "NIL",
    "PREFETCH_AHEAD",
    "PREFETCH_STATE_AHEAD",
    "PREFETCH_STATE_MIN",
    "SCRATCH_KEEP_BYTES",
    "T1",
    "T2",
    "arc_hits",
    "belady_hits",
    "clock_hits",
    "dense_ok",
    "fifo_hits",
    "id_range",
    "lfu_hits",
    "lru_hits",
    "next_use_of",
    "release_scratch",
    "s3fifo_hits",
    "s3fifo_sizes",
    "scratch",
    "scratch_roles",
    "sieve_hits",
]
