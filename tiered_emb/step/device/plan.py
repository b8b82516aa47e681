"""The pooled step of a table held whole in HBM on the device: planned there, not on the host.

On a GPU the host's plan is most of a resident step: deduping the batch's ids and
grouping their positions by id take longer than the step's kernels (docs/gpu.md).  A
table held whole (a direct tier: row ``id`` lives in slot ``id``) needs neither for its
forward, and its backward can group on the device:

- the forward brings up the rows of the batch not up yet (their ids deduped on the host:
  a few, once the table is warm) and pools by id;
- the positions sorted by id with a stable sort give each unique id's positions in batch
  order, the order the host's reduce sums them in, so the per-id sums are bitwise the
  host's; the ids come out in id order instead of first-occurrence order, which changes no
  row (each row's update is its own);
- the backward reduces over that grouping and updates the rows by id.

The counters are the host path's: ``lookups`` and ``hits`` count the batch's unique ids,
``misses`` those brought up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tiered_emb._backend import to_host, to_xp
from tiered_emb.step import reduce
from tiered_emb.step.plan import dedupe
from tiered_emb.step.update import admitted, apply_update, update_rows


@dataclass
class DeviceGrouping:
    """The batch's positions grouped by unique id, on the device (``xp`` arrays).

    ``uids`` int64 (k,) in increasing order; ``starts`` int64 (k+1,); ``bag`` int32 (n,) and
    ``scale`` float32 (n,) as :func:`tiered_emb.step.reduce.group_bag_positions`' (the same
    values, the ids numbered in id order).
    """

    uids: object
    starts: object
    bag: object
    scale: object


def applies(res, t, plan, backward: bool) -> bool:
    """Whether :func:`pool` serves this lookup: the device kernels, a direct tier, a backward to
    come, and bags numbered as int32 (as the device reduce takes them)."""
    return res.kernels is not None and t.hbm.direct and backward and plan.ids.shape[0] > 0 and plan.num_bags < 2**31


def pool(res, t, plan):
    """The pooled forward of ``plan`` (ids checked) from a direct tier on the device:
    ``(out, grouping)``, the :class:`DeviceGrouping` for :func:`update`.  Call under ``res.lock``."""
    xp, kernels, dim = res.xp, res.kernels, t.cfg.dim
    n = plan.ids.shape[0]
    use_w = plan.weights is not None
    staged = [(plan.ids, np.int64), (plan.offsets, np.int64)] + ([(plan.weights, np.float32)] if use_w else [])
    ids_d, offsets_d, *w = kernels.stage(*staged)
    positions = xp.arange(n, dtype=xp.int64)
    grouping = _group(xp, plan, ids_d, offsets_d, positions, w[0] if use_w else None)
    k = int(grouping.uids.shape[0])
    res.check_budget(t, k)  # (before any row moves, as on the host path)
    missing = plan.ids[t.hbm.find(plan.ids) < 0]  # not up yet, with repeats, in batch order
    m = 0
    if missing.shape[0]:
        up = dedupe(missing)[0]  # first-occurrence order, as the host path brings them up
        m = up.shape[0]
        for _ in res.chunks(t, up):  # brought up, and counted as lookups that missed
            pass
    out = kernels.pool(t.hbm.records, ids_d, positions, offsets_d, w[0] if use_w else None, plan.mean, dim)
    t.count_hits(k - m)  # (those brought up were counted by their resolve)
    return out, grouping


def _group(xp, plan, ids_d, offsets_d, positions, weights_d) -> DeviceGrouping:
    n = positions.shape[0]
    order = xp.argsort(ids_d, kind="stable")  # positions by id, batch order within an id
    by_id = ids_d[order]
    new = xp.empty(n, dtype=bool)
    new[:1] = True
    xp.not_equal(by_id[1:], by_id[:-1], out=new[1:])
    first = xp.flatnonzero(new)
    starts = xp.concatenate([first, xp.asarray([n], dtype=xp.int64)])
    bag_of = xp.searchsorted(offsets_d, positions, side="right") - 1  # the last bag starting at or before i
    bag = bag_of[order].astype(xp.int32)
    scale = xp.ones(n, dtype=xp.float32)
    if plan.mean:
        lengths = (offsets_d[1:] - offsets_d[:-1]).astype(xp.float32)
        per_bag = xp.float32(1.0) / xp.maximum(lengths, xp.float32(1.0))  # an empty bag has no position
        scale = per_bag[bag_of][order]
    if weights_d is not None:
        scale = scale * weights_d[order]
    return DeviceGrouping(by_id[first], starts, bag, scale)


def update(res, t, fwd, grad_out, nonfinite: str) -> Callable[[], None]:
    """The fused backward of :func:`pool`'s forward (``fwd``: its
    :class:`~tiered_emb.step.plan.Forward`): reduce on the device's grouping, screen,
    then a callable that updates the rows by id (as ``pooled_update``'s)."""
    g = fwd.grouping
    summed, bad = res.kernels.reduce_bags(grad_out, (g.starts, g.bag, g.scale))
    if bad.any():  # the rare non-finite case is settled on the host, as on the host path: the
        # rows left are resolved again (and counted) as apply_gradients does
        uids, summed = reduce.screen_nonfinite(t.cfg.name, to_host(g.uids), summed, bad.astype(bool), nonfinite)
        return lambda: _update_again(res, t, uids, summed)
    if t.admission is not None:
        return lambda: _admit_then_apply(res, t, g.uids, summed, fwd.ids)
    return lambda: _apply(res, t, g.uids, summed, fwd.ids)


def _admit_then_apply(res, t, uids, summed, ids: np.ndarray) -> None:
    """:func:`_apply` of the ids ``t``'s admission lets through (each counted a sighting)."""
    host = to_host(uids)
    with res.lock:
        ok = t.admission.sight(host)
    if ok.all():
        _apply(res, t, uids, summed, ids)
    elif ok.any():
        at = np.flatnonzero(ok)
        _update_again(res, t, host[at], summed[to_xp(res.xp, at)], admit=False)


def _apply(res, t, uids, summed, ids: np.ndarray) -> None:
    """The update of every row of the batch (``uids`` on the device, ``ids`` the batch's, on the host)."""
    with res.lock:
        apply_update(t.cfg.optimizer, t.hbm.records, uids, summed, res.kernels)
        t.hbm.dirty[ids] = 1
        if t.expiry is not None:  # (the direct tier: a row's slot is its id)
            t.expiry.touch(t.hbm.records, uids, np.unique(ids), res.step, res.xp)


def _update_again(res, t, uids: np.ndarray, summed, admit: bool = True) -> None:
    with res.lock:
        if admit:
            uids, summed, _ = admitted(t, uids, summed)
        update_rows(res, t, uids, summed, checked=True)


__all__ = ["DeviceGrouping", "applies", "pool", "update"]
