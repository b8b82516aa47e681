"""Reduce: the gradients of a batch summed per unique id, in batch order (the backward's first stage).

Two entries: :func:`reduce_grads` for one gradient row per position (``apply_gradients``),
:func:`reduce_bag_grads` for one gradient row per bag (the pooled backward, which never
forms the per-position rows).  Both sum each id's terms in batch-position order, so the
result is bitwise the same for any thread count; :func:`screen_nonfinite` applies the
caller's rule to ids whose sum is not finite.

An id seen more than :data:`REDUCE_CHUNK` times in a batch sums its terms a chunk of
``REDUCE_CHUNK`` positions at a time (each chunk in batch order from +0.0), then the
chunks' sums in order from +0.0.  For an id seen at most ``REDUCE_CHUNK`` times that is
the plain sum in batch order (``0.0 + s`` is ``s``, bit for bit); for a Zipf head seen
thousands of times it lets a GPU sum the chunks in parallel, and the host the same way.
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._backend import to_host
from tiered_emb._compiles import made_by
from tiered_emb._jit import PREFETCH_DISTANCE, kernel, local_f32, prefetch_hint, threads_for
from tiered_emb.errors import NonFiniteGradientError
from tiered_emb.step.plan import BagPlan


@numba.njit(inline="always")
def _group_starts(inverse, k, starts):
    """The counting sort's first half: ``starts`` (int64 (k+1,)) = where each unique index's
    positions begin; returns a copy of ``starts[:k]`` to fill from."""
    starts[:] = 0
    for i in range(inverse.shape[0]):
        starts[inverse[i] + 1] += 1
    for u in range(k):
        starts[u + 1] += starts[u]
    return starts[:k].copy()


@numba.njit(cache=True, nogil=True)  # (its counting sort copies the starts)
def group_positions(inverse, k, starts, order):
    """Counting sort of positions by unique index, stable: ``order[starts[u]:starts[u+1]]``
    are the positions of unique ``u`` in batch order.  ``starts`` int64 (k+1,)."""
    fill = _group_starts(inverse, k, starts)
    for i in range(inverse.shape[0]):
        u = inverse[i]
        order[fill[u]] = i
        fill[u] += 1


# Positions of one id summed in a row before their sum joins the id's total (see the module docstring).
REDUCE_CHUNK = 256

# Blocks of unique ids each thread's share of the reduce is cut into.  A Zipf batch's
# first ids (first-occurrence order) hold most positions: split evenly by id, one thread
# would get most of the work.
_REDUCE_BLOCKS = 64


@kernel
def blocks_by_work(starts, blocks, bounds):
    """Cut unique ids ``0..k`` into ``blocks`` runs of about equal work (positions + ids).

    ``starts`` int64 (k+1,) as :func:`group_positions`; writes ``bounds`` int64
    (blocks+1,), nondecreasing from 0 to k.  Only who computes what depends on it, never
    a result.
    """
    k = starts.shape[0] - 1
    total = starts[k] + k
    bounds[0] = 0
    lo = 0
    for b in range(1, blocks):
        target = total * b // blocks
        hi = k
        while lo < hi:  # first u with starts[u] + u >= target
            mid = (lo + hi) // 2
            if starts[mid] + mid < target:
                lo = mid + 1
            else:
                hi = mid
        bounds[b] = lo
    bounds[blocks] = k


@numba.njit(parallel=True, cache=True, nogil=True)
def _reduce_grads(grads, starts, order, bounds, out):
    """``out[u] = sum of grads[order[starts[u]:starts[u+1]]]`` in batch-position order (float32),
    a :data:`REDUCE_CHUNK` of positions at a time past that many.

    ``bounds`` from :func:`blocks_by_work`: each thread's share by positions, not ids.
    """
    dim = grads.shape[1]
    for blk in numba.prange(bounds.shape[0] - 1):
        part = np.empty(dim, dtype=np.float32)
        for u in range(bounds[blk], bounds[blk + 1]):
            for j in range(dim):
                out[u, j] = 0.0
            lo = starts[u]
            hi = starts[u + 1]
            for c in range(lo, hi, REDUCE_CHUNK):
                for j in range(dim):
                    part[j] = 0.0
                for q in range(c, min(c + REDUCE_CHUNK, hi)):
                    g = grads[order[q]]
                    for j in range(dim):
                        part[j] += g[j]
                for j in range(dim):
                    out[u, j] += part[j]


def reduce_grads(grads: np.ndarray, inverse: np.ndarray, k: int) -> np.ndarray:
    """Sum gradient rows of duplicate ids: float32 (n, dim) -> (k, dim), in batch order per id."""
    starts = np.empty(k + 1, dtype=np.int64)
    order = np.empty(inverse.shape[0], dtype=np.int64)
    group_positions(inverse, k, starts, order)
    bounds = np.empty(_REDUCE_BLOCKS + 1, dtype=np.int64)
    blocks_by_work(starts, _REDUCE_BLOCKS, bounds)
    out = np.empty((k, grads.shape[1]), dtype=np.float32)
    _reduce_grads(grads, starts, order, bounds, out)
    return out


@kernel
def all_finite(a: np.ndarray) -> bool:
    flat = a.reshape(-1)
    for i in range(flat.shape[0]):
        if not np.isfinite(flat[i]):
            return False
    return True


@numba.njit(cache=True, nogil=True)  # (its counting sort copies the starts)
def _group_bag_positions(inverse, offsets, weights, use_weights, mean, k, starts, bag, scale):
    """Counting sort of the batch's positions by unique id, stable (batch order within an id).

    For ``q`` in ``starts[u]:starts[u+1]`` (int64 (k+1,)): ``bag[q]`` (int32, int64 past 2**31 bags) is the bag
    of u's q-th position ``i`` and ``scale[q]`` (float32) its factor ``w_i`` (times 1/len
    with ``mean``), as :func:`tiered_emb.testing.reference.unpool_grads` forms it.  The reduce then reads both in
    order instead of through a permutation.
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


@numba.njit(inline="always")
def _add_bag_terms(acc, grad_out, bag, scale, lo, hi, dim, n):
    """``acc += scale[q] * grad_out[bag[q]]`` for q in ``lo:hi``, in order (``n`` = len(bag))."""
    for q in range(lo, hi):
        if q + PREFETCH_DISTANCE < n:  # the bag row a few positions on
            ahead = np.int64(bag[q + PREFETCH_DISTANCE])
            for c in range(0, dim, 16):
                prefetch_hint(grad_out, (ahead, c))
        w = scale[q]
        g = grad_out[np.int64(bag[q])]
        for j in range(dim):
            acc[j] += w * g[j]


def _reduce_kernel(dim: int):
    """The backward's reduce for rows of ``dim`` floats, compiled once per dim (cached on disk).

    Each id's sum is a stack array in registers (:func:`tiered_emb._jit.local_f32`),
    written to ``out`` once, and the work is cut by positions (:func:`blocks_by_work`)
    (docs/benchmarks.md, "Kernel choices").
    """
    found = _REDUCE_KERNELS.get(dim)
    if found is not None:
        return found

    @numba.njit(parallel=True, cache=True, nogil=True)  # (Numba's lowering of this loop allocates)
    def _reduce_bag_grads(grad_out, starts, bag, scale, bounds, out, bad):
        """Per unique id u: ``sum scale[q] * grad_out[bag[q]]`` over q in ``starts[u]:starts[u+1]``,
        a :data:`REDUCE_CHUNK` of positions at a time past that many.

        With ``bag`` and ``scale`` from :func:`_group_bag_positions` (each id's positions in
        batch order), bitwise :func:`tiered_emb.testing.reference.unpool_grads` followed by :func:`_reduce_grads`.
        ``grad_out`` float32 (B, dim); ``out`` float32 (k, dim); ``bad[u]`` (uint8 (k,)) = 1
        where a sum is not finite; ``bounds`` from :func:`blocks_by_work`.
        """
        n = bag.shape[0]
        for blk in numba.prange(bounds.shape[0] - 1):
            for u in range(bounds[blk], bounds[blk + 1]):
                acc = local_f32(dim)
                for j in range(dim):
                    acc[j] = 0.0
                lo = starts[u]
                hi = starts[u + 1]
                if hi - lo <= REDUCE_CHUNK:  # one chunk: its sum is the total (the common case)
                    _add_bag_terms(acc, grad_out, bag, scale, lo, hi, dim, n)
                else:
                    part = local_f32(dim)
                    for c in range(lo, hi, REDUCE_CHUNK):
                        for j in range(dim):
                            part[j] = 0.0
                        _add_bag_terms(part, grad_out, bag, scale, c, min(c + REDUCE_CHUNK, hi), dim, n)
                        for j in range(dim):
                            acc[j] += part[j]
                finite = True
                for j in range(dim):
                    finite &= np.isfinite(acc[j])
                    out[u, j] = acc[j]
                bad[u] = 0 if finite else 1

    _REDUCE_KERNELS[dim] = made_by(_reduce_bag_grads, _reduce_kernel, dim)
    return _reduce_bag_grads


_REDUCE_KERNELS: dict = {}


def group_bag_positions(plan: BagPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch's positions grouped by unique id, in batch order: ``(starts, bag, scale)``.

    ``starts`` int64 (k+1,); for q in ``starts[u]:starts[u+1]``, ``bag[q]`` (int32, int64
    past 2**31 bags) is the bag of unique id u's next position and ``scale[q]`` (float32)
    its weight times 1/len for a mean bag.  What the host's and the GPU's reduce walk.
    """
    k = plan.uids.shape[0]
    n = plan.ids.shape[0]
    starts = np.empty(k + 1, dtype=np.int64)
    bag = np.empty(n, dtype=np.int32 if plan.num_bags < 2**31 else np.int64)
    scale = np.empty(n, dtype=np.float32)
    use_w = plan.weights is not None
    _group_bag_positions(
        plan.inverse,
        plan.offsets,
        plan.weights if use_w else np.empty(0, dtype=np.float32),
        use_w,
        plan.mean,
        k,
        starts,
        bag,
        scale,
    )
    return starts, bag, scale


def reduce_bag_grads(plan: BagPlan, grad_out, kernels=None) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of every unique id of ``plan`` from the bags' gradient ``grad_out`` (B, dim).

    Returns ``(summed, bad)``: float32 (k, dim) summed in batch order per id, and uint8
    (k,) flags of the ids whose sum holds NaN or infinity.  With ``kernels``
    (:class:`~tiered_emb.step.device.launch.DeviceKernels`) the sums are made on the device and
    stay there (``grad_out`` host or device), bitwise the host's.
    """
    if kernels is not None:
        return kernels.reduce_bags(grad_out, group_bag_positions(plan))
    k = plan.uids.shape[0]
    n = plan.ids.shape[0]
    starts, bag, scale = group_bag_positions(plan)
    bounds = np.empty(_REDUCE_BLOCKS + 1, dtype=np.int64)
    blocks_by_work(starts, _REDUCE_BLOCKS, bounds)
    out = np.empty((k, grad_out.shape[1]), dtype=np.float32)
    bad = np.empty(k, dtype=np.uint8)
    with threads_for(n * grad_out.shape[1]):
        _reduce_kernel(grad_out.shape[1])(
            np.ascontiguousarray(grad_out, dtype=np.float32), starts, bag, scale, bounds, out, bad
        )
    return out, bad


def screen_nonfinite(table: str, uids: np.ndarray, summed: np.ndarray, bad: np.ndarray | None, nonfinite: str):
    """Apply the ``nonfinite`` rule to gradients summed per unique id.

    ``uids`` int64 (k,), ``summed`` float32 (k, dim), ``bad`` bool (k,) or None (all
    finite).  Returns ``(uids, summed)`` to update: all of them (``"zero"``: non-finite
    entries set to 0), those with a finite sum (``"skip"``), or raises
    :class:`NonFiniteGradientError` having changed nothing (``"raise"``).
    """
    if bad is None or not bad.any():
        return uids, summed
    summed = to_host(summed)  # sums made on a GPU: the rare non-finite case is settled on the host
    if nonfinite == "raise":
        raise NonFiniteGradientError(
            f"gradients of table {table!r} hold NaN/inf for {int(bad.sum())} ids (first id {int(uids[bad][0])})",
            "lower the learning rate or clip gradients; apply_gradients(..., nonfinite='skip'|'zero') tolerates them",
        )
    if nonfinite == "skip":
        return uids[~bad], summed[~bad]
    summed[~np.isfinite(summed)] = 0.0
    return uids, summed


__all__ = [
    "REDUCE_CHUNK",
    "all_finite",
    "blocks_by_work",
    "group_bag_positions",
    "group_positions",
    "reduce_bag_grads",
    "reduce_grads",
    "screen_nonfinite",
]
