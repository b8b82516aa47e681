"""The autograd functions of the torch modules: pooled rows read from the store, and a backward
that hands their gradient to the store's optimizer."""

from __future__ import annotations

import numpy as np
import torch

from tiered_emb.errors import BackwardError
from tiered_emb.step.plan import BagPlan


def after_backward(update, ctx, spent: tuple[str, ...]) -> None:
    """Run ``update`` (a table's checked and reduced gradient step) once the whole backward
    pass has succeeded, not now; then clear the ``spent`` attributes of ``ctx``, the first of
    which marks the update as applied (a second backward through it raises :class:`BackwardError`).

    Why: autograd calls each table's backward on its own, so a backward through several
    tables whose gradient for one holds NaN (``nonfinite="raise"``) updated the tables
    before it and raised at that one: half a step, which a caller who skips the batch
    could not undo.  Each backward checks its gradient at once (the error stops the pass)
    and queues its update on the autograd engine, which runs the queued callbacks, in
    order, only at the end of a pass that raised nothing: every table or none.  The checks
    include a failed write-back left by an earlier operation (a full disk), and the queued
    updates leave one met among them to the next operation, so that failure too stops the
    pass before any table changes.
    """

    def run() -> None:
        update()
        for name in spent:
            setattr(ctx, name, None)

    torch.autograd.Variable._execution_engine.queue_callback(run)


class Batch:
    """One forward's plan, kept for its backward."""

    def __init__(self, store, table: str, plan: BagPlan, nonfinite: str):
        self.store, self.table, self.plan, self.nonfinite = store, table, plan, nonfinite


class FusedBags(torch.autograd.Function):
    """Pooled rows from the store; backward = the store's optimizer (host NumPy HBM)."""

    @staticmethod
    def forward(ctx, anchor, weights_t, batch: Batch):
        out = batch.store.lookup_pooled(batch.table, batch.plan)
        ctx.batch = batch
        ctx.weights_need_grad = weights_t is not None and weights_t.requires_grad
        if ctx.weights_need_grad:
            ctx.weights_shape, ctx.weights_device = weights_t.shape, weights_t.device
            # d out[b] / d w_i = row_i: rows as read now (before the backward updates them).
            ctx.rows = batch.store.peek(batch.table, batch.plan.ids)
        return torch.from_numpy(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        batch = ctx.batch
        if batch is None:
            raise BackwardError(
                "a second backward through an embedding output whose update the store already "
                "applied (backward(retain_graph=True), then another backward)",
                "sum the losses and call backward once; the store applies its optimizer in backward",
            )
        g = np.ascontiguousarray(grad_out.detach().cpu().numpy(), dtype=np.float32)
        grad_w = None
        if ctx.weights_need_grad:
            plan = batch.plan
            bag_of = np.repeat(np.arange(plan.num_bags), np.diff(plan.offsets))
            grad_w = torch.from_numpy(np.einsum("nd,nd->n", ctx.rows, g[bag_of]).astype(np.float32))
            grad_w = grad_w.reshape(ctx.weights_shape).to(ctx.weights_device)  # the weights' own shape: (n,) or (B, L)
        # ctx.rows go with the update: a pass that fails leaves them for the backward run again
        after_backward(batch.store.pooled_update(batch.table, batch.plan, g, batch.nonfinite), ctx, ("batch", "rows"))
        return None, grad_w, None


class RowsFromStore(torch.autograd.Function):
    """Rows of ``ids`` as a tensor (DLPack view); backward hands their gradient to the store."""

    @staticmethod
    def forward(ctx, anchor, store, table: str, ids: np.ndarray, nonfinite: str):
        rows = store.lookup(table, ids)
        ctx.args = (store, table, ids, nonfinite)
        return torch.from_dlpack(rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        if ctx.args is None:
            raise BackwardError(
                "a second backward through embedding rows whose update the store already applied",
                "sum the losses and call backward once; the store applies its optimizer in backward",
            )
        store, table, ids, nonfinite = ctx.args
        g = grad_rows.detach().contiguous()
        g = g.cpu().numpy() if store.xp is np else store.xp.from_dlpack(g)
        after_backward(store.gradient_update(table, ids, g, nonfinite=nonfinite), ctx, ("args",))
        return None, None, None, None, None
