"""``tiered-emb train --model torchrec``: TorchRec's own DLRM over the tiered collection.

The model is ``torchrec.models.dlrm.DLRM`` as TorchRec ships it, with
:class:`tiered_emb.torchrec.TieredEmbeddingBagCollection` as its
``embedding_bag_collection``: the job's batches go in as a ``KeyedJaggedTensor``, the
collection's ``KeyedTensor`` goes to TorchRec's interaction, and the backward updates
the rows in the store (fused), as in the built-in model.

Its dense weights start as the built-in model's of the same seed, so the two models are
the same function at step 0.  TorchRec orders the pairwise dot products by the upper
triangle (``(i, j)``, ``i < j``) where the built-in model takes the lower one (``i > j``),
so the top MLP's first layer gets its interaction columns reordered to match; that layer
then sums the same products in another order, and the two jobs' losses agree to float32
rounding, not bit for bit (docs/torchrec.md; with the built-in's pair order they are
equal bit for bit, ``tests/test_torchrec.py``).
"""

from __future__ import annotations

import torch

from tiered_emb.apps.clicks import NUM_DENSE
from tiered_emb.errors import ConfigError


class TorchRecDLRM(torch.nn.Module):
    """The job's call form, ``model(dense, feats) -> logits (B,)``, around TorchRec's DLRM.

    ``feats`` is the job's dict feature -> ``(values, lengths)``, made into one
    ``KeyedJaggedTensor`` (features in the order of ``features``) for ``dlrm``.
    """

    def __init__(self, dlrm, features: list[str]):
        super().__init__()
        self.dlrm = dlrm
        self.features = list(features)

    def forward(self, dense, feats):
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.features,
            values=torch.cat([feats[f][0] for f in self.features]),
            lengths=torch.cat([feats[f][1] for f in self.features]),
        )
        return self.dlrm(dense, kjt).squeeze(1)


def builtin_pairs(n: int) -> torch.Tensor:
    """The built-in model's pair order of ``n`` vectors: ``(2, n (n - 1) / 2)`` int64 rows, cols (``i > j``)."""
    return torch.tril_indices(n, n, offset=-1)


def copy_builtin_weights(builtin, model: TorchRecDLRM) -> None:
    """The built-in DLRM's dense weights into ``model``, layer by layer; the top MLP's first
    layer has its interaction columns reordered to ``model``'s pair order (an identity when
    that order is :func:`builtin_pairs`)."""
    src, dst = list(builtin.parameters()), list(model.parameters())
    if [tuple(p.shape) for p in src] != [tuple(p.shape) for p in dst]:
        raise ConfigError(
            "the built-in and the TorchRec DLRM have different layer shapes", "build both with the same sizes"
        )
    pairs = model.dlrm.inter_arch.triu_indices  # TorchRec's buffer: the pairs it takes, in order
    mine = builtin_pairs(int(pairs.max()) + 1)
    column = {(int(i), int(j)): k for k, (i, j) in enumerate(mine.t())}
    dim = model.dlrm.sparse_arch.D
    order = list(range(dim)) + [dim + column[max(int(a), int(b)), min(int(a), int(b))] for a, b in pairs.t()]
    with torch.no_grad():
        for s, d in zip(src, dst, strict=True):
            d.copy_(s[:, order] if s is builtin.top[0].weight else s)


def build_torchrec_model(
    store, features: list[str], dim: int, bottom: list[int], top: list[int], sharded=None
) -> TorchRecDLRM:
    """TorchRec's DLRM over ``store``'s tables (one per feature), weights as the built-in model's;
    with ``sharded`` (a :class:`tiered_emb.distributed.Shards`) over the job's sharded tables.

    Draws the dense weights from torch's global generator as :func:`~tiered_emb.apps.dlrm.build_model`
    does (seed it first), then copies them (:func:`copy_builtin_weights`).
    """
    from tiered_emb.apps.dlrm import build_model
    from tiered_emb.torchrec import TieredEmbeddingBagCollection

    builtin = build_model(store, features, dim, bottom, top, sharded=sharded)
    from torchrec.models.dlrm import DLRM  # imported by tiered_emb.torchrec already, its warnings handled there

    dlrm = DLRM(
        embedding_bag_collection=TieredEmbeddingBagCollection(store, features, sharded=sharded),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*bottom, dim],
        over_arch_layer_sizes=[*top, 1],
    )
    model = TorchRecDLRM(dlrm, features)
    copy_builtin_weights(builtin, model)
    return model


__all__ = ["TorchRecDLRM", "build_torchrec_model", "builtin_pairs", "copy_builtin_weights"]
