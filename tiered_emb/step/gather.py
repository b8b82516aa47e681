"""Gather: rows out of HBM slots, one per id or pooled per bag (the forward's last stage).

:func:`gather` answers ``lookup`` (one row per id, duplicates allowed);
:func:`lookup_pooled` answers a batch of bags straight from the slots, with no gathered
copy: each bag summed in position order (one kernel family, :func:`pool_kernel`, compiled
per dim), bitwise what pooling the gathered rows gives.  When every row of the batch is
pinned in HBM for it by the prefetch window, the pooled forward reads them without the
store's lock (pinned slots are never victims).
"""

from __future__ import annotations

from dataclasses import replace

import numba
import numpy as np

from tiered_emb._backend import to_xp
from tiered_emb._compiles import made_by
from tiered_emb._jit import ROW_PREFETCH_DISTANCE, kernel, local_f32, prefetch_hint, take_rows, threads_for
from tiered_emb.precision import decode
from tiered_emb.step import narrow
from tiered_emb.step.device import plan as device_plan
from tiered_emb.step.plan import BagPlan, Forward, checked


@kernel(parallel=True)
def _gather_rows(records, slots, inverse, out):
    """``out[i] = records[slots[inverse[i]], :out.shape[1]]``; float32, (n, dim)."""
    dim = out.shape[1]
    for i in numba.prange(out.shape[0]):
        src = records[slots[inverse[i]]]
        dst = out[i]
        for j in range(dim):
            dst[j] = src[j]


@kernel(parallel=True)
def _gather_positions(records, slots, inverse, positions, first, out):
    """``out[p] = records[slots[inverse[p] - first], :dim]`` for each p in ``positions``."""
    dim = out.shape[1]
    for q in numba.prange(positions.shape[0]):
        p = positions[q]
        src = records[slots[inverse[p] - first]]
        for j in range(dim):
            out[p, j] = src[j]


# --------------------------------------------------------------------------- kernels
def pool_kernel(dim: int, direct: bool, weighted: bool):
    """The pooling kernel for rows of ``dim`` floats, compiled once per (dim, direct, weighted)
    (and cached on disk).

    With ``dim`` a compile-time constant the bag's running sum is a local array the
    compiler keeps in registers, where a view of ``out`` must go through memory on every
    row (it may alias ``records``).  ``weighted`` fixed at compile time too keeps a branch
    out of the row loop (docs/benchmarks.md, "Kernel choices").
    """
    found = _POOL_KERNELS.get((dim, direct, weighted))
    if found is not None:
        return found

    @numba.njit(parallel=True, cache=True, nogil=True)  # (Numba's lowering of its flag's reduction allocates)
    def _pool_rows(records, slots, index, guard, num_rows, offsets, weights, mean, out):
        """``out[b] = sum_i w_i * records[row(i), :dim]`` over bag b, in position order.

        ``row(i)`` is ``index[i]`` itself for a ``direct`` kernel (row id = slot, ``slots``
        unused), else ``slots[index[i]]``.  The arithmetic of :func:`tiered_emb.testing.reference.pool_bags` on
        rows it never copies.  ``records`` float32 (cap, W >= dim); ``out`` float32 (B, dim).

        With ``guard`` (a direct tier's ids, not validated yet) a bag stops at an id
        outside ``[0, num_rows)``, and a bag whose sum is NaN is flagged too: a direct
        tier's rows not brought up yet are NaN, stored rows finite.  Returns the number
        of bags flagged; any sends the caller to the checked path.
        """
        n = index.shape[0]
        flagged = 0
        for b in numba.prange(out.shape[0]):
            acc = local_f32(dim)  # on the stack: in registers (see local_f32)
            for j in range(dim):
                acc[j] = 0.0
            lo = offsets[b]
            hi = offsets[b + 1]
            bad = 0
            for i in range(lo, hi):
                if i + ROW_PREFETCH_DISTANCE < n:  # a hint: never faults, even on an unchecked id
                    d = i + ROW_PREFETCH_DISTANCE
                    ahead = index[d] if direct else slots[index[d]]
                    for c in range(0, dim, 16):  # the row's lines, not the optimizer state after them
                        prefetch_hint(records, (ahead, c))
                r = index[i] if direct else slots[index[i]]
                if guard and (r < 0 or r >= num_rows):
                    bad = 1
                    break
                src = records[r]
                if weighted:
                    w = weights[i]
                    for j in range(dim):
                        acc[j] += w * src[j]
                else:  # the same sums: 1.0 * x is x
                    for j in range(dim):
                        acc[j] += src[j]
            if guard and hi > lo and np.isnan(acc[0]):
                bad = 1
            flagged += bad
            if mean and hi > lo:
                inv = np.float32(1.0) / np.float32(hi - lo)
                for j in range(dim):
                    acc[j] *= inv
            for j in range(dim):
                out[b, j] = acc[j]
        return flagged

    _POOL_KERNELS[(dim, direct, weighted)] = made_by(_pool_rows, pool_kernel, dim, direct, weighted)
    return _pool_rows


_POOL_KERNELS: dict = {}


_NO_SLOTS = np.empty(0, dtype=np.int64)


def gather(res, t, uids: np.ndarray, inverse: np.ndarray):
    """Rows of ``uids[inverse]`` (float32 (n, dim)) on the HBM backend, resolved chunk by chunk."""
    n, dim = inverse.shape[0], t.cfg.dim
    xp, kernels = res.xp, res.kernels
    if uids.shape[0] <= t.hbm.unpinned_capacity:
        for _, slots in res.chunks(t, uids):
            if kernels is not None:
                out = kernels.gather(t.hbm.records, slots, inverse, dim)
            elif t.cfg.dtype != "float32":
                out = take_rows(decode(t.cfg.dtype, t.hbm.records, slots, dim), inverse)
            else:
                out = np.empty((n, dim), dtype=np.float32)
                _gather_rows(t.hbm.records, slots, inverse, out)
        return out if uids.shape[0] else xp.empty((0, dim), dtype=xp.float32)
    # Spill path: more unique ids than HBM holds; positions grouped by chunk.
    out_host = np.empty((n, dim), dtype=np.float32)
    cap = t.hbm.unpinned_capacity
    by_chunk = np.argsort(inverse // cap, kind="stable")
    bounds = np.searchsorted((inverse // cap)[by_chunk], np.arange(0, uids.shape[0] // cap + 2))
    for start, slots in res.chunks(t, uids):
        ci = start // cap
        positions = by_chunk[bounds[ci] : bounds[ci + 1]]
        if kernels is not None:
            rows = kernels.gather(t.hbm.records, slots, inverse[positions] - start, dim)
            out_host[positions] = kernels.to_host(rows)
        elif t.cfg.dtype != "float32":
            out_host[positions] = take_rows(decode(t.cfg.dtype, t.hbm.records, slots, dim), inverse[positions] - start)
        else:
            _gather_positions(t.hbm.records, slots, inverse, positions, start, out_host)
    return to_xp(xp, out_host)


def pool_rows(rows: np.ndarray, plan, weights: np.ndarray, out: np.ndarray) -> None:
    """Pool host rows (float32 (n, dim), one per position of ``plan``) into ``out`` (B, dim)."""
    positions = np.arange(rows.shape[0], dtype=np.int64)
    pool_kernel(rows.shape[1], True, plan.weights is not None)(
        rows, _NO_SLOTS, positions, False, 0, plan.offsets, weights, plan.mean, out
    )


def lookup_pooled(res, window, t, bags: BagPlan, backward: bool = True) -> tuple[object, Forward]:
    """Pooled rows of every bag of ``bags``, and the :class:`~tiered_emb.step.plan.Forward`
    record its backward consumes: ``(out, forward)``, ``out`` float32 (B, dim), host NumPy,
    or on the device (``res.xp``) when the step's CUDA kernels run there (``res.kernels``).

    ``res``: the store's :class:`~tiered_emb.step.resolve.Resolver`; ``window``: its
    prefetch window (the batch's rows may be pinned for it there).  The backend is chosen
    here, once, and named in the record.  Bitwise equal to pooling ``store.lookup(table,
    bags.ids)``.  ``bags`` not checked for ``t`` are checked here (:func:`checked`), but for
    the by-id read: ``backward=False`` (inference) lets a table held whole in HBM skip the
    dedupe and the check (its kernel guards the ids' range); its rows are read by id, and
    each position counts as one HBM lookup (with ``backward`` each unique id does, as
    everywhere else).
    """
    dim = t.cfg.dim
    out = np.empty((bags.num_bags, dim), dtype=np.float32)
    use_w = bags.weights is not None
    weights = bags.weights if use_w else np.empty(0, dtype=np.float32)
    if backward:
        pinned = window.pinned_batch(t.cfg.name, bags.ids)  # None on a device HBM
        if pinned is not None:
            # Every row is pinned in HBM for this very batch: pool from its slots with no
            # dedupe (the window did it), no resolve and no lock (the worker may be placing
            # the next batch's rows meanwhile; it never moves these).  The ids are the ones
            # handed to prefetch(), which checked them.
            ticket, uids, inverse, slots = pinned
            bags = bags if bags.table is t else replace(bags, table=t)
            fwd = Forward.of(t, bags, "pinned", slots, ticket, unique=(uids, inverse))
            t.count_hits(uids.shape[0])
            if res.kernels is not None:
                return res.kernels.pool(t.hbm.records, slots, inverse, bags.offsets, bags.weights, bags.mean, dim), fwd
            with threads_for(bags.ids.shape[0] * dim):
                _pool_slots(t, slots, inverse, fwd, weights, out)
            return out, fwd
    kernels = res.kernels
    direct = t.hbm.direct and kernels is None
    # The lock (re-entrant) for the whole read: a prefetch thread must not pin or evict
    # between the capacity check and the pooling (one chunk, so ``inverse`` indexes ``slots``).
    with res.lock, threads_for(bags.ids.shape[0] * dim):
        # Inference over a table held whole: when every row of the batch is already up
        # there is nothing to dedupe, resolve or pin (a direct tier never evicts).  The
        # kernel checks the ids' range and flags rows not up yet (NaN: see DirectHbmTier).
        packed = t.cfg.dtype != "float32"
        if direct and not backward and not packed and _pooled_by_id(t, bags, weights, out):
            t.count_hits(bags.ids.shape[0])
            return out, Forward.of(t, bags, "by_id")
        bags = checked(t, bags)
        if kernels is not None:
            if device_plan.applies(res, t, bags, backward):
                out, grouping = device_plan.pool(res, t, bags)
                return out, Forward.of(t, bags, "device_planned", grouping=grouping)
            return _pool_on_device(res, t, bags)
        if bags.uids.shape[0] > t.hbm.unpinned_capacity:  # spill path: rows gathered, pooled on the host
            pool_rows(gather(res, t, bags.uids, bags.inverse), bags, weights, out)
            return out, Forward.of(t, bags, "spill")
        if bags.uids.shape[0] == 0:
            out[:] = 0.0
            return out, Forward.of(t, bags, "host")
        for _, slots in res.chunks(t, bags.uids):  # (one chunk)
            if direct and not packed:  # slots are the ids
                pool_kernel(dim, True, use_w)(
                    t.hbm.records, _NO_SLOTS, bags.ids, False, 0, bags.offsets, weights, bags.mean, out
                )
            else:
                _pool_slots(t, slots, bags.inverse, bags, weights, out)
        return out, Forward.of(t, bags, "host", slots)


def _pool_slots(t, slots, inverse, plan, weights: np.ndarray, out: np.ndarray) -> None:
    """Pool ``plan``'s bags from ``t``'s HBM ``slots`` (one a unique id; ``inverse`` a
    position's unique id) into ``out``; a table of a narrow dtype by the kernel that decodes
    as it reads (:func:`tiered_emb.step.narrow.pool`)."""
    if t.cfg.dtype == "float32":
        pool = pool_kernel(t.cfg.dim, False, plan.weights is not None)
        pool(t.hbm.records, slots, inverse, False, 0, plan.offsets, weights, plan.mean, out)
        return
    narrow.pool(t.cfg.dtype, t.hbm.records, slots, inverse, plan, weights, out)


def _pool_on_device(res, t, bags: BagPlan) -> tuple[object, Forward]:
    """:func:`lookup_pooled` by the step's CUDA kernels: float32 (B, dim) on ``res.xp``, and the record."""
    kernels, dim = res.kernels, t.cfg.dim
    if bags.uids.shape[0] == 0:
        return res.xp.zeros((bags.num_bags, dim), dtype=res.xp.float32), Forward.of(t, bags, "device")
    if bags.uids.shape[0] <= t.hbm.unpinned_capacity:
        for _, slots in res.chunks(t, bags.uids):  # (one chunk)
            out = kernels.pool(t.hbm.records, slots, bags.inverse, bags.offsets, bags.weights, bags.mean, dim)
        return out, Forward.of(t, bags, "device", slots)
    # Spill path: rows gathered chunk by chunk, then pooled as rows of their own (slot i = position i).
    rows = kernels.asarray(gather(res, t, bags.uids, bags.inverse))
    positions = np.arange(bags.ids.shape[0], dtype=np.int64)
    out = kernels.pool(rows, positions, positions, bags.offsets, bags.weights, bags.mean, dim)
    return out, Forward.of(t, bags, "spill")


def _pooled_by_id(t, plan, weights: np.ndarray, out: np.ndarray) -> bool:
    """Pool ``plan`` from a direct tier by id, unchecked; False when a bag met an id out of
    range or a row not brought up yet (``out`` is then to be recomputed the checked way)."""
    pool = pool_kernel(t.cfg.dim, True, plan.weights is not None)
    flagged = pool(t.hbm.records, _NO_SLOTS, plan.ids, True, t.hbm.capacity_rows, plan.offsets, weights, plan.mean, out)
    return flagged == 0


__all__ = ["gather", "lookup_pooled", "pool_kernel", "pool_rows"]
