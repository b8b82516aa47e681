"""The autograd functions of the torch modules: pooled rows read from the store, and a backward
that hands their gradient to the store's optimizer."""

from __future__ import annotations

import numpy as np
import torch

from tiered_emb.engine import BagPlan
from tiered_emb.errors import BackwardError


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


#: ``Batch.hold`` of a forward whose update the store applies at the end of its backward pass.
FUSED = "fused"


class Batch:
    """One forward's plan, kept for its backward, and where its update goes.

    ``hold``: :data:`FUSED` (the store applies the update when the backward pass ends),
    an object with ``add(store, table, ids, grads, nonfinite)`` that keeps the gradient
    for a later step (:class:`tiered_emb.torch.TieredOptimizer`), or None: no update (an
    ``eval()`` or frozen module; only ``per_sample_weights`` get their gradient).
    """

    def __init__(self, store, table: str, plan: BagPlan, nonfinite: str, hold=FUSED):
        self.store, self.table, self.plan, self.nonfinite, self.hold = store, table, plan, nonfinite, hold


def hand_over(batch: Batch, ctx, spent: tuple[str, ...], fused, reduced) -> None:
    """The update of ``batch``: ``fused()`` (the store's checked update, as a callable) when
    the store applies it, ``reduced()`` (``(unique ids, summed gradients)``) when it is held."""
    if batch.hold is None:
        return
    if batch.hold is FUSED:
        after_backward(fused(), ctx, spent)
        return
    ids, grads = reduced()
    # held at the end of a pass that raised nothing, as the fused update; a held gradient
    # adds up over backwards (as a torch parameter's), so a second backward is allowed
    after_backward(lambda: batch.hold.add(batch.store, batch.table, ids, grads, batch.nonfinite), ctx, ())


def weights_grad(plan: BagPlan, rows: np.ndarray, grad_out: np.ndarray) -> np.ndarray:
    """Gradient of each id's ``per_sample_weights`` entry, float32 (n,): ``rows[i] . grad_out[bag(i)]``
    (``rows``: the ids' rows as the forward read them, (n, dim))."""
    bag_of = np.repeat(np.arange(plan.num_bags), np.diff(plan.offsets))
    return np.einsum("nd,nd->n", rows, grad_out[bag_of]).astype(np.float32)


def _spent(what: str) -> BackwardError:
    return BackwardError(
        f"a second backward through {what} whose update the store already applied "
        "(backward(retain_graph=True), then another backward)",
        "sum the losses and call backward once; the store applies its optimizer in backward "
        "(or hold the gradients for a step with tiered_emb.torch.TieredOptimizer)",
    )


def as_tensor(a) -> torch.Tensor:
    """A tensor viewing ``a``, no copy: host NumPy, or a CuPy array on the GPU (by DLPack)."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


class FusedBags(torch.autograd.Function):
    """Pooled rows from the store; backward = the store's optimizer.

    With the HBM tier on a GPU the output is a CUDA tensor viewing the pooled CuPy array,
    and the gradient goes back to the store's kernels as a CuPy view of the CUDA tensor:
    the backward never leaves the device (only per-sample weights' gradient and a held
    update read it on the host).
    """

    @staticmethod
    def forward(ctx, anchor, weights_t, batch: Batch):
        out, ctx.forward = batch.store.engine.lookup_pooled(batch.table, batch.plan, backward=batch.hold is not None)
        ctx.batch = batch
        ctx.weights_need_grad = weights_t is not None and weights_t.requires_grad
        if ctx.weights_need_grad:
            ctx.weights_shape, ctx.weights_device = weights_t.shape, weights_t.device
            # d out[b] / d w_i = row_i: rows as read now (before the backward updates them).
            ctx.rows = batch.store.peek(batch.table, batch.plan.ids)
        return as_tensor(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        batch = ctx.batch
        if batch is None:
            raise _spent("an embedding output")
        g_t = grad_out.detach().contiguous()
        store = batch.store
        g = None if store.engine.xp is not np and not ctx.weights_need_grad else _host(g_t)
        grad_w = None
        if ctx.weights_need_grad:
            grad_w = torch.from_numpy(weights_grad(batch.plan, ctx.rows, g))
            grad_w = grad_w.reshape(ctx.weights_shape).to(ctx.weights_device)  # the weights' own shape: (n,) or (B, L)
        # ctx.rows go with the update: a pass that fails leaves them for the backward run again
        hand_over(
            batch,
            ctx,
            ("batch", "rows", "forward"),
            lambda: store.engine.pooled_update(
                batch.table, ctx.forward, g if g is not None else store.engine.xp.from_dlpack(g_t), batch.nonfinite
            ),
            lambda: store.engine.reduce_pooled(ctx.forward, g if g is not None else _host(g_t)),
        )
        return None, grad_w, None


def _host(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.cpu().numpy(), dtype=np.float32)


class RowsFromStore(torch.autograd.Function):
    """Rows of a batch's ids as a tensor (DLPack view); backward hands their gradient to the store."""

    @staticmethod
    def forward(ctx, anchor, batch: Batch):
        rows = batch.store.lookup(batch.table, batch.plan.ids)
        ctx.batch = batch
        return as_tensor(rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        batch = ctx.batch
        if batch is None:
            raise _spent("embedding rows")
        store = batch.store
        g = grad_rows.detach().contiguous()

        def reduced():
            return store.engine.reduce_rows(batch.plan.ids, np.ascontiguousarray(g.cpu().numpy(), np.float32))

        g_store = g.cpu().numpy() if store.engine.xp is np else store.engine.xp.from_dlpack(g)
        hand_over(
            batch,
            ctx,
            ("batch",),
            lambda: store.engine.gradient_update(batch.table, batch.plan.ids, g_store, nonfinite=batch.nonfinite),
            reduced,
        )
        return None, None
