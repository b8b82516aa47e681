"""``torch.compile`` support: the pooled lookup and its backward as custom ops (``torch.library``)
with fake implementations, so a compiled model has one graph around the embedding call.

Under compilation a module's forward is a call of ``tiered_emb::pooled`` on its input
tensors; everything NumPy (coercion, planning, the store's lookup) runs inside the op,
eagerly, as in an uncompiled forward.  The op's backward, ``tiered_emb::pooled_backward``,
plans the batch again from the saved inputs (the ids are unchanged: they were copied) and
hands the gradient to the store as the uncompiled backward does: fused at the end of the
backward pass, held for a :class:`~tiered_emb.torch.TieredOptimizer`, or not at all.
It returns a gradient for the module's anchor tensor, so the compiled backward keeps it.

The ops find their module by a handle (``id(module)``, held weakly) that is a constant of
the graph.  ``mode="max"``, a GPU HBM and ``TieredEmbedding`` with a ``padding_idx`` are
not compiled (their forward breaks the graph and runs eagerly).
"""

import weakref

import numpy as np
import torch

from tiered_emb.errors import ConfigError
from tiered_emb.torch._autograd import Batch, hand_over, weights_grad
from tiered_emb.torch._inputs import bags_of

_MODULES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(module) -> int:
    """The handle the ops find ``module`` by."""
    _MODULES[id(module)] = module
    return id(module)


def _module(handle: int):
    m = _MODULES.get(handle)
    if m is None:
        raise ConfigError(f"no tiered module has handle {handle}", "call the module, not the op")
    return m


def _plan(m, ids, offsets, weights, mode: str, include_last_offset: bool):
    ids_np, off, shape = bags_of(ids, offsets, include_last_offset)
    plan, kept_weights = m.plan_batch(ids_np, off, weights, mode, shape)
    return ids_np, plan, kept_weights


@torch.library.custom_op("tiered_emb::pooled", mutates_args=())
def pooled(
    ids: torch.Tensor,
    offsets: torch.Tensor | None,
    weights: torch.Tensor | None,
    anchor: torch.Tensor,
    handle: int,
    mode: str,
    include_last_offset: bool,
    update: bool,
    autocast: str,
) -> torch.Tensor:
    """Pooled rows, float32 (B, dim), as ``TieredEmbeddingBag.forward`` (``anchor``: the
    module's, requiring grad when the forward plans an update; ``autocast``: the device type
    under a float16 autocast when the forward was traced, or "", :meth:`StoreModule.check_scaled`)."""
    m = _module(handle)
    m.check_not_distributed()
    m.check_scaled(update, autocast)
    _, plan, _ = _plan(m, ids, offsets, weights, mode, include_last_offset)
    return torch.from_numpy(m.store.engine.lookup_pooled(m.table, plan, backward=update)[0])


@pooled.register_fake
def _pooled_fake(ids, offsets, weights, anchor, handle, mode, include_last_offset, update, autocast):
    bags = ids.shape[0] if ids.dim() == 2 or offsets is None else offsets.shape[0] - int(include_last_offset)
    return ids.new_empty((bags, _module(handle).embedding_dim), dtype=torch.float32)


@torch.library.custom_op("tiered_emb::pooled_backward", mutates_args=())
def pooled_backward(
    grad: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor | None,
    weights: torch.Tensor | None,
    handle: int,
    mode: str,
    include_last_offset: bool,
    update: bool,
    need_weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gradient of the weights (their shape; empty without), gradient of the anchor (empty))``;
    the rows' update goes where the module's updates go."""
    m = _module(handle)
    ids_np, plan, _ = _plan(m, ids, offsets, weights, mode, include_last_offset)
    g = np.ascontiguousarray(grad.numpy(), dtype=np.float32)
    grad_w = torch.zeros(0)
    if need_weights_grad and weights is not None:
        kept = weights_grad(plan, m.store.peek(m.table, plan.ids), g)
        full = np.zeros(ids_np.size, dtype=np.float32)  # padding positions get 0, as in torch
        full[ids_np.reshape(-1) != m.padding_idx if m.padding_idx is not None else slice(None)] = kept
        grad_w = torch.from_numpy(full).reshape(weights.shape)
    if update:
        batch = Batch(m.store, m.table, plan, m.nonfinite, m.update_target)
        hand_over(
            batch,
            None,
            (),
            lambda: m.store.engine.pooled_update(m.table, plan, g, m.nonfinite),
            lambda: m.store.engine.reduce_pooled(plan, g),
        )
    return grad_w, torch.zeros(0)


@pooled_backward.register_fake
def _pooled_backward_fake(grad, ids, offsets, weights, handle, mode, include_last_offset, update, need_weights_grad):
    shape = weights.shape if need_weights_grad and weights is not None else (0,)
    return grad.new_empty(shape), grad.new_empty((0,))


def _setup_context(ctx, inputs, output) -> None:
    ids, offsets, weights, _anchor, handle, mode, include_last_offset, update, _autocast = inputs
    ctx.save_for_backward(ids, offsets, weights)
    need = weights is not None and weights.requires_grad
    ctx.args = (handle, mode, include_last_offset, update, need)


def _backward(ctx, grad):
    ids, offsets, weights = ctx.saved_tensors
    handle, mode, include_last_offset, update, need = ctx.args
    grad_w, grad_anchor = pooled_backward(
        grad.contiguous(), ids, offsets, weights, handle, mode, include_last_offset, update, need
    )
    return None, None, grad_w if need else None, grad_anchor, None, None, None, None, None


torch.library.register_autograd("tiered_emb::pooled", _backward, setup_context=_setup_context)
