"""Pooled lookups and their fused backward: bags of ids straight from the HBM slots.

The plain path of a bag forward is ``store.lookup(ids)`` (one (n, dim) row per id,
gathered) followed by pooling; its backward is one gradient row per id, summed per
unique id by the store.  For a batch of 8,192 bags x 20 ids x dim 128 those two
intermediate (n, dim) arrays are 80 MiB each, written and read once: the cost of the
step.  Here instead

forward   dedupe once -> resolve the unique ids in HBM (pinned while the forward reads
          them when some had to come up) -> pool each bag directly from
          ``records[slots[inverse[i]]]`` (no gathered copy);
backward  for each unique id, sum ``w_i * grad_out[bag(i)]`` over its positions in batch
          order (no per-position copy) -> the table's optimizer on its slots.

Both produce bitwise the values of the plain path: the same float32 products, summed
in the same order (position order inside a bag, batch order per unique id), and the
optimizer's arithmetic unchanged.  The backward updates the slots the forward found
when they still hold the same ids (checked id by id; a slot holding its id holds the
row's newest record), without resolving them again: one HBM lookup per batch instead of
the plain path's two, so the policy sees one touch per batch.  Otherwise (rows evicted
in between) it resolves them as :meth:`TieredStore.apply_gradients` does.  A batch with
more unique ids than HBM holds, or a CuPy HBM, takes the plain, chunked path.

A table held whole in a direct HBM tier (row id = slot) pools ``records[ids[i]]``; in
inference (``backward=False``) it does not even dedupe, and the kernel itself catches
ids out of range and rows not brought up yet (see :func:`lookup_pooled`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numba
import numpy as np

from tiered_emb.errors import ConfigError, IdRangeError, IdTypeError
from tiered_emb.kernels import (_REDUCE_BLOCKS, PREFETCH_DISTANCE, _blocks_by_work, _group_starts, _local_f32, _pool_bags,
                      _prefetch, _prefetch_row, dedupe)
from tiered_emb.optimizers import _adagrad_update, _adam_update, _no_update, _sgd_update


@dataclass
class BagPlan:
    """The ids of one batch of bags, planned once for forward and backward.

    Attributes
    ----------
    ids : int64 (n,)
    offsets : int64 (B + 1,), bag b is ``ids[offsets[b]:offsets[b+1]]``
    weights : float32 (n,) or None, per-sample weights
    mean : bool, divide each bag by its length
    uids : int64 (k,), unique ids in first-occurrence order (deduped on first use: a
        no-grad forward over a table held whole in HBM never needs them)
    inverse : int64 (n,), ``uids[inverse[i]] == ids[i]``
    """

    ids: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    mean: bool
    slots: np.ndarray | None = None  # HBM slots of uids at the forward (fused path), for the backward
    pinned: object = None  # the prefetch ticket that pinned ``slots`` for this batch (see TieredStore._pinned_batch)
    # The store table whose id range ``ids`` were last checked against (the ids never change);
    # ``slots``, when set, are that table's: a lookup sets both.
    checked: object = None
    _unique: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_bags(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def uids(self) -> np.ndarray:
        return self._deduped()[0]

    @property
    def inverse(self) -> np.ndarray:
        return self._deduped()[1]

    def _deduped(self) -> tuple[np.ndarray, np.ndarray]:
        if self._unique is None:
            self._unique = dedupe(self.ids)
        return self._unique


def plan_bags(ids: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None = None,
              mean: bool = False) -> BagPlan:
    """Check a batch of bags; its ids are deduped when first needed.

    Parameters
    ----------
    ids : int64 (n,)
    offsets : int64 (B + 1,), non-decreasing, ``offsets[0] == 0``, ``offsets[-1] == n``
    weights : float32 (n,), optional
    mean : bool

    Examples
    --------
    >>> p = plan_bags(np.array([4, 2, 4]), np.array([0, 2, 3]))
    >>> p.uids.tolist(), p.num_bags
    ([4, 2], 2)
    """
    ids = _int64_of(ids, "ids")
    offsets = _int64_of(offsets, "offsets")
    if ids.ndim != 1:
        raise IdTypeError(f"ids have shape {ids.shape}", "pass 1-D ids (ravel them)")
    if offsets.ndim != 1 or offsets.shape[0] < 1 or offsets[0] != 0 or offsets[-1] != ids.shape[0] \
            or (offsets.shape[0] > 1 and bool((np.diff(offsets) < 0).any())):
        raise IdTypeError(f"offsets {offsets[:8].tolist()}... do not describe bags of {ids.shape[0]} ids",
                          "give non-decreasing offsets starting at 0 (and ending at len(ids) with include_last_offset)")
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if weights.shape != ids.shape:
            raise ConfigError(f"per_sample_weights have shape {weights.shape}, ids {ids.shape}",
                              "give one weight per id")
    return BagPlan(ids, offsets, weights, bool(mean))


def _int64_of(a, what: str) -> np.ndarray:
    """``a`` as int64, or IdTypeError (not integers) / IdRangeError (uint64 beyond int64): never truncated."""
    a = np.asarray(a)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise IdTypeError(f"{what} have dtype {a.dtype}", f"pass integer {what}, e.g. np.asarray(x, dtype=np.int64)")
    if a.dtype == np.uint64 and a.size and int(a.max()) > 2**63 - 1:
        raise IdRangeError(f"{what} hold {int(a.max())}, beyond int64", "ids are int64 >= 0")
    return np.ascontiguousarray(a, dtype=np.int64)


# Below this many float32 elements of work a batch runs its kernels on one thread: waking
# the thread pool costs more than the work, and far more when torch's OpenMP threads are
# still spinning on the same cores.  Results do not depend on the thread count.
_SERIAL_BELOW = 1 << 16


@contextmanager
def _threads_for(work: int):
    if work >= _SERIAL_BELOW or numba.get_num_threads() == 1:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)


# --------------------------------------------------------------------------- kernels
def _pool_kernel(dim: int, direct: bool, weighted: bool):
    """The pooling kernel for rows of ``dim`` floats, compiled once per (dim, direct, weighted)
    (and cached on disk).

    With ``dim`` a compile-time constant the bag's running sum is a local array the
    compiler keeps in registers, where a view of ``out`` must go through memory on every
    row (it may alias ``records``): measured 1.93 -> 1.6 ms for 8,192 bags x 20 rows of
    dim 128, the whole forward's budget against ``torch.nn.EmbeddingBag``.  ``weighted``
    fixed at compile time too keeps a branch out of the row loop (~0.1 ms of 1.5).
    """
    kernel = _POOL_KERNELS.get((dim, direct, weighted))
    if kernel is not None:
        return kernel

    @numba.njit(parallel=True, cache=True, nogil=True)
    def _pool_rows(records, slots, index, guard, num_rows, offsets, weights, mean, out):
        """``out[b] = sum_i w_i * records[row(i), :dim]`` over bag b, in position order.

        ``row(i)`` is ``index[i]`` itself for a ``direct`` kernel (row id = slot, ``slots``
        unused), else ``slots[index[i]]``.  The arithmetic of :func:`tiered_emb.kernels._pool_bags` on
        rows it never copies.  ``records`` float32 (cap, W >= dim); ``out`` float32 (B, dim).

        With ``guard`` (a direct tier's ids, not validated yet) a bag stops at an id
        outside ``[0, num_rows)``, and a bag whose sum is NaN is flagged too: a direct
        tier's rows not brought up yet are NaN, stored rows finite.  Returns the number
        of bags flagged; any sends the caller to the checked path.
        """
        n = index.shape[0]
        flagged = 0
        for b in numba.prange(out.shape[0]):
            acc = _local_f32(dim)  # on the stack: in registers (see _local_f32)
            for j in range(dim):
                acc[j] = 0.0
            lo = offsets[b]
            hi = offsets[b + 1]
            bad = 0
            for i in range(lo, hi):
                if i + PREFETCH_DISTANCE < n:  # a hint: never faults, even on an unchecked id
                    ahead = index[i + PREFETCH_DISTANCE] if direct else slots[index[i + PREFETCH_DISTANCE]]
                    for c in range(0, dim, 16):  # the row's lines, not the optimizer state after them
                        _prefetch(records, (ahead, c))
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

    _POOL_KERNELS[(dim, direct, weighted)] = _pool_rows
    return _pool_rows


_POOL_KERNELS: dict = {}


@numba.njit(cache=True, nogil=True)
def _group_bag_positions(inverse, offsets, weights, use_weights, mean, k, starts, bag, scale):
    """Counting sort of the batch's positions by unique id, stable (batch order within an id).

    For ``q`` in ``starts[u]:starts[u+1]`` (int64 (k+1,)): ``bag[q]`` (int32, int64 past 2**31 bags) is the bag
    of u's q-th position ``i`` and ``scale[q]`` (float32) its factor ``w_i`` (times 1/len
    with ``mean``), as :func:`_unpool_grads` forms it.  The reduce then reads both in
    order instead of through a permutation (measured 2.8 -> 1.7 ms with 2 threads).
    """
    fill = _group_starts(inverse, k, starts)
    for b in range(offsets.shape[0] - 1):
        lo = offsets[b]
        hi = offsets[b + 1]
        s = np.float32(1.0)
        if mean and hi > lo:
            s = np.float32(1.0) / np.float32(hi - lo)
        for i in range(lo, hi):
            u = inverse[i]
            q = fill[u]
            fill[u] = q + 1
            bag[q] = b
            scale[q] = s * (weights[i] if use_weights else np.float32(1.0))


def _reduce_kernel(dim: int):
    """The backward's reduce for rows of ``dim`` floats, compiled once per dim (cached on disk).

    Each id's sum is a stack array in registers (:func:`tiered_emb.kernels._local_f32`),
    written to ``out`` once, and the work is cut by positions (:func:`_blocks_by_work`):
    measured 4.8 -> 2.8 ms for 8,192 bags x 20 ids of dim 128 on 2 threads.
    """
    kernel = _REDUCE_KERNELS.get(dim)
    if kernel is not None:
        return kernel

    @numba.njit(parallel=True, cache=True, nogil=True)
    def _reduce_bag_grads(grad_out, starts, bag, scale, bounds, out, bad):
        """Per unique id u: ``sum scale[q] * grad_out[bag[q]]`` over q in ``starts[u]:starts[u+1]``.

        With ``bag`` and ``scale`` from :func:`_group_bag_positions` (each id's positions in
        batch order), bitwise :func:`_unpool_grads` followed by :func:`_reduce_grads`.
        ``grad_out`` float32 (B, dim); ``out`` float32 (k, dim); ``bad[u]`` (uint8 (k,)) = 1
        where a sum is not finite; ``bounds`` from :func:`_blocks_by_work`.
        """
        n = bag.shape[0]
        for blk in numba.prange(bounds.shape[0] - 1):
            for u in range(bounds[blk], bounds[blk + 1]):
                acc = _local_f32(dim)
                for j in range(dim):
                    acc[j] = 0.0
                for q in range(starts[u], starts[u + 1]):
                    if q + PREFETCH_DISTANCE < n:  # the bag row a few positions on
                        ahead = np.int64(bag[q + PREFETCH_DISTANCE])
                        for c in range(0, dim, 16):
                            _prefetch(grad_out, (ahead, c))
                    w = scale[q]
                    g = grad_out[np.int64(bag[q])]
                    for j in range(dim):
                        acc[j] += w * g[j]
                finite = True
                for j in range(dim):
                    finite &= np.isfinite(acc[j])
                    out[u, j] = acc[j]
                bad[u] = 0 if finite else 1

    _REDUCE_KERNELS[dim] = _reduce_bag_grads
    return _reduce_bag_grads


_REDUCE_KERNELS: dict = {}


@numba.njit(parallel=True, cache=True, nogil=True)
def _rowwise_adagrad_by_four(records, slots, grads, params):
    """:func:`tiered_emb.optimizers._rowwise_adagrad_update`, bitwise, four rows at a time.

    Each row's float64 sum of squares still runs in column order; four independent rows
    interleaved hide the latency of that serial chain.
    """
    lr = params[0]
    eps = params[1]
    k = slots.shape[0]
    dim = grads.shape[1]
    for q in numba.prange((k + 3) // 4):
        u0 = 4 * q
        for d in range(2 * PREFETCH_DISTANCE, 2 * PREFETCH_DISTANCE + 4):  # the rows four quads ahead
            if u0 + d < k:
                _prefetch_row(records, slots[u0 + d])
        if u0 + 4 <= k:
            a0 = 0.0
            a1 = 0.0
            a2 = 0.0
            a3 = 0.0
            for j in range(dim):
                g0 = np.float64(grads[u0, j])
                g1 = np.float64(grads[u0 + 1, j])
                g2 = np.float64(grads[u0 + 2, j])
                g3 = np.float64(grads[u0 + 3, j])
                a0 += g0 * g0
                a1 += g1 * g1
                a2 += g2 * g2
                a3 += g3 * g3
            accs = (a0, a1, a2, a3)
            for d in range(4):
                r = records[slots[u0 + d]]
                s = r[dim] + np.float32(accs[d] / dim)
                r[dim] = s
                step = lr / (np.sqrt(s) + eps)
                for j in range(dim):
                    r[j] = r[j] - step * grads[u0 + d, j]
        else:
            for u in range(u0, k):
                r = records[slots[u]]
                acc = 0.0
                for j in range(dim):
                    g = np.float64(grads[u, j])
                    acc += g * g
                s = r[dim] + np.float32(acc / dim)
                r[dim] = s
                step = lr / (np.sqrt(s) + eps)
                for j in range(dim):
                    r[j] = r[j] - step * grads[u, j]


# --------------------------------------------------------------------------- the two halves
def lookup_pooled(store, table: str, plan: BagPlan, backward: bool = True) -> np.ndarray:
    """Pooled rows of every bag of ``plan``: float32 (B, dim), host NumPy.

    Bitwise equal to pooling ``store.lookup(table, plan.ids)`` with
    :func:`tiered_emb.kernels._pool_bags`.  ``backward=False`` (inference) lets a table
    held whole in HBM skip the dedupe: its rows are read by id, and each position counts
    as one HBM lookup (with ``backward`` each unique id does, as everywhere else).
    """
    t = store._table(table)
    dim = t.cfg.dim
    out = np.empty((plan.num_bags, dim), dtype=np.float32)
    use_w = plan.weights is not None
    weights = plan.weights if use_w else np.empty(0, dtype=np.float32)
    plan.slots = None
    plan.pinned = None
    if backward:
        pinned = store._pinned_batch(table, plan.ids)
        if pinned is not None:
            # Every row is pinned in HBM for this very batch: pool from its slots with no
            # dedupe (the window did it), no resolve and no lock (the worker may be placing
            # the next batch's rows meanwhile; it never moves these).
            ticket, uids, inverse, slots = pinned
            plan._unique = (uids, inverse)
            plan.slots, plan.pinned = slots, ticket
            plan.checked = t  # the same ids as handed to prefetch(), which checked them
            with _threads_for(plan.ids.shape[0] * dim):
                _pool_kernel(dim, False, use_w)(t.hbm.records, slots, inverse, False, 0, plan.offsets, weights,
                                                plan.mean, out)
            c = t.counters["hbm"]
            c["lookups"] += uids.shape[0]
            c["hits"] += uids.shape[0]
            return out
    direct = t.hbm.direct and store.xp is np
    # The store's lock (re-entrant) for the whole read: a prefetch thread must not pin or
    # evict between the capacity check and the pooling (one chunk, so ``inverse`` indexes ``slots``).
    with store._lock, _threads_for(plan.ids.shape[0] * dim):
        if direct and not backward:
            # Inference over a table held whole: when every row of the batch is already up
            # there is nothing to dedupe, resolve or pin (a direct tier never evicts).  The
            # kernel checks the ids' range and flags rows not up yet (NaN: see DirectHbmTier).
            if not _pool_kernel(dim, True, use_w)(t.hbm.records, _NO_SLOTS, plan.ids, True, t.hbm.capacity_rows,
                                                  plan.offsets, weights, plan.mean, out):
                c = t.counters["hbm"]
                c["lookups"] += plan.ids.shape[0]
                c["hits"] += plan.ids.shape[0]
                return out
        if plan.checked is not t:  # (a collection checks every feature before reading any)
            store._ids(t, plan.ids)  # validation: range and num_rows
            plan.checked = t
        if store.xp is np and plan.uids.shape[0] <= t.hbm.unpinned_capacity:
            if plan.uids.shape[0] == 0:
                out[:] = 0.0
                return out
            for _, slots in store._chunks(t, plan.uids):
                if direct:  # slots are the ids
                    _pool_kernel(dim, True, use_w)(t.hbm.records, _NO_SLOTS, plan.ids, False, 0, plan.offsets,
                                                   weights, plan.mean, out)
                else:
                    _pool_kernel(dim, False, use_w)(t.hbm.records, slots, plan.inverse, False, 0, plan.offsets,
                                                    weights, plan.mean, out)
                plan.slots = slots
            return out
        # Spill path (or a GPU HBM): rows gathered by the store, pooled on the host.
        rows = store.lookup(table, plan.ids)
        rows = rows if isinstance(rows, np.ndarray) else rows.get()
        _pool_bags(rows, plan.offsets, weights, use_w, plan.mean, out)
    return out


_NO_SLOTS = np.empty(0, dtype=np.int64)


def reduce_bag_grads(plan: BagPlan, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of every unique id of ``plan`` from the bags' gradient ``grad_out`` (B, dim).

    Returns ``(summed, bad)``: float32 (k, dim) summed in batch order per id, and uint8
    (k,) flags of the ids whose sum holds NaN or infinity.
    """
    k = plan.uids.shape[0]
    n = plan.ids.shape[0]
    starts = np.empty(k + 1, dtype=np.int64)
    bag = np.empty(n, dtype=np.int32 if plan.num_bags < 2**31 else np.int64)
    scale = np.empty(n, dtype=np.float32)
    use_w = plan.weights is not None
    _group_bag_positions(plan.inverse, plan.offsets, plan.weights if use_w else np.empty(0, dtype=np.float32), use_w,
                         plan.mean, k, starts, bag, scale)
    bounds = np.empty(_REDUCE_BLOCKS + 1, dtype=np.int64)
    _blocks_by_work(starts, _REDUCE_BLOCKS, bounds)
    out = np.empty((k, grad_out.shape[1]), dtype=np.float32)
    bad = np.empty(k, dtype=np.uint8)
    _reduce_kernel(grad_out.shape[1])(np.ascontiguousarray(grad_out, dtype=np.float32), starts, bag, scale, bounds,
                                      out, bad)
    return out, bad


def apply_pooled_gradients(store, table: str, plan: BagPlan, grad_out: np.ndarray,
                           nonfinite: str = "raise") -> None:
    """The fused backward: the table's optimizer applied once per unique id of ``plan``.

    Parameters
    ----------
    grad_out : float32 (B, dim), the gradient of the pooled output
    nonfinite : as :meth:`TieredStore.apply_gradients`

    Bitwise equal to ``store.apply_gradients(table, plan.ids, unpooled)`` where
    ``unpooled`` is each position's gradient row, and checked as strictly: a gradient of
    another shape or dtype, or ids out of the table's range, raise and change nothing.
    """
    pooled_update(store, table, plan, grad_out, nonfinite)()


def pooled_update(store, table: str, plan: BagPlan, grad_out: np.ndarray, nonfinite: str = "raise"):
    """:func:`apply_pooled_gradients` in two halves: every check and the reduction now (what
    it raises, it raises here, having changed nothing), the update when the returned
    callable is called.  A backward through several tables checks them all before it
    updates any (:mod:`tiered_emb.torch`)."""
    t = store._table(table)
    if nonfinite not in ("raise", "skip", "zero"):
        raise ConfigError(f"nonfinite={nonfinite!r} is invalid", "use 'raise', 'skip' or 'zero'")
    grad_out = store._rows(t, grad_out, plan.num_bags, "bag gradients")
    if plan.checked is not t:  # not already checked by lookup_pooled for this table
        store._ids(t, plan.ids)
    if plan.ids.shape[0] == 0:
        return _no_update
    work = plan.ids.shape[0] * t.cfg.dim
    with _threads_for(work):
        summed, bad = reduce_bag_grads(plan, grad_out)
    uids, summed = store._screen_nonfinite(t, plan.uids, summed, bad.astype(bool), nonfinite)
    store.raise_failed_write()

    def update() -> None:
        if plan.pinned is not None and plan.checked is t and store._still_pinned(plan.pinned):
            # Its rows are still pinned for it (see lookup_pooled): no lock, unless the locked
            # path must answer (no fused kernel, or ids skipped), which resolves them again.  A
            # backward run after its batch's step (gradients accumulated over batches, say)
            # finds its slots perhaps given to other rows, and goes there at once.
            with _threads_for(work):
                if _update_pooled(store, t, plan, uids, summed, pinned=True):
                    return
        with store._lock, _threads_for(work):  # see lookup_pooled
            _update_pooled(store, t, plan, uids, summed)
    return update


def _update_pooled(store, t, plan: BagPlan, uids, summed, pinned: bool = False) -> bool:
    """Update ``uids`` by their (screened) ``summed`` gradients; True when done.  With ``pinned``
    (no lock held: ``plan.slots`` are pinned for this batch) only the fused in-place update
    is done; False, with nothing changed, where the locked path must answer."""
    opt = t.cfg.optimizer
    update = _FUSED_UPDATES.get(opt.name) if store.xp is np else None
    slots = plan.slots if plan.checked is t else None  # slots of this table's forward only
    if update is not None and slots is not None and uids is plan.uids \
            and (pinned or _still_resident(t.hbm.slot_ids, slots, uids)):
        # The forward's slots still hold these ids: update them without resolving again.
        update(t.hbm.records, slots, summed, opt.params())
        t.hbm.dirty[slots] = 1
        return True
    if pinned:
        return False
    store._update_rows(t, uids, summed, update, checked=True)  # by pooled_update
    return True


@numba.njit(cache=True, nogil=True)
def _still_resident(slot_ids, slots, uids):
    """True when every ``slots[u]`` still holds ``uids[u]`` (its record is then the row's newest)."""
    for u in range(uids.shape[0]):
        if slot_ids[slots[u]] != uids[u]:
            return False
    return True


_FUSED_UPDATES = {"rowwise_adagrad": _rowwise_adagrad_by_four, "sgd": _sgd_update, "adagrad": _adagrad_update,
                  "adam": _adam_update}


__all__ = ["BagPlan", "plan_bags", "lookup_pooled", "reduce_bag_grads", "apply_pooled_gradients", "pooled_update"]
