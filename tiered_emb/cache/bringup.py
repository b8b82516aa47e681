"""A bring-up's decisions over an HBM cache tier and the DDR tier below it, no row moved.

The store's resolve (:mod:`tiered_emb.step.resolve`) and the simulator's lookahead
(:mod:`tiered_emb.sim.lookahead`) both decide through these functions.  A bring-up gives
every id of a chunk an HBM slot, in three stages:

1. **probe**: each id's HBM slot, and the DDR slots of the ids HBM lacks (the index's
   ``find``, twice).  Nothing changes: the store reads from the SSD tier here what
   neither tier holds, so a failed read leaves the tiers as they were.
2. :func:`decide_up`: HBM's resolve of the chunk (its hits pinned when some id misses,
   each miss given a free slot or the policy's victim) and DDR's take of the ids it holds
   (exclusive caching: they leave DDR, their rows still in their slots for the caller to
   copy up).  The halves share no state: the store runs them on two threads when DDR
   gives up many rows.
3. :func:`decide_down`: DDR's admission of HBM's victims, its own victims chosen (the
   dirty ones to be written back).

The store moves rows between the stages; the simulator moves none.  The decisions are
the same either way (``tests/sim/test_lookahead_sim.py`` holds the simulator's hit counts
to a store's).
"""

from __future__ import annotations

import numba

from tiered_emb.cache.slots import cache_admit_slots, cache_resolve_new, cache_take_slots

#: Stage 3: :func:`~tiered_emb.cache.slots.cache_admit_slots` on the DDR tier's state.
decide_down = cache_admit_slots


@numba.njit(cache=True, nogil=True)
def decide_up(htag, h, dtag, d, ids, force_pin, probe, missing, ddr_slots, dirty, tab):
    """Stage 2 for ``ids`` (int64 (k,), distinct, of table ``tab``; at most HBM's free plus
    unpinned slots) over the HBM state ``h`` and the DDR state ``d`` (:class:`Slots`, after
    their policies' tags).

    HBM's :func:`~tiered_emb.cache.slots.cache_resolve` (``probe``: HBM's slots of ``ids``
    just found, or empty), then DDR's :func:`~tiered_emb.cache.slots.cache_take_slots` of
    ``missing`` (the ids HBM lacked, in chunk order) at ``ddr_slots`` (their DDR slots just
    found, -1 where DDR lacks them too), their dirty flags written into ``dirty``.

    Returns ``(resolved, n_miss, n_victims, pinned, n_ddr)``: HBM's
    :class:`~tiered_emb.cache.slots.Resolved` (cut by the counts), and the rows DDR gave
    up.  ``n_victims`` is -1 when HBM ran out of unpinned slots (a caller's bug: chunks are
    cut by unpinned capacity); DDR is then left alone.
    """
    out, n_miss, n_v, pinned = cache_resolve_new(htag, h, ids, force_pin, probe, tab)
    if n_v < 0:
        return out, n_miss, n_v, pinned, 0
    n_ddr = cache_take_slots(dtag, d, missing, ddr_slots, dirty, tab)
    return out, n_miss, n_v, pinned, n_ddr


__all__ = ["decide_down", "decide_up"]
