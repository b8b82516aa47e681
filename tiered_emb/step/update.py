"""Update: the table's optimizer applied once per unique id, in place on its HBM slots (the
backward's last stage).

Each optimizer has one body, a Numba kernel over ``records[slots[k]]`` (CPU), and a CUDA
twin that gives the same bytes (:mod:`tiered_emb.step.device.cuda_kernels`), launched by the
resolver's ``kernels`` when the HBM tier is on a GPU (:func:`apply_update`).
"""

from __future__ import annotations

import numba
import numpy as np

from tiered_emb._backend import to_xp
from tiered_emb._jit import PREFETCH_DISTANCE, kernel, pow_by_squaring, prefetch_row_hint, square_sums4, threads_for
from tiered_emb.cache.index import is_shared
from tiered_emb.errors import ConfigError
from tiered_emb.precision import records_of, rounding_key, values_of
from tiered_emb.step import narrow

# Each kernel updates records[slots[k]] with grads[k] for k in range(len(slots)),
# parallel over distinct rows (slots are distinct by construction: one per unique id).
# All arithmetic is float32 except the row-wise mean, accumulated in float64 in a fixed
# order, so results do not depend on the thread count.  Weight decay (the last two
# params: weight_decay, mode) as tiered_emb.optimizers says: L2 (mode 1) adds
# weight_decay * w to the gradient first; decoupled (mode 2) scales w by
# c = 1 - lr * weight_decay in the update, w = c * w - step; no decay (mode 0) is the
# plain update.


@numba.njit(inline="always")
def _decayed(g, w, wd, mode):
    """The gradient an update uses: with L2 decay (mode 1) ``g + wd * w``, else ``g``."""
    if mode == 1.0:
        return g + wd * w
    return g


@numba.njit(inline="always")
def _kept(lr, wd, mode):
    """What a row's weights are scaled by before its step: ``1 - lr * wd`` when decoupled (mode 2), else 1."""
    if mode == 2.0:
        return np.float32(1.0) - lr * wd
    return np.float32(1.0)


@kernel(parallel=True)
def _sgd_update(records, slots, grads, params):
    lr = params[0]
    wd = params[1]
    mode = params[2]
    c = _kept(lr, wd, mode)
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        r = records[slots[k]]
        for j in range(dim):
            g = _decayed(grads[k, j], r[j], wd, mode)
            r[j] = c * r[j] - lr * g


@kernel(parallel=True)
def _adagrad_update(records, slots, grads, params):
    lr = params[0]
    eps = params[1]
    wd = params[2]
    mode = params[3]
    c = _kept(lr, wd, mode)
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        r = records[slots[k]]
        for j in range(dim):
            g = _decayed(grads[k, j], r[j], wd, mode)
            s = r[dim + j] + g * g
            r[dim + j] = s
            r[j] = c * r[j] - lr * (g / (np.sqrt(s) + eps))


@numba.njit(inline="always")
def _rowwise_row(r, g_row, lr, eps, wd, mode, c, dim, mean):
    """One row's row-wise Adagrad step, the mean of its squared gradient ``mean`` given
    (float32 of the float64 sum of squares over the row's columns, divided by their count)."""
    s = r[dim] + mean
    r[dim] = s
    step = lr / (np.sqrt(s) + eps)
    for j in range(dim):
        g = _decayed(g_row[j], r[j], wd, mode)
        r[j] = c * r[j] - step * g


@numba.njit(inline="always")
def _square_sum(r, g_row, wd, mode, dim):
    """The float64 sum of a row's squared (decayed) gradient, in column order."""
    acc = 0.0
    for j in range(dim):
        g = np.float64(_decayed(g_row[j], r[j], wd, mode))
        acc += g * g
    return acc


@kernel(parallel=True)
def _rowwise_adagrad_update(records, slots, grads, params):
    """Row-wise Adagrad: one float32 state per row, the mean of the squared gradient
    accumulated in float64 in column order.

    Each row's float64 sum of squares still runs in column order; four independent rows
    interleaved hide the latency of that serial chain (without L2 decay, whose sum reads
    each row's weights: then row by row).
    """
    lr = params[0]
    eps = params[1]
    wd = params[2]
    mode = params[3]
    c = _kept(lr, wd, mode)
    k = slots.shape[0]
    dim = grads.shape[1]
    for q in numba.prange((k + 3) // 4):
        u0 = 4 * q
        for d in range(2 * PREFETCH_DISTANCE, 2 * PREFETCH_DISTANCE + 4):  # the rows four quads ahead
            if u0 + d < k:
                prefetch_row_hint(records, slots[u0 + d])
        if u0 + 4 <= k and mode != 1.0:
            accs = square_sums4(grads, u0)
            for d in range(4):
                mean = np.float32(accs[d] / dim)
                _rowwise_row(records[slots[u0 + d]], grads[u0 + d], lr, eps, wd, mode, c, dim, mean)
        else:
            for u in range(u0, min(u0 + 4, k)):
                r = records[slots[u]]
                acc = _square_sum(r, grads[u], wd, mode, dim)
                _rowwise_row(r, grads[u], lr, eps, wd, mode, c, dim, np.float32(acc / dim))


@kernel(parallel=True)
def _rowwise_adagrad_given(records, slots, grads, params, means):
    """Row-wise Adagrad of rows that hold some of their table's columns (a column piece):
    each row's mean of the squared gradient over *every* column is given (``means`` float32
    (k,)), as the whole row's kernel forms it; the rest is that kernel's."""
    lr = params[0]
    eps = params[1]
    wd = params[2]
    mode = params[3]
    c = _kept(lr, wd, mode)
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        _rowwise_row(records[slots[k]], grads[k], lr, eps, wd, mode, c, dim, means[k])


@kernel(parallel=True)
def _adam_update(records, slots, grads, params):
    lr, b1, b2, eps = params[0], params[1], params[2], params[3]
    wd, mode = params[4], params[5]
    c = _kept(lr, wd, mode)
    one = np.float32(1.0)
    dim = grads.shape[1]
    for k in numba.prange(slots.shape[0]):
        r = records[slots[k]]
        t = r[3 * dim] + one
        r[3 * dim] = t
        c1 = one - np.float32(pow_by_squaring(np.float64(b1), np.int64(t)))
        c2 = one - np.float32(pow_by_squaring(np.float64(b2), np.int64(t)))
        for j in range(dim):
            g = _decayed(grads[k, j], r[j], wd, mode)
            m = b1 * r[dim + j] + (one - b1) * g
            v = b2 * r[2 * dim + j] + (one - b2) * g * g
            r[dim + j] = m
            r[2 * dim + j] = v
            r[j] = c * r[j] - lr * ((m / c1) / (np.sqrt(v / c2) + eps))


CPU_KERNELS = {
    "sgd": _sgd_update,
    "adagrad": _adagrad_update,
    "rowwise_adagrad": _rowwise_adagrad_update,
    "adam": _adam_update,
}


def no_update() -> None:
    """The update of an empty batch (what a prepared update is when there is nothing to do)."""


def apply_update(opt, records, slots, grads, kernels=None, row_means=None) -> None:
    """Update ``records[slots]`` in place with ``grads`` (one row per distinct slot).

    Parameters
    ----------
    opt : SGD | Adagrad | RowWiseAdagrad | Adam
    records : float32 array (capacity, dim + state_width), on the device of ``kernels``
    slots : int64 array (k,), distinct
    grads : float32 array (k, dim), host, or device with ``kernels``
    kernels : :class:`~tiered_emb.step.device.launch.DeviceKernels` or None (the host's Numba kernels)
    row_means : float32 array (k,) or None: row-wise Adagrad's means of the squared gradient,
        given for rows holding part of their columns (:class:`tiered_emb.step.backward.SplitRows`)
    """
    if row_means is not None:
        if kernels is not None or opt.name != "rowwise_adagrad":
            raise ConfigError(
                "a row mean given from outside takes row-wise Adagrad on the host",
                "hold the table's HBM tier on the CPU (TierConfig(device='cpu'))",
            )
        _rowwise_adagrad_given(records, slots, grads, opt.params(), row_means)
        return
    if kernels is not None:
        kernels.update(opt, records, slots, grads)
        return
    CPU_KERNELS[opt.name](records, slots, grads, opt.params())


@kernel
def _still_resident(slot_ids, owner, tab, slots, uids):
    """True when every ``slots[u]`` still holds ``uids[u]`` of table ``tab`` (``owner``: a
    shared tier's, or empty); its record is then the row's newest."""
    shared = is_shared(owner)
    for u in range(uids.shape[0]):
        s = slots[u]
        if slot_ids[s] != uids[u] or (shared and owner[s] != tab):
            return False
    return True


def admitted(t, uids: np.ndarray, summed):
    """``(uids, summed, at)``: those of an update's ids (distinct) that ``t``'s admission lets
    through, each counted one sighting (:mod:`tiered_emb.admission`), and their positions
    ``at`` among ``uids`` (None: all of them)."""
    if t.admission is None or uids.shape[0] == 0:
        return uids, summed, None
    ok = t.admission.sight(uids)
    if ok.all():
        return uids, summed, None
    at = np.flatnonzero(ok)
    return uids[at], summed[at], at


def rounding(res, t) -> int | None:
    """The key of the random bits of ``t``'s next update: (seed, table, step, the update's
    number in the step), the number then moved on (:mod:`tiered_emb.precision`); None where
    nothing rounds stochastically (float32 rows and state, ``rounding="nearest"``), and
    nothing is counted."""
    if not t.cfg.packed or t.cfg.rounding == "nearest":
        return None
    t.updates += 1
    return rounding_key(res.seed, t.key_hash, res.step, t.updates - 1)


def _apply(res, t, slots, uids: np.ndarray, grads, row_means, key: int | None) -> None:
    """:func:`apply_update` on ``t``'s HBM ``slots`` (of ``uids``); rows of a narrower dtype
    or state are read as float32, updated, and rounded back: stochastically with ``key``'s
    bits, to nearest where it is None."""
    if not t.cfg.packed:
        apply_update(t.cfg.optimizer, t.hbm.records, slots, grads, res.kernels, row_means)
        return
    cfg = t.cfg
    if key is not None and narrow.update(cfg, t.hbm.records, slots, uids, grads, key, row_means):
        return
    values = values_of(cfg, t.hbm.records, slots)
    apply_update(cfg.optimizer, values, np.arange(slots.shape[0], dtype=np.int64), grads, None, row_means)
    t.hbm.records[slots, : cfg.record_width] = records_of(cfg, values, uids, key, cfg.init_column)


def update_rows(
    res, t, uids: np.ndarray, summed: np.ndarray, checked: bool = False, row_means=None, key: int | None = -1
) -> None:
    """One optimizer update per unique id of table ``t``, chunk by chunk in HBM (``summed``
    float32 (k, dim), screened); ``checked`` as :meth:`~tiered_emb.step.resolve.Resolver.chunks`;
    ``row_means`` as :func:`apply_update`; ``key`` the update's rounding (-1: the table's
    next, :func:`rounding`)."""
    if key == -1:
        key = rounding(res, t)
    for start, slots in res.chunks(t, uids, checked):
        part = uids[start : start + slots.shape[0]]
        chunk = summed[start : start + slots.shape[0]]
        means = None if row_means is None else row_means[start : start + slots.shape[0]]
        _apply(res, t, slots, part, chunk, means, key)
        t.hbm.dirty[slots] = 1
        touched(res, t, slots, part)


def touched(res, t, slots, uids: np.ndarray) -> None:
    """Mark ``t``'s HBM ``slots`` (of ``uids``) as updated at the store's step, where its rows expire."""
    if t.expiry is not None:
        t.expiry.touch(t.hbm.records, to_xp(res.xp, slots), uids, res.step, res.xp)


def update_pooled(res, window, t, fwd, uids: np.ndarray, summed: np.ndarray, work: int, row_means=None) -> None:
    """The pooled backward's update: on the slots the forward found (``fwd.slots``, ``fwd`` its
    :class:`~tiered_emb.step.plan.Forward`) when they still hold these ids, else resolved
    again as ``apply_gradients`` does.  The ids the
    table's admission holds back are dropped first (:func:`admitted`).

    While the batch's rows are pinned for it by the prefetch window no lock is taken
    (pinned slots are never victims); a backward run after its batch's step has moved on
    (gradients accumulated over batches, say) finds its slots perhaps given to other
    rows, and takes the locked path at once.  ``row_means`` as :func:`apply_update`.
    """
    slots = fwd.slots if uids is fwd.uids else None
    key = rounding(res, t)  # (before the path is chosen: the same bits whichever is taken)
    if t.admission is not None:
        with res.lock:  # (the counts change under the store's lock, as the rows)
            uids, summed, at = admitted(t, uids, summed)
        if at is not None and slots is not None:
            slots = slots[at]
        if at is not None and row_means is not None:
            row_means = row_means[at]
    if fwd.ticket is not None and slots is not None and window.still_pinned(fwd.ticket):
        with threads_for(work):
            if _update_in_place(res, t, slots, uids, summed, key, pinned=True, row_means=row_means):
                return
    with res.lock, threads_for(work):
        if not _update_in_place(res, t, slots, uids, summed, key, row_means=row_means):
            update_rows(res, t, uids, summed, checked=True, row_means=row_means, key=key)


def _update_in_place(res, t, slots, uids, summed, key, pinned: bool = False, row_means=None) -> bool:
    """Update ``slots`` (the forward's, of ``uids``; None: none) in place when they still hold
    ``uids`` (always, when ``pinned``); False, with nothing changed, where the rows must be
    resolved again."""
    if slots is None:
        return False
    if not pinned and not _still_resident(t.hbm.slot_ids, t.hbm.owner, t.hbm.tab, slots, uids):
        return False
    _apply(res, t, slots, uids, summed, row_means, key)
    t.hbm.dirty[slots] = 1
    touched(res, t, slots, uids)
    return True


__all__ = ["CPU_KERNELS", "apply_update", "no_update", "rounding", "update_pooled", "update_rows"]
