"""The backward's two halves as the store offers them: every check and the reduction first (what
they raise, they raise having changed nothing), then a callable that applies the update
under the store's lock (:meth:`tiered_emb.TieredStore.gradient_update`, ``pooled_update``).

Between the two, nothing of the store changes: a backward through several tables checks
them all before it updates any, and ``GradScaler`` may skip the whole step.  The admission
counts change as an update applies (:func:`.update.admitted`), never at the check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tiered_emb._args import nonfinite_rule, table_ids, table_rows
from tiered_emb.errors import StoreClosedError
from tiered_emb.step import plan, reduce, update
from tiered_emb.step.device import plan as device_plan


def gradient_update(res, t, ids: Any, grads: Any, nonfinite: str) -> Callable[[], None]:
    """``apply_gradients`` of table ``t`` in two halves (see the module docstring)."""
    table = t.cfg.name
    ids = table_ids(table, ids, t.cfg.num_rows)
    g = table_rows(table, grads, ids.shape[0], t.cfg.dim, "gradients")
    nonfinite_rule(nonfinite)
    if ids.shape[0] == 0:
        return update.no_update
    uids, inverse = plan.dedupe(ids)
    summed = reduce.reduce_grads(g, inverse, uids.shape[0])
    bad = None if reduce.all_finite(summed) else ~np.isfinite(summed).all(axis=1)
    uids, summed = reduce.screen_nonfinite(table, uids, summed, bad, nonfinite)
    with res.lock:
        res.ssd.raise_failed_write()

    def run() -> None:
        with res.lock:
            if res.closed:
                raise StoreClosedError(f"store {res.where!r} is closed", "open it again with TieredStore.open")
            kept, part, _ = update.admitted(t, uids, summed)  # (counted as the update applies)
            update.update_rows(res, t, kept, part, checked=True)

    return run


def pooled_update(res, window, t, bags: plan.BagPlan, grad_out: Any, nonfinite: str) -> Callable[[], None]:
    """``apply_pooled_gradients`` of table ``t`` in two halves, as :func:`gradient_update`."""
    table = t.cfg.name
    nonfinite_rule(nonfinite)
    kernels = res.kernels  # with the step's CUDA kernels a device gradient stays on the device
    grad_out = table_rows(table, grad_out, bags.num_bags, t.cfg.dim, "bag gradients", kernels is not None)
    if bags.checked is not t:  # not already checked by lookup_pooled for this table
        table_ids(table, bags.ids, t.cfg.num_rows)
    if bags.ids.shape[0] == 0:
        return update.no_update
    grouped = bags.device_grouping
    if isinstance(grouped, device_plan.DeviceGrouping) and grouped.table is t:  # grouped on the device
        apply = device_plan.update(res, t, bags, grad_out, nonfinite)
        with res.lock:
            res.ssd.raise_failed_write()
        return apply
    work = bags.ids.shape[0] * t.cfg.dim
    summed, bad = reduce.reduce_bag_grads(bags, grad_out, kernels)
    uids, summed = reduce.screen_nonfinite(table, bags.uids, summed, bad.astype(bool), nonfinite)
    with res.lock:
        res.ssd.raise_failed_write()
    return lambda: update.update_pooled(res, window, t, bags, uids, summed, work)


__all__ = ["gradient_update", "pooled_update"]
