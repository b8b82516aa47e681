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
from tiered_emb.errors import ConfigError, StoreClosedError
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


def forward_of(t, step) -> plan.Forward:
    """The :class:`~tiered_emb.step.plan.Forward` a pooled backward of table ``t`` consumes:
    ``step`` itself (a lookup's record, of ``t``), or a record of nothing read for ``step``
    a :class:`~tiered_emb.step.plan.BagPlan` (checked for ``t`` here: the backward of bags no
    lookup of this store read, as a data-parallel owner's).  ConfigError for a record of
    another table, or of a lookup no backward follows."""
    if isinstance(step, plan.BagPlan):
        return plan.Forward.unread(plan.checked(t, step))
    if step.backend == "by_id":
        raise ConfigError(
            f"the forward of table {t.cfg.name!r} was read for no backward (lookup_pooled(backward=False))",
            "look the batch up with backward=True before its backward",
        )
    if step.table is not t:
        raise ConfigError(
            f"a backward of table {t.cfg.name!r} got the forward record of table {step.table.cfg.name!r} "
            "(of this store or another)",
            "hand each backward the record its own table's lookup_pooled returned",
        )
    return step


def pooled_update(res, window, t, step, grad_out: Any, nonfinite: str) -> Callable[[], None]:
    """``apply_pooled_gradients`` of table ``t`` in two halves, as :func:`gradient_update`;
    ``step``: the lookup's :class:`~tiered_emb.step.plan.Forward`, or a
    :class:`~tiered_emb.step.plan.BagPlan` no lookup read (:func:`forward_of`)."""
    table = t.cfg.name
    nonfinite_rule(nonfinite)
    kernels = res.kernels  # with the step's CUDA kernels a device gradient stays on the device
    fwd = forward_of(t, step)
    grad_out = table_rows(table, grad_out, fwd.num_bags, t.cfg.dim, "bag gradients", kernels is not None)
    if fwd.ids.shape[0] == 0:
        return update.no_update
    if fwd.backend == "device_planned":  # grouped on the device
        apply = device_plan.update(res, t, fwd, grad_out, nonfinite)
        with res.lock:
            res.ssd.raise_failed_write()
        return apply
    work = fwd.ids.shape[0] * t.cfg.dim
    summed, bad = reduce.reduce_bag_grads(fwd, grad_out, kernels)
    uids, summed = reduce.screen_nonfinite(table, fwd.uids, summed, bad.astype(bool), nonfinite)
    with res.lock:
        res.ssd.raise_failed_write()
    return lambda: update.update_pooled(res, window, t, fwd, uids, summed, work)


class SplitRows:
    """The pooled update of a row-wise Adagrad table that holds some of its rows' columns
    (a column piece of a sharded table), in the halves that let the pieces share one row
    state: the row's float64 sum of squared gradients runs over every column in order,
    piece after piece, so each piece continues the sum the piece before it reached
    (:meth:`square_sums`), and updates with the whole row's mean (:meth:`update`); the
    result is bitwise the whole row's update (``_rowwise_adagrad_update``).

    Built as :func:`pooled_update`'s first half (every check, the reduction; ``nonfinite``
    "raise" or "zero": a piece cannot skip a row its neighbours update).
    """

    def __init__(self, res, window, t, step, grad_out: Any, nonfinite: str):
        table = t.cfg.name
        nonfinite_rule(nonfinite)
        if t.cfg.optimizer.name != "rowwise_adagrad" or res.kernels is not None or nonfinite == "skip":
            raise ConfigError(
                f"table {table!r}: a split row update takes row-wise Adagrad on the host, nonfinite 'raise' or 'zero'",
                "hold column pieces of row-wise Adagrad tables on the CPU, with nonfinite='raise' or 'zero'",
            )
        fwd = forward_of(t, step)
        grad_out = table_rows(table, grad_out, fwd.num_bags, t.cfg.dim, "bag gradients")
        self.res, self.window, self.t, self.fwd = res, window, t, fwd
        self.work = fwd.ids.shape[0] * t.cfg.dim
        if fwd.ids.shape[0] == 0:
            self.uids, self.summed = fwd.ids, np.zeros((0, t.cfg.dim), np.float32)
        else:
            summed, bad = reduce.reduce_bag_grads(fwd, grad_out)
            self.uids, self.summed = reduce.screen_nonfinite(table, fwd.uids, summed, bad.astype(bool), nonfinite)
        with res.lock:
            res.ssd.raise_failed_write()

    def square_sums(self, start: np.ndarray) -> np.ndarray:
        """``start`` (float64 (k,), one a unique id) plus the squares of this piece's
        (decayed) gradient columns, in column order, as the whole row's kernel sums them."""
        params = self.t.cfg.optimizer.params()
        wd, mode = params[2], params[3]
        acc = np.array(start, dtype=np.float64, copy=True)
        if mode == 1.0 and self.uids.shape[0]:  # L2: the gradient reads the weights
            with self.res.lock:
                w = self.res.read_through(self.t, self.uids, np.empty(0, np.int64), self.t.cfg.dim)
        for j in range(self.summed.shape[1]):
            g = self.summed[:, j] + wd * w[:, j] if mode == 1.0 else self.summed[:, j]
            g64 = g.astype(np.float64)
            acc += g64 * g64
        return acc

    def update(self, means: np.ndarray) -> None:
        """The update, each row with ``means`` (float32 (k,)): the whole row's mean of squares."""
        if self.uids.shape[0]:
            update.update_pooled(self.res, self.window, self.t, self.fwd, self.uids, self.summed, self.work, means)


__all__ = ["SplitRows", "forward_of", "gradient_update", "pooled_update"]
