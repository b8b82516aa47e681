"""PyTorch front end: ``nn.Module`` s over a :class:`~tiered_emb.TieredStore` (with ``apps/``, the only torch import).

The embedding rows never become torch parameters.  A forward reads them from the
store; the backward hands their gradients to the store, whose optimizer (the table's
``TableConfig.optimizer``) updates each touched row once, in place, in the HBM tier:
a *fused* backward, with no dense gradient and no torch optimizer for the embeddings.
Dense parameters of the surrounding model keep their torch optimizer as usual::

    emb = TieredEmbeddingBag(store, "user", mode="sum")
    out = mlp(emb(ids, offsets))          # (B, dim) pooled rows from the store
    loss.backward()                       # embedding rows updated here, by the store
    dense_opt.step()                      # the MLP's own optimizer

With the NumPy HBM tier (no GPU), the forward pools straight from the HBM slots and the
backward reduces the bags' gradients per unique id (:mod:`tiered_emb.step.reduce`); the
output is a zero-copy ``torch.from_numpy`` view.  With a CuPy HBM tier the rows cross
into torch by DLPack (no copy) and torch pools them on the GPU.

A forward with gradients enabled, in training mode, plans one backward (kept in the
autograd graph, freed with it); under ``torch.no_grad()``, in ``eval()`` or with
``freeze=True`` it plans no update.  As with any in-place update, run a batch's backward
before the rows it read are updated by another batch.

Loss scaling (``GradScaler``), gradient clipping and gradient accumulation need the update
held for a step instead: :class:`TieredOptimizer`.  :func:`save` / :func:`load` keep a whole
model (rows in the store's checkpoint, the dense state beside them); ``torch.compile``
sees each module as one custom op (:mod:`tiered_emb.torch.compiled`).  docs/faq.md.
"""

from tiered_emb.torch.checkpoint import load, save
from tiered_emb.torch.modules import TieredEmbedding, TieredEmbeddingBag, TieredEmbeddingBagCollection
from tiered_emb.torch.optim import TieredOptimizer
from tiered_emb.torch.pipeline import TrainPipeline

__all__ = [
    "TieredEmbedding",
    "TieredEmbeddingBag",
    "TieredEmbeddingBagCollection",
    "TieredOptimizer",
    "TrainPipeline",
    "load",
    "save",
]
