"""Lookahead in the simulator: the store's prefetch window, batch by batch, and windowed Belady.

A training step needs all the rows of its batch at once, and a trainer knows the next
batches.  Here a trace is cut into batches (the unique ids of each, in first-occurrence
order) and run three ways, over the same batches:

- :func:`store_hits`: the store's own decisions (a bring-up's three stages,
  :mod:`tiered_emb.cache.bringup`; the window's pins, :func:`~tiered_emb.cache.slots.cache_pin_found`
  within :func:`~tiered_emb.prefetch.window.pin_budget`) made as
  :func:`tiered_emb.prefetch.lookahead` makes them with window ``k``: before step ``t``
  batch ``t + k`` is prefetched (pinned in HBM; a ``lookahead+`` policy pins its
  resident rows at once, and those that came up since for the window's later batches
  (under LRU only if a step placed rows since),
  the worker brings up the rest within the pin budget), then step
  ``t`` resolves its batch, then its ticket is released.  ``k = 0`` is demand caching
  with the plain policy.  An exclusive DDR tier below takes HBM's victims and gives
  rows back on HBM misses, as in the store.  The one thing fixed here that the store
  leaves to timing is the order of the background thread's work against the step:
  the simulator brings batch ``t + k`` up before step ``t`` (the best case of the
  overlap).  Rows and results never depend on that order; hit counts may, a little.
- :func:`window_belady_hits`: offline Belady with the same window: at a miss evict
  the resident row whose next use is farthest, where only uses within batches
  ``t .. t + k`` are known; rows with no use in the window count as never used again,
  least recently used first among them.  Rows of the batch in progress are never
  evicted (the step holds them all).
- full Belady on the same stream of unique ids (``simulate(uids, capacity, "belady")``),
  which knows the whole future and ignores batches: a bound no window reaches.

A *miss* of a tier is a row brought into it on behalf of a batch, whether by the
prefetch thread or by the step: prefetch hides the latency of a miss, it does not
remove it.  Hit rate = 1 - misses / unique ids per batch, summed over batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from tiered_emb._args import as_ids, check_nonneg, int_arg
from tiered_emb.cache.bringup import decide_down, decide_up
from tiered_emb.cache.index import index_del, index_find, index_find_many, index_put, new_index
from tiered_emb.cache.policies import POLICIES, policy_code
from tiered_emb.cache.slots import CAPACITY, PINNED, CacheTier, cache_pin_found, cache_release
from tiered_emb.errors import ConfigError
from tiered_emb.prefetch.window import pin_budget, repin_due
from tiered_emb.sim.policies import id_range, next_use_of
from tiered_emb.step.plan import dedupe_into


@numba.njit(cache=True)
def _batch_uniques(trace, batch_size, uids, boff):
    """Unique ids of each batch of ``batch_size`` requests, in first-occurrence order; returns their count."""
    n = trace.shape[0]
    nb = (n + batch_size - 1) // batch_size
    inverse = np.empty(min(batch_size, n), dtype=np.int64)  # no batch is longer than the trace
    w = 0
    boff[0] = 0
    for b in range(nb):
        lo = b * batch_size
        hi = min(n, lo + batch_size)
        k = dedupe_into(trace[lo:hi], uids[w:], inverse[: hi - lo])
        w += k
        boff[b + 1] = w
    return w


def batch_uniques(trace: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(uids, boff)``: batch ``b`` asks for ``uids[boff[b]:boff[b+1]]`` (distinct, first-occurrence order).

    Examples
    --------
    >>> u, off = batch_uniques(np.array([3, 3, 1, 1, 2, 1]), 3)
    >>> u.tolist(), off.tolist()
    ([3, 1, 1, 2], [0, 2, 4])
    """
    batch_size = int_arg("batch_size", batch_size, 1, hint="use a batch of at least 1 request")
    trace = as_ids(trace)
    check_nonneg(id_range(trace)[0])  # -1 is the dedupe table's empty key
    nb = (trace.shape[0] + batch_size - 1) // batch_size
    uids = np.empty(trace.shape[0], dtype=np.int64)
    boff = np.empty(nb + 1, dtype=np.int64)
    w = _batch_uniques(trace, batch_size, uids, boff)
    return uids[:w].copy(), boff


@numba.njit(cache=True)
def _first_repeating_batch(uids, boff):
    """The first batch whose ids are not distinct, or -1 (ids >= 0)."""
    nb = boff.shape[0] - 1
    most = 0
    for b in range(nb):
        most = max(most, boff[b + 1] - boff[b])
    uniq = np.empty(most, dtype=np.int64)
    inverse = np.empty(most, dtype=np.int64)
    for b in range(nb):
        lo, hi = boff[b], boff[b + 1]
        if hi > lo and dedupe_into(uids[lo:hi], uniq, inverse[: hi - lo]) != hi - lo:
            return b
    return -1


def _checked_batches(uids, boff) -> tuple[np.ndarray, np.ndarray]:
    """``(uids, boff)`` as int64 arrays if they are batches as :func:`batch_uniques` makes
    them (ids >= 0, distinct within each batch, ``boff`` from 0 to ``len(uids)``, non
    decreasing); else a typed error.  One pass over the ids (the kernels trust all that)."""
    uids = as_ids(uids, "uids")
    if uids.shape[0]:
        check_nonneg(id_range(uids)[0], "uids")
    b = np.asarray(boff)
    if b.ndim != 1 or b.shape[0] < 1 or b.dtype.kind not in "iu":
        raise ConfigError(
            f"boff has dtype {b.dtype} and shape {b.shape}", "pass the (uids, boff) of batch_uniques(trace, batch_size)"
        )
    b = np.ascontiguousarray(b, dtype=np.int64)
    if int(b[0]) != 0 or int(b[-1]) != uids.shape[0] or bool(np.any(b[1:] < b[:-1])):
        raise ConfigError(
            f"boff (from {int(b[0])} to {int(b[-1])}) does not cut {uids.shape[0]} uids into batches",
            "pass the (uids, boff) of batch_uniques(trace, batch_size)",
        )
    if uids.shape[0]:
        rep = _first_repeating_batch(uids, b)
        if rep >= 0:
            raise ConfigError(
                f"batch {rep} repeats an id", "pass each batch's distinct ids: batch_uniques(trace, batch_size)"
            )
    return uids, b


def _no_eviction_rows(rows: int, lookups: int) -> int:
    """Tier rows that change no count on a run of ``lookups`` ids: from ``4 * lookups + 16``
    rows on, a tier never evicts (it can hold every id of the run), its pin budget (rows
    less an eighth, less the pinned ones: over ``3 * lookups``) never stops a pin or a
    load, and no step is cut into chunks, so every larger tier makes the same decisions.
    Allocating only that much keeps a huge ``hbm_rows`` / ``ddr_rows`` from exhausting memory."""
    return min(rows, 4 * lookups + 16)


# --------------------------------------------------------------------------- the store's kernels
@numba.njit(cache=True)
def _bring_up_counted(tag, h, d, dfilled, ids, force_pin, cnt):
    """A bring-up of ``ids`` by the store's three stages (:mod:`tiered_emb.cache.bringup`),
    no row moved: both tiers probed, HBM's decisions and DDR's take, DDR's admission of
    HBM's victims.  ``h``, ``d``: the tiers' :class:`~tiered_emb.cache.slots.Slots`,
    ``dfilled`` DDR's admit scratch.  ``cnt``: [hbm misses, ddr hits] (added to).
    Returns ``(slots, pinned)``."""
    k = ids.shape[0]
    probe = np.empty(k, dtype=np.int64)
    index_find_many(h.keys, h.vals, ids, probe, 0, -1)
    missing = ids[probe < 0]
    ddr_slots = np.empty(missing.shape[0], dtype=np.int64)
    index_find_many(d.keys, d.vals, missing, ddr_slots, 0, -1)
    dirty = np.empty(missing.shape[0], dtype=np.uint8)
    out, n_miss, n_v, pinned, n_ddr = decide_up(tag, h, tag, d, ids, force_pin, probe, missing, ddr_slots, dirty, 0)
    if n_v < 0:
        raise RuntimeError("HBM chunk larger than its unpinned capacity")  # the pin budget rules this out
    cnt[0] += n_miss
    cnt[1] += n_ddr
    if n_v > 0:
        dest, ev_ids, ev_src = np.empty(n_v, np.int64), np.empty(n_v, np.int64), np.empty(n_v, np.int64)
        ev_tabs = np.empty(n_v, np.int32)
        vids, vdirty = out.victim_ids[:n_v], out.victim_dirty[:n_v]
        decide_down(tag, d, dfilled, vids, ev_tabs[:0], vdirty, dest, ev_ids, ev_tabs, ev_src)
    return out.slots, pinned


@numba.njit
def _pin_resident(tag, h, cap, uids, boff, j, ticket_slots, in_ticket, tlen):
    """Pin for batch ``j`` its resident rows not yet pinned for it: the window's kernel and
    rule (``Window.pin_resident``: :func:`~tiered_emb.cache.slots.cache_pin_found` within
    :func:`~tiered_emb.prefetch.window.pin_budget`), the batch's ticket kept in the arrays
    of :func:`_store_lookahead`."""
    todo = np.flatnonzero(~in_ticket[boff[j] : boff[j + 1]]) + boff[j]
    at = np.empty(todo.shape[0], dtype=np.int64)
    slots = np.empty(todo.shape[0], dtype=np.int64)
    n = cache_pin_found(tag, h, uids[todo], max(pin_budget(cap, h.meta[PINNED]), 0), at, slots, 0)
    in_ticket[todo[at[:n]]] = True
    n0 = tlen[j]
    ticket_slots[boff[j] + n0 : boff[j] + n0 + n] = slots[:n]
    tlen[j] = n0 + n


@numba.njit(cache=True)
def _store_lookahead(tag, h, d, dfilled, early_pin, k, load, uids, boff, counts):
    """Batches through the store's kernels with a prefetch window of ``k`` (see the module doc).

    Before step ``t`` batch ``t + k`` enters the window (a ``lookahead+`` policy pins its
    resident rows, after the rows that came up since for the window's later batches) and
    batch ``t + load`` is brought up (its other rows, within the pin
    budget).  ``counts`` int64 (nb, 3) receives per batch: [unique ids, HBM misses, DDR hits].
    """
    nb = boff.shape[0] - 1
    cap = h.meta[CAPACITY]
    # Ticket of batch j: its pinned slots ticket_slots[boff[j]:boff[j] + tlen[j]]; in_ticket
    # marks its ids already pinned.
    ticket_slots = np.empty(uids.shape[0], dtype=np.int64)
    in_ticket = np.zeros(uids.shape[0], dtype=np.bool_)
    tlen = np.zeros(nb, dtype=np.int64)
    cnt = np.zeros(2, dtype=np.int64)
    step_placed = False  # a step brought rows up since the window was last re-pinned
    for t in range(-k, nb):
        if k > 0 and early_pin and t + k < nb:
            # As batch t + k enters the window (Window.enter): first, if a step
            # placed rows since the last time (or the base policy is not LRU: see
            # Window.repin), the rows that came up since the later batches
            # of the window entered it are pinned for them (every batch but the oldest,
            # nearest first; Window.repin), then the resident rows of the
            # batch entering.
            first = max(t, 0) + 1 if repin_due(policy_code(tag), step_placed) else t + k
            step_placed = False
            for j in range(first, t + k + 1):
                _pin_resident(tag, h, cap, uids, boff, j, ticket_slots, in_ticket, tlen)
        j = t + load  # batch brought up before step t
        if load > 0 and 0 <= j < nb:
            budget = pin_budget(cap, h.meta[PINNED])
            idx = np.flatnonzero(~in_ticket[boff[j] : boff[j + 1]])[: max(budget, 0)] + boff[j]
            take = uids[idx]
            in_ticket[idx] = True
            if take.shape[0] > 0:
                cnt[:] = 0
                slots, _ = _bring_up_counted(tag, h, d, dfilled, take, True, cnt)
                n_t = tlen[j]
                ticket_slots[boff[j] + n_t : boff[j] + n_t + slots.shape[0]] = slots
                tlen[j] = n_t + slots.shape[0]
                counts[j, 1] += cnt[0]
                counts[j, 2] += cnt[1]
        if t < 0:
            continue
        # Step t: Resolver.chunks over the batch, by unpinned capacity.
        u = uids[boff[t] : boff[t + 1]]
        counts[t, 0] = u.shape[0]
        free_cap = cap - h.meta[PINNED]
        if free_cap < 1:
            return -1
        cnt[:] = 0
        for start in range(0, u.shape[0], free_cap):
            chunk = u[start : start + free_cap]
            slots, pinned = _bring_up_counted(tag, h, d, dfilled, chunk, False, cnt)
            if pinned:
                cache_release(tag, h, slots)
        step_placed = step_placed or cnt[0] > 0
        counts[t, 1] += cnt[0]
        counts[t, 2] += cnt[1]
        if tlen[t] > 0:
            cache_release(tag, h, ticket_slots[boff[t] : boff[t] + tlen[t]])
    return 0


@dataclass(frozen=True)
class TierHits:
    """Hit counts of one run over a batched trace."""

    lookups: int  # unique ids summed over batches
    hbm_hits: int
    ddr_lookups: int  # HBM misses
    ddr_hits: int

    @property
    def hbm_hit_rate(self) -> float:
        return self.hbm_hits / self.lookups if self.lookups else 0.0

    @property
    def ddr_hit_rate(self) -> float:
        """DDR hits per HBM miss."""
        return self.ddr_hits / self.ddr_lookups if self.ddr_lookups else 0.0


def store_hits(
    uids: np.ndarray,
    boff: np.ndarray,
    hbm_rows: int,
    policy: str = "lru",
    window: int = 0,
    ddr_rows: int = 0,
    load_ahead: int | None = None,
) -> TierHits:
    """Hits of the store's HBM and DDR tiers on batches ``(uids, boff)`` (see :func:`batch_uniques`).

    Parameters
    ----------
    hbm_rows, ddr_rows : tier capacities
    policy : a name of :data:`tiered_emb.cache.policies.POLICIES` (``lru``, ``lfu``, ``lookahead+lru``, ...)
    window : prefetch window k (batches handed over ahead of the step); 0 = no prefetch
    load_ahead : batches ahead whose rows are brought up (<= window; default: window)

    Examples
    --------
    >>> u, off = batch_uniques(np.array([1, 2, 1, 3, 1, 2, 4, 2]), 2)
    >>> store_hits(u, off, 2, "lru").hbm_hits
    3
    """
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(f"policy {policy!r} is unknown", f"use one of {sorted(POLICIES)}")
    hbm_rows = int_arg("hbm_rows", hbm_rows, hint="use hbm_rows >= 2 (an int)")
    ddr_rows = int_arg("ddr_rows", ddr_rows, hint="use ddr_rows >= 0 (an int)")
    window = int_arg("window", window, hint="use window >= 0 (an int)")
    if hbm_rows < 2 or ddr_rows < 0 or window < 0:
        raise ConfigError(
            f"hbm_rows={hbm_rows}, ddr_rows={ddr_rows}, window={window} are invalid",
            "use hbm_rows >= 2, ddr_rows >= 0, window >= 0",
        )
    load = window if load_ahead is None else int_arg("load_ahead", load_ahead, hint="use 0 <= load_ahead <= window")
    if not 0 <= load <= window:
        raise ConfigError(f"load_ahead={load_ahead} is invalid for window={window}", "use 0 <= load_ahead <= window")
    uids, boff = _checked_batches(uids, boff)
    # a window past the last batch sees what one up to it sees (and the loop runs once per
    # batch of the window)
    window, load = min(window, boff.shape[0] - 1), min(load, boff.shape[0] - 1)
    hbm = CacheTier(_no_eviction_rows(hbm_rows, uids.shape[0]), policy)
    ddr = CacheTier(_no_eviction_rows(ddr_rows, uids.shape[0]), policy)
    counts = np.zeros((boff.shape[0] - 1, 3), dtype=np.int64)
    rc = _store_lookahead(
        hbm.tag,
        hbm.state,
        ddr.state,
        np.full(ddr.slot_ids.shape[0], -1, dtype=np.int32),  # DDR's admit scratch, -1 between calls
        POLICIES[policy].lookahead,
        window,
        load,
        uids,
        boff,
        counts,
    )
    if rc != 0:
        raise ConfigError(
            f"every HBM row is pinned (hbm_rows={hbm_rows}, window={window})",
            "give HBM more rows or use a smaller window",
        )
    lookups, misses, ddr_hits = (int(x) for x in counts.sum(axis=0))
    return TierHits(lookups, lookups - misses, misses, ddr_hits)


# --------------------------------------------------------------------------- windowed Belady
_INF = np.int64(1) << np.int64(62)  # keys at or above: no use within the window (plus n - last use: LRU first)
_HELD = np.int64(-1)  # rows of the batch in progress


@numba.njit(inline="always")
def _reheap(heap, hpos, due, s, n):
    """Restore the max-heap on ``due`` after ``due[s]`` changed (ties: higher slot first)."""
    i = hpos[s]
    while i > 0:  # up
        p = (i - 1) >> 1
        q = heap[p]
        if due[s] < due[q] or (due[s] == due[q] and s < q):
            break
        heap[i] = q
        hpos[q] = i
        i = p
    while True:  # down
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n:
            a, b = heap[c + 1], heap[c]
            if due[a] > due[b] or (due[a] == due[b] and a > b):
                c += 1
        q = heap[c]
        if due[q] < due[s] or (due[q] == due[s] and q < s):
            break
        heap[i] = q
        hpos[q] = i
        i = c
    heap[i] = s
    hpos[s] = i


class _BeladySlots(NamedTuple):
    """Windowed Belady's slots (int64, one entry a slot) and the heap over them."""

    slot_ids: np.ndarray  # the id held (-1: none)
    due: np.ndarray  # the key the heap orders by: the next use in the window, else the ties' order
    nu: np.ndarray  # the next use of the id (a position of ``uids``)
    last: np.ndarray  # its last use
    count: np.ndarray  # its uses since admission
    heap: np.ndarray  # slots, the largest ``due`` first
    hpos: np.ndarray  # each slot's place in ``heap``


@numba.njit(cache=True)
def _window_belady(uids, boff, next_use, k, capacity, by_count, index, slots):
    keys, vals = index
    slot_ids, due, nu, last, count, heap, hpos = slots
    nb = boff.shape[0] - 1
    n = uids.shape[0]
    hits = 0
    used = 0
    for t in range(nb):
        # Batches up to t + k are in the window now: their resident rows get a finite next use.
        lo_b = 0 if t == 0 else t + k
        for j in range(lo_b, min(t + k + 1, nb)):
            for p in range(boff[j], boff[j + 1]):
                s = index_find(keys, vals, uids[p])
                if s >= 0 and due[s] >= _INF and nu[s] == p:
                    due[s] = p
                    _reheap(heap, hpos, due, s, used)
        for p in range(boff[t], boff[t + 1]):
            key = uids[p]
            s = index_find(keys, vals, key)
            if s >= 0:
                hits += 1
                count[s] += 1
            elif used < capacity:
                s = used
                heap[used] = s
                hpos[s] = used
                used += 1
                slot_ids[s] = key
                index_put(keys, vals, key, s)
                count[s] = 1
            else:
                s = heap[0]
                if due[s] == _HELD:
                    return -1  # the batch alone exceeds the capacity
                index_del(keys, vals, slot_ids[s])
                slot_ids[s] = key
                index_put(keys, vals, key, s)
                count[s] = 1
            due[s] = _HELD
            nu[s] = next_use[p]
            last[s] = p
            _reheap(heap, hpos, due, s, used)
        end = boff[min(t + k + 2, nb)]  # the window of the next step
        for p in range(boff[t], boff[t + 1]):
            s = index_find(keys, vals, uids[p])
            if nu[s] < end:
                due[s] = nu[s]
            elif by_count:  # fewest uses since admission first, then least recent (the store's LFU)
                due[s] = _INF + (n + 1 - count[s]) * (n + 1) + (n - last[s])
            else:  # least recent first (the store's LRU)
                due[s] = _INF + (n - last[s])
            _reheap(heap, hpos, due, s, used)
    return hits


def window_belady_hits(uids: np.ndarray, boff: np.ndarray, capacity: int, window: int, ties: str = "lru") -> int:
    """HBM hits of offline Belady knowing the next ``window`` batches (see the module doc).

    ``ties`` orders the rows with no use in the window: ``"lru"`` least recently used
    first, ``"lfu"`` fewest uses since admission first, then least recently used (the
    order of the store's LRU and LFU, whose ``lookahead+`` variants it bounds).

    Examples
    --------
    >>> u, off = batch_uniques(np.array([1, 2, 3, 1, 4, 2]), 2)
    >>> window_belady_hits(u, off, 3, window=1)
    2
    """
    capacity = int_arg("capacity", capacity, hint="use capacity >= 1 (an int)")
    window = int_arg("window", window, hint="use window >= 0 (an int)")
    if capacity < 1 or window < 0 or ties not in ("lru", "lfu"):
        raise ConfigError(
            f"capacity={capacity}, window={window}, ties={ties!r} are invalid",
            "use capacity >= 1, window >= 0, ties 'lru' or 'lfu'",
        )
    uids, boff = _checked_batches(uids, boff)
    window = min(window, boff.shape[0] - 1)  # the same beyond the last batch (and no overflow of t + window)
    if uids.shape[0] >= 1 << 30:
        raise ConfigError(f"{uids.shape[0]} requests are too many for one run", "split the trace below 2**30 requests")
    # a cache of len(uids) rows never evicts: larger ones run as that one (same hits, its memory)
    cap = min(capacity, max(uids.shape[0], 1))
    keys, vals = new_index(cap)
    slots = _BeladySlots(np.full(cap, -1, dtype=np.int64), *(np.zeros(cap, dtype=np.int64) for _ in range(6)))
    hits = _window_belady(uids, boff, next_use_of(uids), window, cap, ties == "lfu", (keys, vals), slots)
    if hits < 0:
        raise ConfigError(
            f"a batch has more unique ids than capacity={capacity}", "use a larger cache or smaller batches"
        )
    return int(hits)


def compare_lookahead(
    trace: np.ndarray, batch_size: int, sizes: list[tuple[str, int]], window: int, load_ahead: int
) -> list[dict]:
    """HBM hit ratio of every lookahead run at each ``(label, hbm_rows)`` of ``sizes``.

    Runs, on the same batches: ``lru``, ``lfu`` (no window); ``lookahead+lru`` and
    ``lookahead+lfu`` with ``window`` and ``load_ahead``; windowed Belady (LRU and LFU
    ties); full Belady on the stream of unique ids.  Returns one dict per size and run.
    """
    from tiered_emb.sim.engine import simulate

    window = int_arg("window", window, 0, hint="use a window of >= 0 batches")
    load_ahead = int_arg("load_ahead", load_ahead, 0, window, hint="use 0 <= load_ahead <= window")
    for label, cap in sizes:
        if int_arg(f"cache size {label!r}", cap, hint="give HBM rows as an int") < 2:
            raise ConfigError(f"cache size {label!r} is {cap} HBM rows", "give HBM at least 2 rows")
    uids, boff = batch_uniques(trace, batch_size)
    runs = [
        ("lru", lambda c: store_hits(uids, boff, c, "lru").hbm_hits),
        ("lfu", lambda c: store_hits(uids, boff, c, "lfu").hbm_hits),
    ]
    for base in ("lru", "lfu"):
        runs.append(
            (
                f"lookahead+{base} k={window} L={load_ahead}",
                lambda c, b=base: store_hits(uids, boff, c, f"lookahead+{b}", window, load_ahead=load_ahead).hbm_hits,
            )
        )
    for ties in ("lru", "lfu"):
        runs.append(
            (f"window belady k={window} ({ties} ties)", lambda c, t=ties: window_belady_hits(uids, boff, c, window, t))
        )
    runs.append(("belady (full)", lambda c: simulate(uids, c, "belady")))
    rows = []
    for label, cap in sizes:
        for name, run in runs:
            hits = run(cap)
            rows.append(
                {
                    "cache": label,
                    "cache_objects": cap,
                    "policy": name,
                    "hits": int(hits),
                    "lookups": int(uids.shape[0]),
                    "hit_ratio": hits / uids.shape[0] if uids.shape[0] else 0.0,
                }
            )
    return rows


__all__ = ["TierHits", "batch_uniques", "compare_lookahead", "store_hits", "window_belady_hits"]
